"""Keras metrics (``tf.keras.metrics``) on sync-on-read variables, exact on padded batches.

A metric made in a strategy's scope keeps its totals in sync-on-read variables (SUM). Inside
``strategy.run`` each replica adds its examples to its own component (the metric captured by
closure, as in TF's custom training loop), and ``metric.result()`` outside the step sums the
components. The padded rows of a distributed dataset's batches are left out, so a result equals
one device's over exactly the real examples. ``update_state`` also works eagerly, outside any
step, and ``reset_state()`` zeroes the state between epochs.

Modules:
    ``base``: ``Metric``: the base class (``add_weight``, ``reset_state``, ``__call__``).
    ``inputs``: argument checks, sample weights and the padded-row mask.
    ``accumulation``: how the state is added to, read and zeroed in each context.
    ``reduction``: ``Sum``, ``Mean`` and ``MeanMetricWrapper``.
    ``accuracy``: the accuracy metrics (``Accuracy``, ``SparseCategoricalAccuracy``, ...).
    ``probabilistic``: ``SparseCategoricalCrossentropy``.
    ``regression``: ``MeanSquaredError``.

Example:
    >>> import jax.numpy as jnp, numpy as np, jaxmirror
    >>> from jaxmirror import metrics
    >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
    >>> with s.scope():
    ...     loss_metric = metrics.Mean(name="loss")
    ...     accuracy = metrics.SparseCategoricalAccuracy()
    >>> @s.run
    ... def step(labels, probs):
    ...     per_example = -jnp.log(jnp.take_along_axis(probs, labels[:, None], axis=1)[:, 0])
    ...     loss_metric.update_state(per_example)
    ...     accuracy.update_state(labels, probs)
    >>> labels = np.array([0, 1, 1])   # 3 examples over 2 replicas: 2 + 1 rows, 1 padded
    >>> probs = np.array([[0.9, 0.1], [0.2, 0.8], [0.7, 0.3]])
    >>> for batch in s.experimental_distribute_dataset([(labels, probs)]):
    ...     step(*batch)
    >>> round(float(loss_metric.result()), 4), float(loss_metric.count.numpy())
    (0.5108, 3.0)
    >>> round(float(accuracy.result()), 4)
    0.6667
    >>> accuracy.reset_state()
    >>> float(accuracy.result())
    0.0
"""

from jaxmirror.metrics.accuracy import (
    Accuracy,
    BinaryAccuracy,
    CategoricalAccuracy,
    SparseCategoricalAccuracy,
)
from jaxmirror.metrics.base import Metric
from jaxmirror.metrics.probabilistic import SparseCategoricalCrossentropy
from jaxmirror.metrics.reduction import Mean, MeanMetricWrapper, Sum
from jaxmirror.metrics.regression import MeanSquaredError

__all__ = [
    "Accuracy", "BinaryAccuracy", "CategoricalAccuracy", "Mean", "MeanMetricWrapper",
    "MeanSquaredError", "Metric", "SparseCategoricalAccuracy", "SparseCategoricalCrossentropy",
    "Sum",
]
