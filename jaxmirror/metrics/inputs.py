"""What metrics accept: their arguments checked and made arrays, and each example's weight.

Every check here runs in Python on static shapes and dtypes, so inside ``strategy.run`` a bad
argument is refused while the step is traced, before any device work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmirror.core import context
from jaxmirror.core.values import DistributedValues
from jaxmirror.step.replica_context import row_mask
from jaxmirror.variables.variable import Variable


def checked_array(api: str, arg: str, x):
    """``x`` as a ``jax.Array`` of booleans, integers or floats; raises naming ``arg`` otherwise.

    Args:
        api: the API name errors start with (``"Mean.update_state"``).
        arg: the argument's name (``"y_true"``).
        x: an array, a NumPy array, a number, a nested list, or a variable (its value).

    Returns:
        A ``jax.Array`` (a tracer inside ``run``).

    Raises:
        TypeError: for a distributed value outside ``run``, or anything that is not numbers.
    """
    if isinstance(x, Variable):
        x = x.read_value()
    elif isinstance(x, DistributedValues):
        raise TypeError(
            f"{api}: `{arg}` is a {type(x).__name__}; outside `run` pass a plain array, or update "
            f"the metric inside the step `strategy.run` runs, where it is this replica's array."
        )
    if not isinstance(x, jax.Array):
        try:
            x = np.asarray(x)
        except (TypeError, ValueError) as e:  # ragged nested lists
            raise TypeError(f"{api}: `{arg}` must be an array of numbers; got "
                            f"{type(x).__name__} that is not one ({e}).") from None
    dtype = x.dtype
    if not (dtype == np.bool_ or jnp.issubdtype(dtype, jnp.integer)
            or jnp.issubdtype(dtype, jnp.floating)):
        raise TypeError(f"{api}: `{arg}` must hold booleans, integers or floats; got "
                        f"{type(x).__name__} of dtype {dtype}; convert it to numbers first.")
    return jnp.asarray(x)


def same_rank(y_true, y_pred) -> tuple:
    """Keras's ``squeeze_or_expand_to_same_rank``: a trailing axis of size 1 on the one of
    rank one higher is dropped, so ``(B, 1)`` labels meet ``(B,)`` predictions.

    Args:
        y_true: an array.
        y_pred: an array.

    Returns:
        ``(y_true, y_pred)``, one of them squeezed where that makes their ranks equal.
    """
    if y_true.ndim == y_pred.ndim + 1 and y_true.shape[-1] == 1:
        return jnp.squeeze(y_true, -1), y_pred
    if y_pred.ndim == y_true.ndim + 1 and y_pred.shape[-1] == 1:
        return y_true, jnp.squeeze(y_pred, -1)
    return y_true, y_pred


def checked_same_shape(api: str, y_true, y_pred) -> tuple:
    """``same_rank(y_true, y_pred)``, raising unless the two then have the same shape.

    Args:
        api: the API name errors start with.
        y_true: an array.
        y_pred: an array.

    Returns:
        ``(y_true, y_pred)`` of one shape.

    Raises:
        ValueError: naming both shapes.
    """
    t, p = same_rank(y_true, y_pred)
    if t.shape != p.shape:
        raise ValueError(
            f"{api}: `y_true` has shape {tuple(y_true.shape)} but `y_pred` has shape "
            f"{tuple(y_pred.shape)}; expected the same shape (either may have one more trailing "
            f"axis of size 1)."
        )
    return t, p


def checked_sparse_labels(api: str, y_true, y_pred):
    """Integer labels ``y_true`` for the class scores ``y_pred``, with shape ``y_pred.shape[:-1]``.

    Args:
        api: the API name errors start with.
        y_true: class indices, shape ``y_pred.shape[:-1]`` or that plus a trailing 1.
        y_pred: scores with the classes on the last axis.

    Returns:
        ``y_true`` as int32 of shape ``y_pred.shape[:-1]``.

    Raises:
        ValueError: for a scalar ``y_pred`` or labels of another shape.
    """
    if y_pred.ndim < 1:
        raise ValueError(f"{api}: `y_pred` must have the classes on its last axis (rank >= 1); "
                         f"got a scalar.")
    expected = tuple(y_pred.shape[:-1])
    if y_true.ndim == y_pred.ndim and y_true.shape[-1] == 1:
        y_true = jnp.squeeze(y_true, -1)
    if tuple(y_true.shape) != expected:
        raise ValueError(
            f"{api}: `y_true` has shape {tuple(y_true.shape)} but `y_pred` has shape "
            f"{tuple(y_pred.shape)}; expected one class index per row of `y_pred`: shape "
            f"{expected} (or {expected + (1,)})."
        )
    return y_true.astype(jnp.int32)


def _real_rows(values):
    """The current step's mask of real rows for ``values``'s axis 0, or ``None``."""
    entry = context.current()
    if not entry.in_run or entry.replica_context is None or values.ndim == 0:
        return None
    return row_mask(entry.replica_context, values.shape[0])


def example_weights(api: str, values, sample_weight) -> tuple:
    """``values`` and their weights, both zero on the rows that only pad a distributed batch.

    Inside ``run`` a batch from a distributed dataset is padded to a static number of rows;
    when ``values``'s axis 0 has that padded size, its padded rows get weight 0 (and value 0,
    so no ``0 * NaN``). ``sample_weight`` is matched to ``values`` as Keras does: a ``(B, 1)``
    weight for ``(B,)`` values, a ``(B,)`` weight for ``(B, ...)`` values, or any shape that
    broadcasts.

    Args:
        api: the API name errors start with.
        values: an array of the metric's dtype.
        sample_weight: ``None`` or weights as above.

    Returns:
        ``(values, weights)``, both of ``values``'s shape and dtype.

    Raises:
        ValueError: when ``sample_weight`` cannot be matched to ``values``.
        TypeError: when ``sample_weight`` is not numbers.
    """
    dtype = values.dtype
    if sample_weight is None:
        weights = jnp.ones(values.shape, dtype)
    else:
        given = checked_array(api, "sample_weight", sample_weight)
        w = given.astype(dtype)
        if w.ndim == values.ndim + 1 and w.shape[-1] == 1:
            w = jnp.squeeze(w, -1)
        if 0 < w.ndim < values.ndim:
            w = w.reshape(w.shape + (1,) * (values.ndim - w.ndim))
        try:
            fits = np.broadcast_shapes(w.shape, values.shape) == values.shape
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(
                f"{api}: `sample_weight` has shape {tuple(given.shape)} but the values it weighs "
                f"have shape {tuple(values.shape)}; expected a scalar, one weight per example "
                f"(shape {tuple(values.shape[:1])}), or a shape that broadcasts to "
                f"{tuple(values.shape)}."
            )
        weights = jnp.broadcast_to(w, values.shape)
    mask = _real_rows(values)
    if mask is not None:
        mask = mask.reshape(mask.shape + (1,) * (values.ndim - 1))
        values = jnp.where(mask, values, jnp.zeros((), dtype))
        weights = jnp.where(mask, weights, jnp.zeros((), dtype))
    return values, weights
