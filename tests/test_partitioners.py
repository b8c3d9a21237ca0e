"""Variable partitioners count shards exactly as tf.distribute.experimental.partitioners do."""

import itertools
import math
import random

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmirror.variables.partitioners import (
    FixedShardsPartitioner, MaxSizePartitioner, MinSizePartitioner, Partitioner, num_shards,
    shard_sizes)

# --- A reference written from TF's code, independent of the module under test. --------------


def ref_element_bytes(name, bytes_per_string):
    # partitioned_variables.py: `if dtype.base_dtype == dtypes.string: bytes_per_string_element
    # else: dtype.size`.
    return bytes_per_string if name == "string" else {
        "float32": 4, "float64": 8, "int8": 1, "bfloat16": 2, "int64": 8, "bool": 1}[name]


def ref_fixed(shape, num, axis=0):
    # sharded_variable.py, FixedShardsPartitioner.__call__:
    #   result = [1] * len(shape); result[axis] = min(self._num_shards, shape.dims[axis].value)
    result = [1] * len(shape)
    result[axis] = min(num, shape[axis])
    return result


def ref_min_size(shape, size, min_slice_size, max_partitions, axis=0):
    # partitioned_variables.py, min_max_variable_partitioner._partitioner:
    #   total_size_bytes = shape.num_elements() * bytes_per_element
    #   partitions = total_size_bytes / min_slice_size
    #   partitions_list[axis] = max(1, min(shape.dims[axis].value, max_partitions,
    #                                      int(math.ceil(partitions))))
    total_size_bytes = math.prod(shape) * size
    partitions = total_size_bytes / min_slice_size
    partitions_list = [1] * len(shape)
    partitions_list[axis] = max(1, min(shape[axis], max_partitions, int(math.ceil(partitions))))
    return partitions_list


def ref_max_size(shape, size, max_shard_bytes, max_shards, axis=0):
    # partitioned_variables.py, variable_axis_size_partitioner._partitioner:
    #   bytes_per_slice = 1.0 * (shape.num_elements() / shape.dims[axis].value) * element_size
    #   slices_per_shard = max(1, math.floor(max_shard_bytes / bytes_per_slice))
    #   axis_shards = int(math.ceil(1.0 * shape.dims[axis].value / slices_per_shard))
    #   if max_shards: axis_shards = min(max_shards, axis_shards)
    partitions = [1] * len(shape)
    bytes_per_slice = 1.0 * (math.prod(shape) / shape[axis]) * size
    slices_per_shard = max(1, math.floor(max_shard_bytes / bytes_per_slice))
    axis_shards = int(math.ceil(1.0 * shape[axis] / slices_per_shard))
    if max_shards:
        axis_shards = min(max_shards, axis_shards)
    partitions[axis] = axis_shards
    return partitions


def ref_div(dim0, n):
    # parameter_server_strategy_v2.py, _create_variable: base = shape[0] // num_partitions,
    # extra = shape[0] % num_partitions; shard i has base + (1 if i < extra else 0) rows.
    base = dim0 // n
    extra = dim0 % n
    return [base + (1 if i < extra else 0) for i in range(n)]


# Each dtype, spelled several ways, with the name the reference knows it by.
DTYPES = [
    ("float32", "float32"), ("float32", np.float32), ("float32", jnp.float32),
    ("float64", "float64"), ("float64", np.dtype("float64")),
    ("int8", "int8"), ("int8", np.int8),
    ("bfloat16", "bfloat16"), ("bfloat16", jnp.bfloat16),
    ("string", "string"), ("string", str), ("string", bytes), ("string", object),
    ("string", np.dtype("U7")),
]


def dtype_id(value):
    """A short test id for a ``DTYPES`` entry: ``numpy.float32``, ``str``, ``dtype_U7``."""
    if isinstance(value, np.dtype):
        return "dtype_" + value.str.lstrip("<>|=")
    if isinstance(value, type):
        module = value.__module__.split(".")[0]
        return value.__name__ if module == "builtins" else f"{module}.{value.__name__}"
    return str(value)


