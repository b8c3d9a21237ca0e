"""The reducing metrics: ``Sum``, ``Mean`` and ``MeanMetricWrapper`` (the mean of a function)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxmirror.metrics.accumulation import add_to, read_totals
from jaxmirror.metrics.base import Metric
from jaxmirror.metrics.inputs import checked_array, example_weights


def _weighted(metric: Metric, values, sample_weight) -> tuple:
    """``(sum of weighted values, sum of weights)`` of a batch, its padded rows left out."""
    api = f"{type(metric).__name__}.update_state"
    values = checked_array(api, "values", values).astype(metric.dtype)
    values, weights = example_weights(api, values, sample_weight)
    return jnp.sum(values * weights), jnp.sum(weights)


def divide_no_nan(total, count):
    """``total / count``, and 0 where ``count`` is 0 (Keras's ``divide_no_nan``).

    Args:
        total: an array.
        count: an array of the same dtype.

    Returns:
        The quotient.
    """
    nonzero = count != 0
    return jnp.where(nonzero, total / jnp.where(nonzero, count, jnp.ones_like(count)),
                     jnp.zeros_like(total))


class Sum(Metric):
    """The (weighted) sum of the values given (``tf.keras.metrics.Sum``).

    Inside ``strategy.run``, rows that only pad a distributed batch are left out: values whose
    axis 0 has the padded batch's size are taken to hold one row per example.

    Args:
        name: the metric's name.
        dtype: the dtype of its state and result (float32 by default).

    Example:
        >>> import numpy as np, jaxmirror
        >>> from jaxmirror import metrics
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with s.scope():
        ...     total = metrics.Sum()
        >>> @s.run
        ... def step(x):
        ...     total.update_state(x)
        >>> for batch in s.experimental_distribute_dataset([np.array([1.0, 2.0, 3.0])]):
        ...     step(batch)
        >>> float(total.result())
        6.0
    """

    def __init__(self, name="sum", dtype=None):
        super().__init__(name=name, dtype=dtype)
        self.total = self.add_weight("total")

    def update_state(self, values, sample_weight=None) -> None:
        """Add ``sum(values * sample_weight)`` to the total.

        Args:
            values: an array of numbers (any shape).
            sample_weight: ``None``, or weights matching ``values`` (see ``Mean.update_state``).

        Raises:
            TypeError: when ``values`` or ``sample_weight`` is not numbers.
            ValueError: when ``sample_weight`` does not match ``values``.

        Example:
            >>> from jaxmirror import metrics
            >>> m = metrics.Sum()
            >>> m.update_state([1.0, 2.0], sample_weight=[1.0, 0.5])
            >>> float(m.result())
            2.0
        """
        total, _ = _weighted(self, values, sample_weight)
        add_to(f"{type(self).__name__}.update_state", [self.total], [total])

    def result(self):
        """The sum so far.

        Returns:
            A scalar array of the metric's dtype (the sum over every replica).

        Example:
            >>> from jaxmirror import metrics
            >>> float(metrics.Sum().result())
            0.0
        """
        return read_totals([self.total])[0]


class Mean(Metric):
    """The (weighted) mean of the values given (``tf.keras.metrics.Mean``).

    Keeps ``total`` (the weighted sum) and ``count`` (the sum of weights); ``result()`` is
    ``total / count``, 0 before any value. Inside ``strategy.run``, rows that only pad a
    distributed batch are left out of both: values whose axis 0 has the padded batch's size
    are taken to hold one row per example, so the mean is exactly that of the real examples.

    Args:
        name: the metric's name.
        dtype: the dtype of its state and result (float32 by default).

    Example:
        >>> import numpy as np, jaxmirror
        >>> from jaxmirror import metrics
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with s.scope():
        ...     mean = metrics.Mean()
        >>> @s.run
        ... def step(x):
        ...     mean.update_state(x)
        >>> for batch in s.experimental_distribute_dataset([np.array([1.0, 2.0]), np.array([6.0])]):
        ...     step(batch)
        >>> float(mean.result()), float(mean.count.numpy())
        (3.0, 3.0)
    """

    def __init__(self, name="mean", dtype=None):
        super().__init__(name=name, dtype=dtype)
        self.total = self.add_weight("total")
        self.count = self.add_weight("count")

    def update_state(self, values, sample_weight=None) -> None:
        """Add a batch of values: ``total += sum(values * w)``, ``count += sum(w)``.

        Args:
            values: an array of numbers (any shape; every element counts).
            sample_weight: ``None`` (every element weighs 1), a scalar, or weights matched to
                ``values`` as Keras does: a ``(B,)`` weight for ``(B, ...)`` values, a ``(B, 1)``
                weight for ``(B,)`` values, or any shape that broadcasts to ``values``.

        Raises:
            TypeError: when ``values`` or ``sample_weight`` is not numbers.
            ValueError: when ``sample_weight`` does not match ``values``.

        Example:
            >>> from jaxmirror import metrics
            >>> m = metrics.Mean()
            >>> m.update_state([1.0, 3.0], sample_weight=[3.0, 1.0])
            >>> float(m.result())
            1.5
        """
        total, count = _weighted(self, values, sample_weight)
        add_to(f"{type(self).__name__}.update_state", [self.total, self.count], [total, count])

    def result(self):
        """The mean so far: ``total / count``, 0 when ``count`` is 0.

        Returns:
            A scalar array of the metric's dtype, over every replica's examples (also inside
            a step, where it includes the updates made so far).

        Example:
            >>> from jaxmirror import metrics
            >>> float(metrics.Mean().result())
            0.0
        """
        total, count = read_totals([self.total, self.count])
        return divide_no_nan(total, count)


class MeanMetricWrapper(Mean):
    """The mean of ``fn(y_true, y_pred)`` over the examples (``tf.keras.metrics.MeanMetricWrapper``).

    ``fn`` returns one value per example (or per element); the accuracy and error metrics of
    this package are made this way. Padded rows are left out as in ``Mean``.

    Args:
        fn: called as ``fn(y_true, y_pred, **kwargs)`` on arrays; returns an array whose axis 0
            is the batch.
        name: the metric's name.
        dtype: the dtype of its state and result (float32 by default).
        **kwargs: passed to ``fn``.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxmirror import metrics
        >>> m = metrics.MeanMetricWrapper(lambda t, p: jnp.abs(t - p), name="mae")
        >>> m.update_state([1.0, 2.0], [2.0, 4.0])
        >>> m.name, float(m.result())
        ('mae', 1.5)
    """

    def __init__(self, fn, name=None, dtype=None, **kwargs):
        if not callable(fn):
            raise TypeError(f"{type(self).__name__}: `fn` must be callable; got {fn!r}.")
        super().__init__(name=name, dtype=dtype)
        self._fn = fn
        self._fn_kwargs = kwargs

    def update_state(self, y_true, y_pred, sample_weight=None) -> None:
        """Add ``fn(y_true, y_pred)`` of a batch, weighted by ``sample_weight``.

        Args:
            y_true: the true values (labels) of the batch.
            y_pred: the predictions of the batch.
            sample_weight: ``None``, or weights matched to ``fn``'s values as in
                ``Mean.update_state`` (typically one per example).

        Raises:
            TypeError: when an argument is not numbers.
            ValueError: when the shapes do not match (the message names the argument).

        Example:
            >>> from jaxmirror import metrics
            >>> m = metrics.Accuracy()
            >>> m.update_state([1, 2, 3, 4], [0, 2, 3, 4], sample_weight=[1.0, 1.0, 0.0, 0.0])
            >>> float(m.result())
            0.5
        """
        api = f"{type(self).__name__}.update_state"
        y_true = checked_array(api, "y_true", y_true)
        y_pred = checked_array(api, "y_pred", y_pred)
        super().update_state(self._fn(y_true, y_pred, **self._fn_kwargs), sample_weight)
