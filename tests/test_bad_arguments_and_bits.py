"""Bad arguments to ``run`` get errors that name them; data movement preserves every bit.

Part 1: ``step.arguments.check_arguments`` names a bad argument by its path (``args[1]['x'][2]``,
``kwargs['lr']``), its type or dtype, and what is accepted; ``strategy.run`` raises those
errors instead of JAX's "Error interpreting argument ... as an abstract array", and refuses a
ragged nested list of numbers that ``jax.jit`` would take as a pytree of scalars.

Part 2: moving values (local results, ``.values``, ``gather`` of even and padded batches, the
input pipeline's batches and padding, ``experimental_distribute_values_from_function``) keeps
NaN payloads, signalling NaNs, +-inf, -0.0, subnormals and integer extremes bit for bit. XLA
on CPU flushes subnormals in arithmetic, so any sum or product on the way would show here.
Reductions are arithmetic and are not tested for bits. float64 is not tested (x64 is off).
"""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxmirror
from conftest import ctx, strategy
from jaxmirror.data import batching
from jaxmirror.step.arguments import check_arguments, describe_leaf


# == Part 1: check_arguments ======================================================================

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    w: object
    b: object


Pair = collections.namedtuple("Pair", "first second")

ACCEPTED = "Accepted are arrays"

# (id, args, kwargs, path, description fragment)
BAD_LEAVES = [
    ("object_array", (np.array([1, "a"], dtype=object),), {}, "args[0]",
     "numpy.ndarray of dtype object, shape (2,)"),
    ("str", ("abc",), {}, "args[0]", "str 'abc'"),
    ("bytes", (1.0, b"xy"), {}, "args[1]", "bytes b'xy'"),
    ("np_str_array", (np.array(["a", "bc"]),), {}, "args[0]",
     "numpy.ndarray of dtype <U2, shape (2,)"),
    ("np_bytes_array", (np.array([b"a"]),), {}, "args[0]", "numpy.ndarray of dtype |S1, shape (1,)"),
    ("np_str_scalar", (np.str_("hi"),), {}, "args[0]", "numpy.str_ 'hi'"),
    ("void_array", (np.zeros(2, dtype=[("a", "i4")]),), {}, "args[0]",
     "numpy.ndarray of dtype [('a', '<i4')], shape (2,)"),
    ("datetime_array", (np.array(["2020-01-01"], dtype="datetime64[D]"),), {}, "args[0]",
     "numpy.ndarray of dtype datetime64[D], shape (1,)"),
    ("shape_dtype_struct", (jax.ShapeDtypeStruct((2,), jnp.float32),), {}, "args[0]",
     "jax.ShapeDtypeStruct(shape=(2,)"),
    ("plain_object", (object(),), {}, "args[0]", "object <object object at"),
    ("a_type", (np.float32,), {}, "args[0]", "type <class 'numpy.float32'>"),
    ("nested_dict_list", (1.0, {"x": [1, 2, "three"]}), {}, "args[1]['x'][2]", "str 'three'"),
    ("kwarg", (), {"lr": "0.1"}, "kwargs['lr']", "str '0.1'"),
    ("nested_kwarg", (), {"opt": {"names": [np.array(["a"])]}}, "kwargs['opt']['names'][0]",
     "numpy.ndarray of dtype <U1"),
    ("dataclass_field", (Params(np.ones(2), [1.0, object()]),), {}, "args[0].b[1]", "object"),
    ("namedtuple_field", (Pair(1, "s"),), {}, "args[0].second", "str 's'"),
    ("tuple_in_list", ([(1.0, b"z")],), {}, "args[0][0][1]", "bytes b'z'"),
]


@pytest.mark.parametrize("case", BAD_LEAVES, ids=[c[0] for c in BAD_LEAVES])
def test_a_bad_leaf_is_named_by_its_path_type_and_what_is_accepted(case):
    _, args, kwargs, path, described = case
    with pytest.raises(TypeError) as err:
        check_arguments(args, kwargs, "run")
    text = str(err.value)
    assert text.startswith(f"run: argument {path} is ")
    assert described in text
    assert ACCEPTED in text and "Python numbers" in text and "distributed values" in text


