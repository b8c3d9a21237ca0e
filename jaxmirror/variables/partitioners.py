"""Variable partitioners: how many shards ``ParameterServerStrategy`` splits a variable into.

The counterparts of ``tf.distribute.experimental.partitioners``. A partitioner is called with a
variable's ``shape`` and ``dtype`` and returns the number of partitions along each axis, e.g.
``[3, 1]``; only axis 0 may be split. ``num_shards`` checks a partitioner's answer exactly as
TF's ``ParameterServerStrategy`` does and ``shard_sizes`` gives the rows of each shard (TF's
"div" split), so a variable is cut into the same shards as in TF.

This module needs nothing else from jaxmirror, so any layer can import it.
"""

from __future__ import annotations

import math
import numbers
import operator

import jax.numpy as jnp  # importing it registers bfloat16 & co. with NumPy's dtype parser
import numpy as np

__all__ = ["FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner", "Partitioner",
           "num_shards", "shard_sizes"]

# The dtype kinds NumPy uses for text and Python objects: TF's tf.string.
_STRING_KINDS = frozenset("USOT")


def _count(owner: str, name: str, value, *, integer: bool):
    """``value`` checked to be a number >= 1 (an int when ``integer``); else TypeError/ValueError."""
    wanted = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, wanted):
        kind = "an int" if integer else "a number"
        raise TypeError(f"{owner}: `{name}` must be {kind} >= 1, got {value!r}.")
    if value < 1:
        raise ValueError(f"{owner}: `{name}` must be >= 1, got {value!r}.")
    return int(value) if integer else value


def _shape(owner: str, shape) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints (a ``tf.TensorShape`` works too)."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"{owner}: `shape` must be a sequence of ints, got {shape!r}.") from None
    try:
        dims = tuple(operator.index(d) for d in dims)
    except TypeError:
        # TF's partitioners need a fully defined shape too (None dims are rejected there).
        raise ValueError(f"{owner}: `shape` must be fully defined ints, got {shape!r}.") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"{owner}: `shape` dims must be >= 0, got {dims}.")
    return dims


def _axis(owner: str, shape: tuple[int, ...], axis) -> int:
    """``axis`` checked against ``shape``; negative axes count from the end as Python lists do."""
    rank = len(shape)
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"{owner}: `axis` must be an int, got {axis!r}.")
    if not -rank <= axis < rank:
        raise ValueError(f"{owner}: `axis` must be in [{-rank}, {rank}) for shape {shape}, "
                         f"got {axis}.")
    return int(axis) % rank


def _element_bytes(dtype, bytes_per_string) -> int:
    """Bytes per element as TF counts them: ``dtype.size``, or the estimate for strings."""
    if isinstance(dtype, str) and dtype == "string":  # TF's name for tf.string
        return bytes_per_string
    # A tf.DType names its NumPy type here (tf.string's is `object`).
    dtype = getattr(dtype, "as_numpy_dtype", dtype)
    dtype = jnp.dtype(dtype)
    # String itemsizes say nothing about the strings (`<U0`, object pointers), so TF guesses.
    return bytes_per_string if dtype.kind in _STRING_KINDS else dtype.itemsize


class Partitioner:
    """Base class of partitioners (``tf.distribute.experimental.partitioners.Partitioner``).

    A subclass implements ``__call__(shape, dtype, axis=0)``. ``num_shards`` accepts any
    callable with the same answer, as TF's ``ParameterServerStrategy`` does.

    Example:
        >>> class Halves(Partitioner):
        ...     def __call__(self, shape, dtype, axis=0):
        ...         return [2 if i == axis else 1 for i in range(len(shape))]
        >>> Halves()((10, 3), "float32")
        [2, 1]
    """

    def __call__(self, shape, dtype, axis=0) -> list[int]:
        """Partitions ``shape``: the number of partitions along each axis.

        Args:
            shape: the variable's shape, a sequence of ints.
            dtype: the variable's dtype (a NumPy/JAX dtype or its name, e.g. ``"float32"``).
            axis: the axis to partition along; the outermost by default.

        Returns:
            A list with one int per axis: the number of partitions along it, e.g. ``[3, 1]``.

        Example:
            >>> Partitioner()((4,), "float32")
            Traceback (most recent call last):
            ...
            NotImplementedError: Partitioner subclasses implement __call__(shape, dtype, axis=0).
        """
        raise NotImplementedError(
            "Partitioner subclasses implement __call__(shape, dtype, axis=0).")