def _shapes(count=60, seed=0):
    rng = random.Random(seed)
    shapes = [(1,), (2,), (10,), (13,), (1000,), (1024, 1024), (3, 4), (7, 1, 5),
              (100000, 64), (1 << 20, 128), (5, 1 << 16), (1, 1 << 20)]
    for _ in range(count):
        rank = rng.randint(1, 3)
        shapes.append(tuple(rng.choice([1, 2, 3, 7, 10, 64, 100, 513, 4096, 30000])
                            for _ in range(rank)))
    return shapes


SHAPES = _shapes()
BPS = [16, 1, 5]  # bytes_per_string


@pytest.mark.parametrize("name,dtype", DTYPES, ids=dtype_id)
def test_min_size_partitioner_matches_tf_formula(name, dtype):
    checked = 0
    for shape, min_bytes, max_shards, bps in itertools.product(
            SHAPES, [1, 4, 100, 1000, 4096, 256 << 10, 3.5], [1, 2, 3, 8, 1000], BPS):
        p = MinSizePartitioner(min_shard_bytes=min_bytes, max_shards=max_shards,
                               bytes_per_string=bps)
        for axis in range(len(shape)):
            want = ref_min_size(shape, ref_element_bytes(name, bps), min_bytes, max_shards, axis)
            assert p(shape, dtype, axis=axis) == want, (shape, min_bytes, max_shards, bps, axis)
            checked += 1
    assert checked > 5000


@pytest.mark.parametrize("name,dtype", DTYPES, ids=dtype_id)
def test_max_size_partitioner_matches_tf_formula(name, dtype):
    checked = 0
    for shape, max_bytes, max_shards, bps in itertools.product(
            SHAPES, [1, 4, 7, 100, 1000, 4096, (64 << 20) - 1, 2.5], [None, 0, 1, 2, 5, 1000],
            BPS):
        p = MaxSizePartitioner(max_shard_bytes=max_bytes, max_shards=max_shards,
                               bytes_per_string=bps)
        for axis in range(len(shape)):
            want = ref_max_size(shape, ref_element_bytes(name, bps), max_bytes, max_shards, axis)
            assert p(shape, dtype, axis=axis) == want, (shape, max_bytes, max_shards, bps, axis)
            checked += 1
    assert checked > 5000


@pytest.mark.parametrize("name,dtype", DTYPES[:8], ids=dtype_id)
def test_fixed_shards_partitioner_matches_tf_formula(name, dtype):
    for shape, n in itertools.product(SHAPES, [1, 2, 3, 5, 8, 100, 1 << 30]):
        for axis in range(len(shape)):
            assert FixedShardsPartitioner(n)(shape, dtype, axis=axis) == ref_fixed(shape, n, axis)


def test_known_cases_by_hand():
    assert MinSizePartitioner(min_shard_bytes=4, max_shards=2)((10,), "float32") == [2]
    assert MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), np.float32) == [6, 1]
    # 1024 * 1024 float32 = 4 MiB over 256 KiB = 16 (TF's docstring example).
    assert MinSizePartitioner(max_shards=100)((1024, 1024), "float32") == [16, 1]
    assert MinSizePartitioner(max_shards=8)((1024, 1024), "float32") == [8, 1]
    assert MinSizePartitioner()((1024, 1024), "float32") == [1, 1]  # max_shards defaults to 1
    # 10 strings * 16 bytes = 160 bytes over 50 = 3.2 -> 4.
    assert MinSizePartitioner(min_shard_bytes=50, max_shards=10)((10,), "string") == [4]
    assert MinSizePartitioner(min_shard_bytes=50, max_shards=10,
                              bytes_per_string=5)((10,), str) == [1]
    assert MaxSizePartitioner(max_shard_bytes=4)((10,), "float32") == [10]
    assert MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((10,), "float32") == [2]
    assert MaxSizePartitioner(max_shard_bytes=1024)((6, 1), "float32") == [1, 1]
    # A row of 3 float64 = 24 bytes; 100 bytes hold 4 rows; 10 rows -> 3 shards.
    assert MaxSizePartitioner(max_shard_bytes=100)((10, 3), "float64") == [3, 1]
    # A row (40 bytes) bigger than a shard still gets one shard of its own.
    assert MaxSizePartitioner(max_shard_bytes=8)((5, 10), "float32") == [5, 1]
    assert MaxSizePartitioner(max_shard_bytes=2)((9,), jnp.bfloat16) == [9]
    assert MaxSizePartitioner(max_shard_bytes=4)((9,), "int8") == [3]
    assert MaxSizePartitioner(max_shard_bytes=4, max_shards=0)((10,), "float32") == [10]
    assert FixedShardsPartitioner(5)((3, 4), "float32") == [3, 1]
    assert FixedShardsPartitioner(2)((10, 3), "float32") == [2, 1]
    assert FixedShardsPartitioner(3)((4, 6), "float32", axis=1) == [1, 3]
    assert FixedShardsPartitioner(3)((4, 6), "float32", axis=-1) == [1, 3]