def test_a_long_string_is_shown_truncated():
    with pytest.raises(TypeError) as err:
        check_arguments(("x" * 500,), {}, "run")
    assert "x" * 30 in str(err.value) and "x" * 60 not in str(err.value)
    assert "..." in str(err.value)


def test_the_first_bad_leaf_is_the_one_named():
    with pytest.raises(TypeError, match=r"argument args\[1\] is str 'first'"):
        check_arguments((1.0, "first", np.array([object()])), {"k": "later"}, "run")


def test_the_error_replaces_the_one_being_handled():
    try:
        try:
            raise TypeError("JAX's own message")
        except TypeError:
            check_arguments(("s",), {}, "run")
    except TypeError as err:
        assert err.__suppress_context__  # the traceback shows ours only


RAGGED = [
    ("list_of_lists", ([[1, 2], [3]],), {}, "args[0]", "lengths [2, 1]"),
    ("tuple_of_tuples", (((1.0,), (2.0, 3.0)),), {}, "args[0]", "lengths [1, 2]"),
    ("deeper", (1, {"x": [0, 1, [[1, 2], [3, 4, 5]]]}), {}, "args[1]['x'][2]",
     "lengths [2, 3]"),
    ("in_a_kwarg", (), {"w": {"a": [[1, 2, 3], [4, 5]]}}, "kwargs['w']['a']", "lengths [3, 2]"),
    ("same_lengths_other_shapes", ([[[1, 2]], [[3]]],), {}, "args[0]",
     "shapes [(1, 2), (1, 1)]"),
    ("inner_level_first", ([[[1, 2], [3]], [[1, 2], [3, 4]]],), {}, "args[0][0]",
     "lengths [2, 1]"),
    ("in_a_dataclass", (Params([[1.0], [2.0, 3.0]], 0.0),), {}, "args[0].w", "lengths [1, 2]"),
    ("many", ([list(range(i)) for i in range(20)],), {}, "args[0]",
     "lengths [0, 1, 2, 3, 4, 5, 6, 7, ...]"),
]


@pytest.mark.parametrize("case", RAGGED, ids=[c[0] for c in RAGGED])
def test_a_ragged_nested_list_is_refused_with_its_path_and_lengths(case):
    _, args, kwargs, path, lengths = case
    with pytest.raises(ValueError) as err:
        check_arguments(args, kwargs, "run")
    text = str(err.value)
    assert text.startswith(f"run: argument {path} is a ragged nested list")
    assert lengths in text
    assert "np.asarray" in text and "pytree of arrays" in text and ACCEPTED in text


GOOD = [
    ("arrays", (np.ones(2), jnp.ones(3), np.ones(2, ml_dtypes.bfloat16), np.float32(1))),
    ("python_numbers", (1, 2.0, True, 1j)),
    ("rectangular_lists", ([[1, 2], [3, 4]], ((1.0,), (2.0,)), [], [[], []])),
    ("numbers_mixed_with_lists", ([1, [2, 3]],)),  # a pytree, as jax.jit reads it
    ("lists_of_arrays_of_any_lengths", ([[jnp.ones(2)], [jnp.ones(2), jnp.ones(3)]],)),
    ("namedtuple_fields_of_any_lengths", (Pair([1], [2, 3]),)),  # a record, not an array
    ("dataclasses_dicts_none", (Params(1, [2, 3]), {"a": None, "b": (np.int8(1),)}, None)),
    ("prng_keys_and_bool_arrays", (jax.random.key(0), np.array([True, False]))),
]


@pytest.mark.parametrize("case", GOOD, ids=[c[0] for c in GOOD])
def test_good_arguments_pass(case):
    check_arguments(case[1], {"lr": 0.1, "x": case[1][0]}, "run")


def test_distributed_values_and_variables_are_accepted_whole():
    s = strategy(2)
    per_replica = s.experimental_distribute_values_from_function(
        lambda c: np.float32(c.replica_id_in_sync_group))
    with s.scope():
        v = jaxmirror.Variable(1.0)
    check_arguments((per_replica, jaxmirror.Mirrored(jnp.ones(2)), v), {"v": [v, v]}, "run")


def test_objects_with_jax_array_are_accepted():
    class Wrapped:
        def __jax_array__(self):
            return jnp.ones(2)

    check_arguments((Wrapped(),), {}, "run")


