"""``MeanSquaredError``: the mean squared difference of targets and predictions."""

from __future__ import annotations

import jax.numpy as jnp

from jaxmirror.metrics.inputs import checked_same_shape
from jaxmirror.metrics.reduction import MeanMetricWrapper


def mean_squared_error(y_true, y_pred, api: str = "mean_squared_error"):
    """``(y_true - y_pred) ** 2`` per example: averaged over the last axis from rank 2 on.

    Keras averages over the last axis at every rank; a rank-1 batch is one value per example
    here (Keras would make it one value per batch, and the metric a mean of batch means).

    Args:
        y_true: the targets.
        y_pred: the predictions, of ``y_true``'s shape (either may have one more trailing
            axis of size 1).
        api: the API name errors start with.

    Returns:
        An array of shape ``y_pred.shape[:-1]`` (rank >= 2) or ``y_pred.shape``.

    Raises:
        ValueError: for different shapes.
    """
    y_true, y_pred = checked_same_shape(api, y_true, y_pred)
    dtype = jnp.result_type(y_true.dtype, y_pred.dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        dtype = jnp.float32
    squared = jnp.square(y_true.astype(dtype) - y_pred.astype(dtype))
    return jnp.mean(squared, axis=-1) if squared.ndim >= 2 else squared


class MeanSquaredError(MeanMetricWrapper):
    """The mean squared error of predictions (``tf.keras.metrics.MeanSquaredError``).

    Per example the mean over the last axis of ``(y_true - y_pred) ** 2`` (for ``(B, D)``
    values; ``(B,)`` values are one number per example), then the (weighted) mean over the
    examples; padded rows of a distributed batch are left out.

    Args:
        name: the metric's name.
        dtype: the dtype of its state and result (float32 by default).

    Example:
        >>> import numpy as np, jaxmirror
        >>> from jaxmirror import metrics
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with s.scope():
        ...     mse = metrics.MeanSquaredError()
        >>> @s.run
        ... def step(y, pred):
        ...     mse.update_state(y, pred)
        >>> data = [(np.array([[0.0, 1.0], [0.0, 0.0]]), np.array([[1.0, 1.0], [0.0, 0.0]]))]
        >>> for y, pred in s.experimental_distribute_dataset(data):
        ...     step(y, pred)
        >>> float(mse.result())
        0.25
    """

    def __init__(self, name="mean_squared_error", dtype=None):
        super().__init__(mean_squared_error, name=name, dtype=dtype,
                         api=f"{type(self).__name__}.update_state")