class FixedShardsPartitioner(Partitioner):
    """Splits every variable into ``num_shards`` shards, or one per row when it has fewer rows.

    TF's formula: ``min(num_shards, shape[axis])`` partitions along ``axis``.

    Args:
        num_shards: the number of shards, >= 1.

    Example:
        >>> FixedShardsPartitioner(num_shards=2)((10, 3), "float32")
        [2, 1]
        >>> FixedShardsPartitioner(5)((3, 4), "float32")
        [3, 1]
    """

    def __init__(self, num_shards: int):
        # TF itself checks nothing here and fails later, when the strategy sees 0 partitions.
        self._num_shards = _count("FixedShardsPartitioner", "num_shards", num_shards,
                                  integer=True)

    def __call__(self, shape, dtype, axis=0) -> list[int]:
        """The partitions of ``shape`` along each axis (see ``Partitioner.__call__``).

        Args:
            shape: the variable's shape, a sequence of ints.
            dtype: the variable's dtype; unused, the count does not depend on it.
            axis: the axis to partition along; the outermost by default.

        Returns:
            ``[1, ..., min(num_shards, shape[axis]), ..., 1]``.

        Example:
            >>> FixedShardsPartitioner(3)((4, 6), "int8", axis=1)
            [1, 3]
        """
        del dtype
        shape = _shape("FixedShardsPartitioner", shape)
        axis = _axis("FixedShardsPartitioner", shape, axis)
        result = [1] * len(shape)
        result[axis] = min(self._num_shards, shape[axis])
        return result


class MinSizePartitioner(Partitioner):
    """As many shards as possible, each at least ``min_shard_bytes``, at most ``max_shards``.

    TF's formula (``min_max_variable_partitioner``)::

        partitions = max(1, min(shape[axis], max_shards,
                                ceil(num_elements * element_bytes / min_shard_bytes)))

    where ``element_bytes`` is the dtype's size, or ``bytes_per_string`` for strings.

    Args:
        min_shard_bytes: the least bytes per shard, >= 1; 256 KiB by default.
        max_shards: the most shards, >= 1; 1 by default (no partitioning).
        bytes_per_string: the bytes one string element is taken to hold, >= 1.

    Example:
        >>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), "float32")
        [2, 1]
        >>> MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), "float32")
        [6, 1]
    """

    def __init__(self, min_shard_bytes=256 << 10, max_shards: int = 1,
                 bytes_per_string=16):
        owner = "MinSizePartitioner"
        self._min_shard_bytes = _count(owner, "min_shard_bytes", min_shard_bytes, integer=False)
        self._max_shards = _count(owner, "max_shards", max_shards, integer=True)
        self._bytes_per_string = _count(owner, "bytes_per_string", bytes_per_string,
                                        integer=False)

    def __call__(self, shape, dtype, axis=0) -> list[int]:
        """The partitions of ``shape`` along each axis (see ``Partitioner.__call__``).

        Args:
            shape: the variable's shape, a sequence of ints.
            dtype: the variable's dtype (a NumPy/JAX dtype or its name); strings count
                ``bytes_per_string`` bytes each.
            axis: the axis to partition along; the outermost by default.

        Returns:
            A list with one int per axis, 1 everywhere but ``axis``.

        Example:
            >>> MinSizePartitioner(min_shard_bytes=1024, max_shards=8)((100, 10), "float32")
            [4, 1]
        """
        shape = _shape("MinSizePartitioner", shape)
        axis = _axis("MinSizePartitioner", shape, axis)
        total_bytes = math.prod(shape) * _element_bytes(dtype, self._bytes_per_string)
        # True division then ceil, as TF computes it, so the result matches TF's to the float.
        wanted = int(math.ceil(total_bytes / self._min_shard_bytes))
        result = [1] * len(shape)
        # Never more shards than rows or `max_shards`, never fewer than one.
        result[axis] = max(1, min(shape[axis], self._max_shards, wanted))
        return result