def test_zero_sized_variables_are_one_shard_where_tf_would_divide_by_zero():
    assert MaxSizePartitioner(max_shard_bytes=4)((0, 3), "float32") == [1, 1]
    assert MaxSizePartitioner(max_shard_bytes=4)((5, 0), "float32") == [1, 1]
    assert MinSizePartitioner(min_shard_bytes=4, max_shards=4)((0, 3), "float32") == [1, 1]
    assert FixedShardsPartitioner(3)((0, 3), "float32") == [0, 1]  # TF's answer, rejected below
    assert num_shards(MaxSizePartitioner(max_shard_bytes=4), (0, 3), "float32") == 1
    assert num_shards(lambda shape, dtype: [3, 1], (0, 3), "float32") == 1
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        num_shards(FixedShardsPartitioner(3), (0, 3), "float32")


@pytest.mark.parametrize("dim0,n,want", [
    (13, 5, [3, 3, 3, 2, 2]), (10, 4, [3, 3, 2, 2]), (10, 1, [10]), (10, 10, [1] * 10),
    (7, 3, [3, 2, 2]), (6, 3, [2, 2, 2]), (1, 1, [1]), (0, 1, [0]),
])
def test_shard_sizes(dim0, n, want):
    assert shard_sizes(dim0, n) == want == ref_div(dim0, n)


def test_shard_sizes_cover_the_rows_for_all_splits():
    for dim0 in range(1, 60):
        for n in range(1, dim0 + 1):
            sizes = shard_sizes(dim0, n)
            assert sizes == ref_div(dim0, n)
            assert sum(sizes) == dim0 and max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


@pytest.mark.parametrize("call,arg", [
    (lambda: shard_sizes(3, 0), "`num_shards` must be >= 1, got 0"),
    (lambda: shard_sizes(3, 5), "`num_shards` must be <= max"),
    (lambda: shard_sizes(-1, 1), "`dim0` must be an int >= 0, got -1"),
])
def test_shard_sizes_rejects_bad_arguments(call, arg):
    with pytest.raises(ValueError, match=arg):
        call()