def test_at_trace_time_python_numbers_are_weak_scalars_and_still_count():
    @jax.jit
    def traced(x):
        check_arguments((x,), {}, "run")
        return 0

    with pytest.raises(ValueError, match=r"args\[0\] is a ragged nested list.*lengths \[2, 1\]"):
        traced([[1, 2], [3]])
    traced([[1, 2], [3, 4]])
    # NumPy scalars are typed (not weak) under jit, and lists of them are pytrees there as here.
    traced([[np.float32(1), np.float32(2)], [np.float32(3)]])
    check_arguments(([[np.float32(1), np.float32(2)], [np.float32(3)]],), {}, "run")


def test_a_large_nest_is_checked_in_linear_time():
    wide = [float(i) for i in range(100_000)]
    deep = {"a": [[[i, i + 1] for i in range(5_000)] for _ in range(4)]}
    check_arguments((wide, deep), {"w": [np.ones(1)] * 10_000}, "run")


def test_describe_leaf():
    assert describe_leaf(np.array([1, "a"], dtype=object)) == (
        "numpy.ndarray of dtype object, shape (2,)")
    assert describe_leaf(jnp.zeros((2, 3), jnp.int8)) == "jax.Array of dtype int8, shape (2, 3)"
    assert describe_leaf("abc") == "str 'abc'"
    assert describe_leaf(b"abc") == "bytes b'abc'"
    assert describe_leaf(np.str_("abc")) == "numpy.str_ 'abc'"
    long = describe_leaf("y" * 100)
    assert long.startswith("str 'yyy") and long.endswith("...") and len(long) < 50


# == Part 1, end to end: strategy.run =============================================================

def _identity(*args, **kwargs):
    return 0


class TestRunRefusesBadArguments:
    """``strategy.run`` raises ``check_arguments``' errors (``Program`` calls it)."""

    @pytest.mark.parametrize("n", [1, 2])
    @pytest.mark.parametrize("value,described", [
        (np.array([1, "a"], dtype=object), "numpy.ndarray of dtype object, shape (2,)"),
        ("abc", "str 'abc'"),
        (b"abc", "bytes b'abc'"),
        (np.array(["a", "b"]), "numpy.ndarray of dtype <U1, shape (2,)"),
        (np.str_("abc"), "numpy.str_ 'abc'"),
    ], ids=["object_array", "str", "bytes", "np_str_array", "np_str_scalar"])
    def test_a_bad_positional_argument(self, n, value, described):
        s = strategy(n)
        with pytest.raises(TypeError) as err:
            s.run(lambda x: x, args=(value,))
        text = str(err.value)
        assert f"argument args[0] is {described}" in text and ACCEPTED in text
        assert "abstract array" not in text

    def test_bad_arguments_in_kwargs_and_nested_paths(self):
        s = strategy(2)
        with pytest.raises(TypeError, match=r"argument kwargs\['lr'\] is str '0\.1'.*Accepted"):
            s.run(_identity, args=(1.0,), kwargs={"lr": "0.1"})
        with pytest.raises(TypeError, match=r"argument args\[1\]\['x'\]\[2\] is bytes b'z'"):
            s.run(_identity, args=(1.0, {"x": [1, 2, b"z"]}))
        with pytest.raises(TypeError, match=r"argument kwargs\['opt'\]\['names'\]\[0\] is "
                                            r"numpy\.ndarray of dtype <U1"):
            s.run(_identity, kwargs={"opt": {"names": [np.array(["a"])]}})
        with pytest.raises(TypeError, match=r"argument args\[0\]\.b\[1\] is numpy\.ndarray of "
                                            r"dtype object"):
            s.run(_identity, args=(Params(np.ones(2), [1.0, np.array([None, 1])]),))

    @pytest.mark.parametrize("n", [1, 2])
    def test_a_ragged_nested_list(self, n):
        s = strategy(n)
        with pytest.raises(ValueError) as err:
            s.run(lambda x: x, args=([[1, 2], [3]],))
        text = str(err.value)
        assert "argument args[0] is a ragged nested list" in text and "lengths [2, 1]" in text
        assert "np.asarray" in text
        with pytest.raises(ValueError, match=r"argument kwargs\['w'\]\['a'\] is a ragged nested "
                                             r"list.*lengths \[3, 2\]"):
            s.run(_identity, kwargs={"w": {"a": [[1.0, 2.0, 3.0], [4.0, 5.0]]}})
        with pytest.raises(ValueError, match=r"argument args\[1\]\[0\] is a ragged nested list"):
            s.run(_identity, args=(1.0, [((1,), (2, 3))]))

    def test_rectangular_lists_still_run_and_the_step_still_works_after_an_error(self):
        s = strategy(2)

        @s.function
        def step(x, scale):
            return jnp.asarray(x, jnp.float32).sum() * scale

        with pytest.raises(ValueError, match="ragged nested list"):
            step([[1, 2], [3]], 2.0)
        with pytest.raises(TypeError, match=r"argument args\[1\] is str"):
            step([[1, 2], [3, 4]], "2")
        assert float(step([[1, 2], [3, 4]], 2.0)) == 20.0
        assert float(step(np.ones((2, 2)), 1.0)) == 4.0

    def test_bad_arguments_next_to_variables(self):
        s = strategy(2)
        with s.scope():
            v = jaxmirror.Variable(1.0)

        @s.function
        def step(var, x):
            var.assign_add(1.0)
            return var.value() + jnp.sum(jnp.asarray(x, jnp.float32))

        with pytest.raises(TypeError, match=r"argument args\[1\] is str 'x'"):
            step(v, "x")
        assert float(step(v, [1.0, 2.0])) == 5.0  # the failed call assigned nothing
        with pytest.raises(TypeError, match=r"argument args\[1\]\[0\] is numpy\.ndarray of dtype "
                                            r"object"):
            step(v, [np.array([1, "a"], dtype=object)])
        with pytest.raises(ValueError, match=r"argument args\[1\] is a ragged nested list"):
            step(v, [[1.0], [2.0, 3.0]])
        assert float(step(v, [1.0, 2.0])) == 6.0