class MaxSizePartitioner(Partitioner):
    """As few shards as possible, each at most ``max_shard_bytes``, at most ``max_shards``.

    TF's formula (``variable_axis_size_partitioner``)::

        bytes_per_slice = num_elements / shape[axis] * element_bytes   # one row along axis
        slices_per_shard = max(1, floor(max_shard_bytes / bytes_per_slice))
        partitions = ceil(shape[axis] / slices_per_shard)
        if max_shards: partitions = min(max_shards, partitions)

    A row larger than ``max_shard_bytes`` gets a shard of its own; past ``max_shards`` shards
    grow beyond ``max_shard_bytes``. As in TF, ``max_shards`` of ``None`` or ``0`` means no
    limit. A variable with no elements is one shard (TF divides by zero there).

    Args:
        max_shard_bytes: the most bytes per shard, >= 1.
        max_shards: the most shards (>= 1), or ``None`` for no limit.
        bytes_per_string: the bytes one string element is taken to hold, >= 1.

    Example:
        >>> MaxSizePartitioner(max_shard_bytes=4)((6, 1), "float32")
        [6, 1]
        >>> MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((6, 1), "float32")
        [2, 1]
        >>> MaxSizePartitioner(max_shard_bytes=1024)((6, 1), "float32")
        [1, 1]
    """

    def __init__(self, max_shard_bytes, max_shards: int | None = None, bytes_per_string=16):
        owner = "MaxSizePartitioner"
        self._max_shard_bytes = _count(owner, "max_shard_bytes", max_shard_bytes, integer=False)
        # TF tests `if max_shards and max_shards < 1`, so 0 passes and means "no limit".
        if max_shards is not None and not (isinstance(max_shards, numbers.Integral)
                                           and not isinstance(max_shards, bool)
                                           and max_shards == 0):
            max_shards = _count(owner, "max_shards", max_shards, integer=True)
        self._max_shards = max_shards
        self._bytes_per_string = _count(owner, "bytes_per_string", bytes_per_string,
                                        integer=False)

    def __call__(self, shape, dtype, axis=0) -> list[int]:
        """The partitions of ``shape`` along each axis (see ``Partitioner.__call__``).

        Args:
            shape: the variable's shape, a sequence of ints.
            dtype: the variable's dtype (a NumPy/JAX dtype or its name); strings count
                ``bytes_per_string`` bytes each.
            axis: the axis to partition along; the outermost by default.

        Returns:
            A list with one int per axis, 1 everywhere but ``axis``.

        Example:
            >>> MaxSizePartitioner(max_shard_bytes=100)((10, 3), "float64")
            [3, 1]
        """
        shape = _shape("MaxSizePartitioner", shape)
        axis = _axis("MaxSizePartitioner", shape, axis)
        result = [1] * len(shape)
        num_elements = math.prod(shape)
        if num_elements == 0:
            return result  # nothing to split; TF would divide by zero
        element_bytes = _element_bytes(dtype, self._bytes_per_string)
        # The same float operations in the same order as TF, so rounding matches too.
        bytes_per_slice = 1.0 * (num_elements / shape[axis]) * element_bytes
        slices_per_shard = max(1, math.floor(self._max_shard_bytes / bytes_per_slice))
        shards = int(math.ceil(1.0 * shape[axis] / slices_per_shard))
        if self._max_shards:
            shards = min(self._max_shards, shards)
        result[axis] = shards
        return result


