"""Moving floats bit for bit: as unsigned integers of their width.

Moving values must not change a bit of them, and XLA can compute where it seems only to move:
a gather from a sharded array becomes "zeros elsewhere, then an all-reduce (sum)", copying one
replica's value is "zeros elsewhere, then a psum", and on CPU a bfloat16 all-gather goes
through float32. Sums flush subnormals and turn -0.0 into 0.0, and conversions lose NaN
payloads. ``as_bits``/``from_bits`` let such moves carry floats as unsigned integers of their
width, which every collective moves exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_UNSIGNED = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}


def as_bits(x):
    """``x``'s bit patterns as unsigned integers, for moves that must keep every bit.

    Floats become unsigned integers of their width; complex values become the pairs of their
    parts' patterns, along a new last axis. Other dtypes (integers, bool: every collective
    moves them exactly) and floats with no unsigned type of their width (4-bit) stay as they
    are. Undo with ``from_bits(bits, x.dtype)``.

    Args:
        x: an array (traced or concrete).

    Returns:
        An array with the same leading axes as ``x``.

    Example:
        >>> import numpy as np, jax.numpy as jnp
        >>> bits = as_bits(jnp.array([1e-45, -0.0], jnp.float32))
        >>> bits.dtype, bits.tolist()
        (dtype('uint32'), [1, 2147483648])
        >>> from_bits(bits, jnp.float32).view(jnp.uint32).tolist()
        [1, 2147483648]
    """
    dtype = jnp.dtype(x.dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return jnp.stack([as_bits(lax.real(x)), as_bits(lax.imag(x))], axis=-1)
    unsigned = _unsigned_of(dtype)
    return x if unsigned is None else lax.bitcast_convert_type(x, unsigned)


def from_bits(bits, dtype):
    """The values whose bit patterns ``as_bits`` gave.

    Args:
        bits: what ``as_bits`` returned (or a move of it: a gather, a slice, a concatenation
            along any axis but the last of a complex value's).
        dtype: the original values' dtype.

    Returns:
        An array of ``dtype``, bit for bit the values moved.
    """
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        part = jnp.finfo(dtype).dtype  # complex64 -> float32
        return lax.complex(from_bits(bits[..., 0], part), from_bits(bits[..., 1], part))
    return bits if _unsigned_of(dtype) is None else lax.bitcast_convert_type(bits, dtype)


def moved(op, x):
    """``op(x)`` for an ``op`` that only moves data, done on ``x``'s bit patterns.

    Differentiable as ``op`` itself: the tangent is moved by ``op`` as floats (bit patterns
    have no derivative), so gradients through the move are ``op``'s transpose.

    Args:
        op: a linear function that only moves or selects elements (an all-gather, a select of
            one replica's value then a psum with zeros), applicable to any dtype.
        x: an array (traced or concrete).

    Returns:
        ``op(x)``, bit for bit.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([1e-45, -0.0], jnp.float32)
        >>> moved(lambda a: a[::-1], x).view(jnp.uint32).tolist()
        [2147483648, 1]
    """
    dtype = jnp.dtype(x.dtype)
    if not jnp.issubdtype(dtype, jnp.complexfloating) and _unsigned_of(dtype) is None:
        return op(x)  # integers and bools: every move keeps their bits

    @jax.custom_jvp
    def move(value):
        return from_bits(op(as_bits(value)), value.dtype)

    @move.defjvp
    def move_jvp(primals, tangents):
        return move(primals[0]), op(tangents[0])

    return move(x)


def _unsigned_of(dtype):
    if not jnp.issubdtype(dtype, jnp.floating):
        return None
    return _UNSIGNED.get(jnp.finfo(dtype).bits)


__all__ = ["as_bits", "from_bits", "moved"]
