"""What an assignment writes: the value checked and cast for the variable, combined with the old.

Shared by every kind of variable and every context an assignment happens in (replica, cross
replica, eager, inside ``extended.update``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmirror.core import _compat
from jaxmirror.core.values import DistributedValues, Mirrored
from jaxmirror.variables.operators import ArrayOperators


def combine(method: str, old, value):
    """The variable's new value after ``method`` (assign, assign_add, assign_sub) of ``value``.

    Args:
        method: ``"assign"``, ``"assign_add"`` or ``"assign_sub"``.
        old: the current value.
        value: the (converted) value assigned, added or subtracted.

    Returns:
        The new value.

    Example:
        >>> combine("assign_sub", 5.0, 2.0)
        3.0
    """
    if method == "assign":
        return value
    return old + value if method == "assign_add" else old - value


def owned_copy(x):
    """``x``, or a copy of it when it is an array someone else may hold (and donate).

    Args:
        x: an array, a tracer or a host value.

    Returns:
        A concrete ``jax.Array`` copied; anything else as it is.
    """
    return x.copy() if isinstance(x, jax.Array) and not _compat.is_tracer(x) else x


def convert(var, value, method: str):
    """``value`` checked and cast for ``var`` (TF's shape and dtype rules).

    Args:
        var: the variable assigned.
        value: what ``method`` was given.
        method: the assignment's name, for errors.

    Returns:
        ``value`` as an array (or tracer) of ``var``'s shape and strong dtype.

    Raises:
        ValueError: for a per-replica value or a shape mismatch.
        TypeError: for a dtype that cannot be cast safely.
    """
    if isinstance(value, ArrayOperators):
        value = value.read_value()
    elif isinstance(value, Mirrored):
        value = value.value
    elif isinstance(value, DistributedValues):
        raise ValueError(
            f"Variable.{method}: got a {type(value).__name__} value for {var.name!r}, but in "
            f"cross-replica context a {type(var).__name__} can only be assigned a single "
            f"value or a Mirrored one; reduce per-replica values first "
            f"(strategy.extended.reduce_to or strategy.reduce)."
        )
    x = value if isinstance(value, jax.Array) or _compat.is_tracer(value) else np.asarray(value)
    if tuple(x.shape) != var.shape:
        raise ValueError(  # TF's wording, on purpose
            f"Cannot {method} value to variable {var.name!r}: Shape mismatch. The variable "
            f"shape {var.shape}, and the assigned value shape {tuple(x.shape)} are "
            f"incompatible."
        )
    src = jnp.dtype(x.dtype)
    weak = (not isinstance(value, (jax.Array, np.ndarray, np.generic))
            and not _compat.is_tracer(value))
    if src != var.dtype and not weak and not np.can_cast(src, var.dtype, "same_kind"):
        raise TypeError(f"Variable.{method}: cannot cast a {src} value to variable "
                        f"{var.name!r} of dtype {var.dtype}; cast it first (x.astype(...)).")
    # A strong dtype: a weakly typed new value would change the step's signature.
    return lax.convert_element_type(x, var.dtype)