# == Part 2: data movement preserves bits =========================================================

def _float_patterns(dtype) -> np.ndarray:
    """Every special bit pattern of a float dtype: subnormals, +-0, +-inf, NaN payloads."""
    width = np.dtype(dtype).itemsize * 8
    uint = np.dtype(f"u{width // 8}").type
    sign = uint(1) << uint(width - 1)
    inf = np.array([np.inf], dtype).view(uint)[0]
    one = np.array([1], dtype).view(uint)[0]
    biggest = np.array([ml_dtypes.finfo(dtype).max], dtype).view(uint)[0]
    smallest_normal = np.array([ml_dtypes.finfo(dtype).tiny], dtype).view(uint)[0]
    patterns = [
        1, sign | 1,  # the smallest subnormals, + and -
        smallest_normal - 1, sign | (smallest_normal - 1),  # the largest subnormals
        smallest_normal,
        0, sign,  # +0.0, -0.0
        inf, sign | inf,
        inf | 1, sign | inf | 5,  # signalling NaNs with payloads
        inf | (inf >> 2) | 3, inf | (inf >> 1) | 7,  # quiet NaNs with payloads
        one, sign | one, biggest, sign | biggest,
    ]
    return np.array(patterns, dtype=uint).view(dtype)


def _int_patterns(dtype) -> np.ndarray:
    info = np.iinfo(dtype)
    return np.array(sorted({info.min, info.min + 1, info.max, info.max - 1, 0, 1}), dtype)


# One leaf per dtype; float64 is left out (x64 is off in tests).
DTYPES = {
    "f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16,
    "i32": np.int32, "u32": np.uint32, "i16": np.int16, "i8": np.int8, "u8": np.uint8,
}


WIDTH = 17  # values per row: every float pattern in every row


def _leaf(key: str, rows: int, shift: int = 0) -> np.ndarray:
    """``rows`` rows holding every special pattern of the dtype, rotated differently per row."""
    dtype = DTYPES[key]
    patterns = (_float_patterns(dtype) if key in ("f32", "f16", "bf16")
                else _int_patterns(dtype))
    return np.stack([np.resize(np.roll(patterns, r + shift), WIDTH) for r in range(rows)]
                    ).reshape(rows, WIDTH).astype(dtype)


def _batch(rows: int, shift: int = 0) -> dict:
    batch = {key: _leaf(key, rows, shift) for key in DTYPES}
    # Real and imaginary parts from the float32 patterns, paired differently.
    batch["c64"] = np.stack([batch["f32"], _leaf("f32", rows, shift + 3)],
                            -1).view(np.complex64)[..., 0]
    batch["bool"] = (np.arange(rows * WIDTH).reshape(rows, WIDTH) + shift) % 3 == 0
    return batch


