"""``SparseCategoricalCrossentropy``: the mean cross-entropy of class indices and predictions."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmirror.metrics.inputs import checked_sparse_labels
from jaxmirror.metrics.reduction import MeanMetricWrapper

# Keras's backend.epsilon(): probabilities are clipped to [EPSILON, 1 - EPSILON] before the log.
EPSILON = 1e-7


def sparse_categorical_crossentropy(y_true, y_pred, from_logits=False,
                                    api: str = "sparse_categorical_crossentropy"):
    """``-log p[y_true]`` per example, as Keras 3 computes it.

    Args:
        y_true: class indices of shape ``y_pred.shape[:-1]`` (or that plus a trailing 1); an
            index outside ``[0, classes)`` gives 0, as Keras's one-hot does.
        y_pred: probabilities (normalized to sum 1 and clipped to ``[1e-7, 1 - 1e-7]``) or,
            with ``from_logits``, logits; classes on the last axis.
        from_logits: whether ``y_pred`` holds logits.
        api: the API name errors start with.

    Returns:
        An array of shape ``y_pred.shape[:-1]`` (float32 for integer ``y_pred``).

    Raises:
        ValueError: for labels of another shape.
    """
    labels = checked_sparse_labels(api, y_true, y_pred)
    if not jnp.issubdtype(y_pred.dtype, jnp.floating):
        y_pred = y_pred.astype(jnp.float32)
    if from_logits:
        log_prob = jax.nn.log_softmax(y_pred, axis=-1)
    else:
        probs = y_pred / jnp.sum(y_pred, axis=-1, keepdims=True)
        log_prob = jnp.log(jnp.clip(probs, EPSILON, 1.0 - EPSILON))
    one_hot = jax.nn.one_hot(labels, y_pred.shape[-1], dtype=log_prob.dtype)
    return -jnp.sum(one_hot * log_prob, axis=-1)


class SparseCategoricalCrossentropy(MeanMetricWrapper):
    """The mean cross-entropy of class indices and predictions (``tf.keras.metrics.SparseCategoricalCrossentropy``).

    ``y_true`` holds class indices (shape ``(B,)`` or ``(B, 1)``), ``y_pred`` probabilities or
    logits of shape ``(B, classes)``; padded rows of a distributed batch are left out,
    ``sample_weight`` weighs examples.

    Args:
        name: the metric's name.
        dtype: the dtype of its state and result (float32 by default).
        from_logits: whether ``y_pred`` holds logits (else probabilities).

    Example:
        >>> import numpy as np, jaxmirror
        >>> from jaxmirror import metrics
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with s.scope():
        ...     xent = metrics.SparseCategoricalCrossentropy()
        >>> @s.run
        ... def step(labels, probs):
        ...     xent.update_state(labels, probs)
        >>> data = [(np.array([1, 2]), np.array([[0.05, 0.95, 0.0], [0.1, 0.8, 0.1]]))]
        >>> for labels, probs in s.experimental_distribute_dataset(data):
        ...     step(labels, probs)
        >>> round(float(xent.result()), 4)
        1.1769
    """

    def __init__(self, name="sparse_categorical_crossentropy", dtype=None, from_logits=False):
        super().__init__(sparse_categorical_crossentropy, name=name, dtype=dtype,
                         from_logits=bool(from_logits),
                         api=f"{type(self).__name__}.update_state")