def shard_sizes(dim0: int, num_shards: int) -> list[int]:
    """The rows of each shard when ``dim0`` rows are split over ``num_shards`` (TF's "div").

    Every shard gets ``dim0 // num_shards`` rows and the first ``dim0 % num_shards`` shards one
    more, so shard ``i`` holds the next rows after shard ``i - 1``.

    Args:
        dim0: the variable's rows (its size along axis 0), >= 0.
        num_shards: the number of shards, from 1 to ``max(dim0, 1)`` (no shard is empty,
            except the single shard of a variable with no rows).

    Returns:
        A list of ``num_shards`` ints that sum to ``dim0``.

    Example:
        >>> shard_sizes(13, 5)
        [3, 3, 3, 2, 2]
        >>> shard_sizes(10, 4)
        [3, 3, 2, 2]
    """
    if isinstance(dim0, bool) or not isinstance(dim0, numbers.Integral) or dim0 < 0:
        raise ValueError(f"shard_sizes: `dim0` must be an int >= 0, got {dim0!r}.")
    num_shards = _count("shard_sizes", "num_shards", num_shards, integer=True)
    if num_shards > max(dim0, 1):
        raise ValueError(f"shard_sizes: `num_shards` must be <= max(`dim0`, 1) = "
                         f"{max(dim0, 1)}, got {num_shards}.")
    base, extra = divmod(int(dim0), num_shards)
    return [base + 1 if i < extra else base for i in range(num_shards)]


def num_shards(partitioner, shape, dtype) -> int:
    """The number of shards ``ParameterServerStrategy`` makes of a variable, as TF decides.

    Calls ``partitioner(shape=shape, dtype=dtype)`` as TF does (so any callable taking those
    keywords works) and checks its answer: a list whose first entry, the partitions along
    axis 0, is >= 1 and whose other entries are all 1. The count is then clipped to the rows,
    ``min(partitions, shape[0])``. A scalar (rank 0) is never partitioned: 1, and the
    partitioner is not called. A variable with no rows is one shard (TF divides by zero).

    Args:
        partitioner: a ``Partitioner`` or a callable ``(shape=, dtype=) -> list``.
        shape: the variable's shape, a sequence of ints.
        dtype: the variable's dtype, passed to the partitioner as given.

    Returns:
        The number of shards, >= 1; split the rows with ``shard_sizes(shape[0], n)``.

    Example:
        >>> num_shards(FixedShardsPartitioner(3), (10, 2), "float32")
        3
        >>> num_shards(lambda shape, dtype: [8] + [1] * (len(shape) - 1), (5, 2), "float32")
        5
        >>> num_shards(FixedShardsPartitioner(3), (), "float32")
        1
    """
    shape = _shape("num_shards", shape)
    if not shape:
        return 1  # TF skips partitioning for rank-0 variables
    answer = partitioner(shape=shape, dtype=dtype)
    if isinstance(answer, np.ndarray):
        answer = answer.tolist()
    if not isinstance(answer, (list, tuple)):
        raise TypeError(f"num_shards: the partitioner must return a list with the partitions "
                        f"along each axis, e.g. [3, 1]; for shape {shape} it returned "
                        f"{answer!r}.")
    try:
        counts = [operator.index(n) for n in answer]
    except TypeError:
        raise TypeError(f"num_shards: the partitioner must return ints, got {answer!r} for "
                        f"shape {shape}.") from None
    # TF checks no length: an answer only needs a first entry, and 1s after it.
    if not counts:
        raise ValueError(f"num_shards: the partitioner returned an empty list for shape "
                         f"{shape}; expected the partitions along each axis, e.g. [3, 1].")
    if any(n != 1 for n in counts[1:]):
        raise ValueError(f"num_shards: the partitioner returned {answer!r} for shape {shape}; "
                         f"only partitioning along axis 0 is supported, so every entry but "
                         f"the first must be 1.")
    # TF rejects 0 here; a negative count fails later inside TF, so it is rejected as well.
    if counts[0] < 1:
        raise ValueError(f"num_shards: the partitioner returned {answer!r} for shape {shape}; "
                         f"the partitions along axis 0 must be >= 1, got {counts[0]}.")
    # More partitions than rows would leave empty shards: TF caps them at one row each.
    return max(1, min(counts[0], shape[0]))
