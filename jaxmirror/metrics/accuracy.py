"""The accuracy metrics: ``Accuracy``, ``BinaryAccuracy``, ``CategoricalAccuracy``,
``SparseCategoricalAccuracy``, and the per-example functions they average."""

from __future__ import annotations

import numbers

import jax.numpy as jnp

from jaxmirror.metrics.inputs import checked_same_shape, checked_sparse_labels
from jaxmirror.metrics.reduction import MeanMetricWrapper


def _matches(a, b):
    return (a == b).astype(jnp.float32)


def accuracy(y_true, y_pred, api: str = "accuracy"):
    """1.0 where ``y_pred`` equals ``y_true``, else 0.0, element by element (Keras's ``accuracy``).

    Args:
        y_true: the labels.
        y_pred: the predicted labels: ``y_true``'s shape (either may have one more trailing
            axis of size 1), cast to ``y_true``'s dtype to compare.
        api: the API name errors start with.

    Returns:
        A float32 array of the common shape.

    Raises:
        ValueError: for different shapes.
    """
    y_true, y_pred = checked_same_shape(api, y_true, y_pred)
    return _matches(y_true, y_pred.astype(y_true.dtype))


def binary_accuracy(y_true, y_pred, threshold=0.5, api: str = "binary_accuracy"):
    """1.0 where ``y_pred > threshold`` equals ``y_true``, element by element.

    As Keras 3's ``binary_accuracy`` (Keras 2 also averaged over the last axis; the mean of the
    elements is the same without sample weights).

    Args:
        y_true: the labels, 0 or 1.
        y_pred: probabilities (or scores) of ``y_true``'s shape.
        threshold: the value above which a prediction is 1.
        api: the API name errors start with.

    Returns:
        A float32 array of the common shape.

    Raises:
        ValueError: for different shapes.
    """
    y_true, y_pred = checked_same_shape(api, y_true, y_pred)
    return _matches(y_true, (y_pred > threshold).astype(y_true.dtype))


def categorical_accuracy(y_true, y_pred, api: str = "categorical_accuracy"):
    """1.0 where the largest entry of ``y_pred`` is at ``y_true``'s (one-hot) class.

    Args:
        y_true: one-hot labels, classes on the last axis.
        y_pred: scores of ``y_true``'s shape.
        api: the API name errors start with.

    Returns:
        A float32 array of shape ``y_true.shape[:-1]``.

    Raises:
        ValueError: for different shapes or scalars.
    """
    if y_true.shape != y_pred.shape or y_pred.ndim < 1:
        raise ValueError(
            f"{api}: `y_true` has shape {tuple(y_true.shape)} but `y_pred` has shape "
            f"{tuple(y_pred.shape)}; expected one-hot labels and scores of the same shape, "
            f"with the classes on the last axis."
        )
    return _matches(jnp.argmax(y_true, -1), jnp.argmax(y_pred, -1))


def sparse_categorical_accuracy(y_true, y_pred, api: str = "sparse_categorical_accuracy"):
    """1.0 where the largest entry of ``y_pred`` is at the class index ``y_true``.

    Args:
        y_true: class indices of shape ``y_pred.shape[:-1]`` (or that plus a trailing 1).
        y_pred: scores with the classes on the last axis.
        api: the API name errors start with.

    Returns:
        A float32 array of shape ``y_pred.shape[:-1]``.

    Raises:
        ValueError: for labels of another shape.
    """
    labels = checked_sparse_labels(api, y_true, y_pred)
    return _matches(labels, jnp.argmax(y_pred, -1).astype(labels.dtype))


def _api(metric) -> str:
    return f"{type(metric).__name__}.update_state"


class Accuracy(MeanMetricWrapper):
    """How often predictions equal labels (``tf.keras.metrics.Accuracy``).

    The mean, over every element, of ``y_pred == y_true``; padded rows of a distributed batch
    are left out, ``sample_weight`` weighs examples.

    Args:
        name: the metric's name.
        dtype: the dtype of its state and result (float32 by default).

    Example:
        >>> import numpy as np, jaxmirror
        >>> from jaxmirror import metrics
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with s.scope():
        ...     acc = metrics.Accuracy()
        >>> @s.run
        ... def step(batch):
        ...     acc.update_state(batch["label"], batch["pred"])
        >>> data = [{"label": np.array([1, 2, 3]), "pred": np.array([1, 2, 0])}]
        >>> for batch in s.experimental_distribute_dataset(data):
        ...     step(batch)
        >>> round(float(acc.result()), 4)
        0.6667
    """

    def __init__(self, name="accuracy", dtype=None):
        super().__init__(accuracy, name=name, dtype=dtype, api=_api(self))