def assert_bits(got, want):
    """Bit-exact equality (and the same dtype and shape)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape,
                                                                  want.dtype, want.shape)
    bits = np.dtype(f"u{want.dtype.itemsize}")
    np.testing.assert_array_equal(got.view(bits), want.view(bits))


def assert_tree_bits(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_bits(g, w)


def test_the_patterns_hold_what_they_say():
    f32 = _float_patterns(np.float32).view(np.uint32)
    assert {0x00000001, 0x80000001, 0x007FFFFF, 0x80000000, 0x7F800001, 0xFF800005} <= set(
        f32.tolist())
    assert len(f32) == WIDTH
    batch = _batch(2)
    for key in ("f32", "f16", "bf16"):
        bits = np.dtype(f"u{batch[key].dtype.itemsize}")
        for row in batch[key]:  # every row holds every pattern
            assert set(row.view(bits).tolist()) == set(_float_patterns(DTYPES[key]).view(bits)
                                                       .tolist())
    assert (batch["bf16"].view(np.uint16) == 1).any() and np.isnan(batch["c64"].imag).any()
    assert batch["i32"].min() == np.iinfo(np.int32).min
    assert batch["u8"].max() == 255


# (N, global batch sizes): even, uneven, partial and empty replicas
BATCHES = [(2, [6, 5, 1]), (3, [9, 7, 4, 2]), (8, [16, 13, 8, 3])]


def _split(batch: dict, n: int) -> list:
    """TF's split of a global batch over ``n`` replicas, as host arrays."""
    counts = batching.split_counts(len(batch["f32"]), n)
    starts = np.cumsum((0,) + counts[:-1])
    return [{k: v[s:s + c] for k, v in batch.items()} for s, c in zip(starts, counts)]


@pytest.mark.parametrize("n,sizes", BATCHES, ids=[f"{n}_replicas" for n, _ in BATCHES])
def test_dataset_batches_local_results_values_padding_and_gather_keep_every_bit(n, sizes):
    s = strategy(n)
    batches = [_batch(size, shift=i) for i, size in enumerate(sizes)]
    for batch, element in zip(batches, s.experimental_distribute_dataset(batches)):
        want = _split(batch, n)
        assert_tree_bits(list(s.experimental_local_results(element)), want)
        for key in batch:
            assert_tree_bits(list(element[key].values), [w[key] for w in want])
            # Padding rows are copies of real rows, bit for bit.
            stacked = np.asarray(element[key].stacked)
            for i, part in enumerate(want):
                real = part[key]
                assert_bits(stacked[i, :len(real)], real)
                bits = np.dtype(f"u{real.dtype.itemsize}")
                known = {r.tobytes() for r in batch[key].view(bits)}
                assert all(r.tobytes() in known for r in stacked[i, len(real):].view(bits))
        assert_tree_bits(s.gather(element, axis=0), batch)
        if len(set(batching.split_counts(len(batch["f32"]), n))) == 1:  # even: any axis
            assert_tree_bits(s.gather(element, axis=1),
                             {k: np.concatenate([w[k] for w in want], 1) for k in batch})


@pytest.mark.parametrize("n", [2, 3, 8])
def test_distribute_values_from_function_values_local_results_and_gather_keep_every_bit(n):
    s = strategy(n)
    parts = [_batch(3, shift=r) for r in range(n)]
    value = s.experimental_distribute_values_from_function(
        lambda c: parts[c.replica_id_in_sync_group])
    assert_tree_bits(list(s.experimental_local_results(value)), parts)
    for key in parts[0]:
        assert_tree_bits(list(value[key].values), [p[key] for p in parts])
    for axis in (0, 1):
        assert_tree_bits(s.gather(value, axis=axis),
                         {k: np.concatenate([p[k] for p in parts], axis) for k in parts[0]})