@pytest.mark.parametrize("make,message", [
    (lambda: FixedShardsPartitioner(0),
     r"FixedShardsPartitioner: `num_shards` must be >= 1, got 0\."),
    (lambda: FixedShardsPartitioner(-2), "`num_shards` must be >= 1, got -2"),
    (lambda: MinSizePartitioner(min_shard_bytes=0),
     r"MinSizePartitioner: `min_shard_bytes` must be >= 1, got 0\."),
    (lambda: MinSizePartitioner(max_shards=0), "MinSizePartitioner: `max_shards` must be >= 1"),
    (lambda: MinSizePartitioner(bytes_per_string=0), "`bytes_per_string` must be >= 1, got 0"),
    (lambda: MaxSizePartitioner(max_shard_bytes=0),
     r"MaxSizePartitioner: `max_shard_bytes` must be >= 1, got 0\."),
    (lambda: MaxSizePartitioner(max_shard_bytes=0.5), "`max_shard_bytes` must be >= 1, got 0.5"),
    (lambda: MaxSizePartitioner(4, max_shards=-1), "MaxSizePartitioner: `max_shards` must be"),
    (lambda: MaxSizePartitioner(4, bytes_per_string=-3), "`bytes_per_string` must be >= 1"),
    (lambda: FixedShardsPartitioner(3)((4, 4), "float32", axis=2), r"`axis` must be in \[-2, 2\)"),
    (lambda: MinSizePartitioner()((4,), "float32", axis=1), "`axis` must be in"),
    (lambda: MaxSizePartitioner(4)((), "float32"), "`axis` must be in"),
    (lambda: MaxSizePartitioner(4)((3, -1), "float32"), "`shape` dims must be >= 0"),
    (lambda: MinSizePartitioner()((3, None), "float32"), "`shape` must be fully defined"),
])
def test_bad_arguments_name_the_argument(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("make,message", [
    (lambda: FixedShardsPartitioner(2.0), "`num_shards` must be an int"),
    (lambda: FixedShardsPartitioner(True), "`num_shards` must be an int"),
    (lambda: MinSizePartitioner(max_shards=2.5), "`max_shards` must be an int"),
    (lambda: MaxSizePartitioner("4"), "`max_shard_bytes` must be a number"),
    (lambda: FixedShardsPartitioner(2)((4,), "float32", axis=0.0), "`axis` must be an int"),
    (lambda: num_shards(FixedShardsPartitioner(2), 4, "float32"), "`shape` must be a sequence"),
    (lambda: num_shards(lambda shape, dtype: 3, (4,), "float32"), "must return a list"),
    (lambda: num_shards(lambda shape, dtype: [2.0], (4,), "float32"), "must return ints"),
])
def test_wrong_types_are_type_errors(make, message):
    with pytest.raises(TypeError, match=message):
        make()


def test_num_shards_clips_to_rows_and_accepts_any_callable():
    calls = []

    def by_hand(shape, dtype):
        calls.append((shape, dtype))
        return [4, 1]

    assert num_shards(by_hand, [10, 3], "float32") == 4
    assert calls == [((10, 3), "float32")]  # called by keyword with the shape as a tuple
    assert num_shards(by_hand, (2, 3), np.float32) == 2  # more partitions than rows
    assert num_shards(lambda shape, dtype: (1, 1), (9, 3), "float32") == 1
    assert num_shards(lambda shape, dtype: np.array([3, 1]), (9, 3), "float32") == 3
    # TF checks no length: the first entry, then 1s.
    assert num_shards(lambda shape, dtype: [3], (9, 3), "float32") == 3
    assert num_shards(FixedShardsPartitioner(5), (3, 4), "float32") == 3
    assert num_shards(MinSizePartitioner(min_shard_bytes=4, max_shards=2), (10,), "float32") == 2
    assert num_shards(MaxSizePartitioner(max_shard_bytes=4), (10,), "float32") == 10
    assert num_shards(MaxSizePartitioner(max_shard_bytes=4, max_shards=2), (10,), "float32") == 2


def test_num_shards_never_partitions_a_scalar():
    def never(shape, dtype):
        raise AssertionError("a rank-0 variable must not reach the partitioner")

    assert num_shards(never, (), "float32") == 1
    assert num_shards(FixedShardsPartitioner(4), (), "float32") == 1


@pytest.mark.parametrize("answer,message", [
    ([2, 2], "only partitioning along axis 0 is supported"),
    ([1, 3], "only partitioning along axis 0 is supported"),
    ([0, 1], "the partitions along axis 0 must be >= 1, got 0"),
    ([-2, 1], "the partitions along axis 0 must be >= 1, got -2"),
    ([], "returned an empty list"),
])
def test_num_shards_rejects_answers_tf_rejects(answer, message):
    with pytest.raises(ValueError, match=message):
        num_shards(lambda shape, dtype: answer, (4, 4), "float32")


def test_partitioner_base_class():
    with pytest.raises(NotImplementedError):
        Partitioner()((4,), "float32")

    class Thirds(Partitioner):
        def __call__(self, shape, dtype, axis=0):
            return [3] + [1] * (len(shape) - 1)

    assert num_shards(Thirds(), (7, 2), "float32") == 3
    assert shard_sizes(7, num_shards(Thirds(), (7, 2), "float32")) == [3, 2, 2]