class BinaryAccuracy(MeanMetricWrapper):
    """How often thresholded predictions equal binary labels (``tf.keras.metrics.BinaryAccuracy``).

    The mean, over every element, of ``(y_pred > threshold) == y_true``; padded rows of a
    distributed batch are left out, ``sample_weight`` weighs examples.

    Args:
        name: the metric's name.
        dtype: the dtype of its state and result (float32 by default).
        threshold: the value above which a prediction is 1 (0.5; use 0.0 for logits).

    Raises:
        ValueError: for a ``threshold`` that is not a real number.

    Example:
        >>> import numpy as np, jaxmirror
        >>> from jaxmirror import metrics
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with s.scope():
        ...     acc = metrics.BinaryAccuracy()
        >>> @s.run
        ... def step(labels, probs):
        ...     acc.update_state(labels, probs)
        >>> data = [(np.array([[1.0], [1.0], [0.0]]), np.array([[0.98], [0.3], [0.4]]))]
        >>> for labels, probs in s.experimental_distribute_dataset(data):
        ...     step(labels, probs)
        >>> round(float(acc.result()), 4)
        0.6667
    """

    def __init__(self, name="binary_accuracy", dtype=None, threshold=0.5):
        if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real):
            raise ValueError(f"{type(self).__name__}: `threshold` must be a real number; got "
                             f"{threshold!r}.")
        super().__init__(binary_accuracy, name=name, dtype=dtype, threshold=float(threshold),
                         api=_api(self))


class CategoricalAccuracy(MeanMetricWrapper):
    """How often the top-scoring class is the one-hot label's (``tf.keras.metrics.CategoricalAccuracy``).

    ``y_true`` holds one-hot labels and ``y_pred`` scores, both with the classes on the last
    axis; padded rows of a distributed batch are left out, ``sample_weight`` weighs examples.

    Args:
        name: the metric's name.
        dtype: the dtype of its state and result (float32 by default).

    Example:
        >>> from jaxmirror import metrics
        >>> m = metrics.CategoricalAccuracy()
        >>> m.update_state([[0, 0, 1], [0, 1, 0]], [[0.1, 0.9, 0.8], [0.05, 0.95, 0.0]])
        >>> float(m.result())
        0.5
    """

    def __init__(self, name="categorical_accuracy", dtype=None):
        super().__init__(categorical_accuracy, name=name, dtype=dtype, api=_api(self))


class SparseCategoricalAccuracy(MeanMetricWrapper):
    """How often the top-scoring class is the label (``tf.keras.metrics.SparseCategoricalAccuracy``).

    ``y_true`` holds class indices (shape ``(B,)`` or ``(B, 1)``) and ``y_pred`` scores of shape
    ``(B, classes)``; padded rows of a distributed batch are left out, ``sample_weight`` weighs
    examples.

    Args:
        name: the metric's name.
        dtype: the dtype of its state and result (float32 by default).

    Example:
        >>> import numpy as np, jaxmirror
        >>> from jaxmirror import metrics
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with s.scope():
        ...     acc = metrics.SparseCategoricalAccuracy()
        >>> @s.run
        ... def step(labels, logits):
        ...     acc.update_state(labels, logits)
        >>> labels = np.array([2, 1, 0])
        >>> logits = np.array([[0.1, 0.6, 0.3], [0.05, 0.95, 0.0], [0.9, 0.05, 0.05]])
        >>> for batch in s.experimental_distribute_dataset([(labels, logits)]):
        ...     step(*batch)
        >>> round(float(acc.result()), 4)
        0.6667
    """

    def __init__(self, name="sparse_categorical_accuracy", dtype=None):
        super().__init__(sparse_categorical_accuracy, name=name, dtype=dtype, api=_api(self))
