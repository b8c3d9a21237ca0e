"""``ArrayOperators``: what makes a variable usable where an array is (operators, conversions).

Every operator and conversion reads the value first (``read_value()``, which follows the
context it is called in), then acts as the array would.
"""

from __future__ import annotations

import operator

import numpy as np


def value_of(x):
    """``x``'s value if it has one to read (a variable), else ``x``.

    Args:
        x: anything.

    Returns:
        ``x.read_value()`` for a variable, ``x`` itself otherwise.

    Example:
        >>> import jaxmirror
        >>> float(value_of(jaxmirror.Variable(2.0))), value_of(3)
        (2.0, 3)
    """
    return x.read_value() if isinstance(x, ArrayOperators) else x


class ArrayOperators:
    """Array behaviour for a class with ``read_value()`` (jaxmirror's variables).

    ``value()`` and ``numpy()`` read it; arithmetic, comparison and bitwise operators (and their
    reflected forms), ``jnp.asarray`` (``__jax_array__``), ``np.asarray``, ``float``/``int``/
    ``bool``, indexing, iteration and ``len`` act on the value.

    Example:
        >>> import jaxmirror
        >>> v = jaxmirror.Variable([1.0, 2.0])
        >>> (v * 2).tolist(), float(v[1]), len(v)
        ([2.0, 4.0], 2.0, 2)
    """

    __slots__ = ()
    __array_priority__ = 100  # NumPy defers to our operators

    def read_value(self):
        """The value, as the current context sees it (subclasses implement it)."""
        raise NotImplementedError

    def value(self):
        """The variable's value; the same as ``read_value()``.

        Returns:
            A ``jax.Array``.

        Example:
            >>> import jaxmirror
            >>> float(jaxmirror.Variable(3.0).value())
            3.0
        """
        return self.read_value()

    def numpy(self):
        """The value as a NumPy array (cross-replica context).

        Returns:
            A ``numpy.ndarray``.

        Example:
            >>> import jaxmirror
            >>> jaxmirror.Variable([1, 2]).numpy()
            array([1, 2], dtype=int32)
        """
        return np.asarray(self.read_value())

    def __jax_array__(self):
        return self.read_value()

    def __array__(self, dtype=None, copy=None):
        out = np.asarray(self.read_value())
        return out if dtype is None else out.astype(dtype)

    def __float__(self):
        return float(self.read_value())

    def __int__(self):
        return int(self.read_value())

    def __bool__(self):
        return bool(self.read_value())

    def __getitem__(self, index):
        return self.read_value()[index]

    def __iter__(self):
        return iter(self.read_value())

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d variable")
        return self.shape[0]


def _binary(op):
    return lambda self, other: op(self.read_value(), value_of(other))


def _reflected(op):
    return lambda self, other: op(value_of(other), self.read_value())


def _unary(op):
    return lambda self: op(self.read_value())


for _name, _op in [("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
                   ("truediv", operator.truediv), ("floordiv", operator.floordiv),
                   ("mod", operator.mod), ("pow", operator.pow), ("matmul", operator.matmul),
                   ("and", operator.and_), ("or", operator.or_), ("xor", operator.xor)]:
    setattr(ArrayOperators, f"__{_name}__", _binary(_op))
    setattr(ArrayOperators, f"__r{_name}__", _reflected(_op))
for _name, _op in [("lt", operator.lt), ("le", operator.le), ("gt", operator.gt),
                   ("ge", operator.ge)]:
    setattr(ArrayOperators, f"__{_name}__", _binary(_op))
for _name, _op in [("neg", operator.neg), ("pos", operator.pos), ("abs", operator.abs),
                   ("invert", operator.invert)]:
    setattr(ArrayOperators, f"__{_name}__", _unary(_op))