@pytest.mark.parametrize("n", [2, 3, 8])
def test_values_through_run_keep_every_bit(n):
    """A step that only passes values on: PerReplica in and out, Mirrored in and out."""
    s = strategy(n)
    parts = [_batch(3, shift=r) for r in range(n)]
    per_replica = s.experimental_distribute_values_from_function(
        lambda c: parts[c.replica_id_in_sync_group])
    out = s.run(lambda x: x, args=(per_replica,))
    assert_tree_bits(list(s.experimental_local_results(out)), parts)
    assert_tree_bits(s.gather(out, axis=0),
                     {k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
    mirrored = s.run(lambda x: x, args=(parts[0],))
    assert_tree_bits(list(s.experimental_local_results(mirrored)), [parts[0]] * n)
    for key in parts[0]:
        assert_tree_bits(list(jaxmirror.Mirrored(mirrored[key]).values), [parts[0][key]] * n)
    assert_tree_bits(s.gather(mirrored, axis=0),
                     {k: np.concatenate([v] * n) for k, v in parts[0].items()})


@pytest.mark.parametrize("n", [2, 3, 8])
def test_distribute_datasets_from_function_batches_keep_every_bit(n):
    s = strategy(n)
    # Pipeline lengths differ, so the last steps give some replicas 0 rows (padding).
    per_replica = {r: [_batch(2, shift=r + k) for k in range(1 + r % 2)] for r in range(n)}
    options = jaxmirror.InputOptions(
        experimental_replication_mode=jaxmirror.InputReplicationMode.PER_REPLICA)
    ds = s.distribute_datasets_from_function(
        lambda c: per_replica[c.input_pipeline_id], options)
    for step, element in enumerate(ds):
        want = [per_replica[r][step] if step < len(per_replica[r])
                else {k: v[:0] for k, v in per_replica[r][0].items()} for r in range(n)]
        assert_tree_bits(list(s.experimental_local_results(element)), want)
        assert_tree_bits(s.gather(element, axis=0),
                         {k: np.concatenate([w[k] for w in want]) for k in want[0]})


def test_uneven_gather_keeps_subnormals_the_reported_case():
    s = strategy(3)
    tiny = np.full((7, 2), 1e-45, np.float32)
    element = next(iter(s.experimental_distribute_dataset([tiny])))
    assert_bits(s.gather(element, axis=0), tiny)
    assert (np.asarray(s.gather(element, axis=0)).view(np.uint32) == 1).all()


class TestCollectivesInsideAStepKeepBits:
    """Moves made by collectives inside the step: ``ReplicaContext.all_gather``, ``gather`` in a
    ``merge_fn``, and an ONLY_FIRST_REPLICA variable's broadcast of replica 0's value.

    XLA on CPU all-gathers bfloat16 through float32 (NaN payloads lost), and the broadcast is a
    masked all-reduce (subnormals flushed, -0.0 lost, signalling NaNs quieted); both move bit
    patterns once ``core.values``, ``step.replica_context`` and ``variables.distributed`` use
    ``as_bits``/``from_bits``.
    """

    @pytest.mark.parametrize("n", [2, 3, 8])
    def test_gathers_inside_a_step_keep_every_bit(self, n):
        s = strategy(n)
        parts = [_batch(3, shift=r) for r in range(n)]
        per_replica = s.experimental_distribute_values_from_function(
            lambda c: parts[c.replica_id_in_sync_group])
        whole = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

        def all_gather(x):
            return ctx().all_gather(x, axis=0)

        def merge_gather(x):
            return ctx().merge_call(lambda strategy, v: strategy.gather(v, axis=0), args=(x,))

        for step in (all_gather, merge_gather):
            out = s.run(step, args=(per_replica,))
            assert_tree_bits(list(s.experimental_local_results(out)), [whole] * n)

    @pytest.mark.parametrize("n", [2, 3, 8])
    def test_only_first_replica_assignment_keeps_every_bit(self, n):
        """Replica 0's value copied to every replica (a masked all-reduce: of bit patterns)."""
        s = strategy(n)
        parts = [_batch(2, shift=r) for r in range(n)]
        with s.scope():
            variables = {k: jaxmirror.Variable(np.zeros_like(v), aggregation="only_first_replica")
                         for k, v in parts[0].items()}
        per_replica = s.experimental_distribute_values_from_function(
            lambda c: parts[c.replica_id_in_sync_group])

        def step(x):
            for k, v in variables.items():
                v.assign(x[k])

        s.run(step, args=(per_replica,))
        for k, v in variables.items():
            assert_tree_bits(list(v.values), [parts[0][k]] * n)
