"""Cross-replica views of values: ``reduce``, ``gather``, ``experimental_local_results`` and
``experimental_distribute_values_from_function`` (TF's rules for ``reduce(op, value, axis)``).

Every expectation is computed with NumPy from the per-replica components, which are chosen to
differ from replica to replica so that order and multiplicity are visible in the results.
"""

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmirror
from conftest import mirrored
from jaxmirror.experimental import ValueContext

Point = collections.namedtuple("Point", ["x", "y"])

NS = [1, 2, 4, 8]
SUM_SPELLINGS = ["SUM", "sum", "Sum", jaxmirror.ReduceOp.SUM]
MEAN_SPELLINGS = ["MEAN", "mean", "mEaN", jaxmirror.ReduceOp.MEAN]
NON_DISTRIBUTED_SUM = re.escape("cannot be reduced with the given reduce op ReduceOp.SUM.")


@functools.lru_cache(maxsize=None)
def strategy(n):
    """One cached MirroredStrategy per replica count (its compiled programs are reused too)."""
    return mirrored(n)


@functools.lru_cache(maxsize=None)
def one_device():
    return jaxmirror.OneDeviceStrategy("CPU:0")


def ctx():
    return jaxmirror.get_replica_context()


def distribute(s, fn):
    return s.experimental_distribute_values_from_function(fn)


def local(s, value):
    return [np.asarray(c) for c in s.experimental_local_results(value)]


def components(n, fn):
    """The host-side components [fn(0), ..., fn(n-1)] as NumPy arrays."""
    return [np.asarray(fn(i)) for i in range(n)]


def vector_component(i):
    return np.array([i, 10.0 * i + 1.0], np.float32)


def matrix_component(i):
    return np.arange(6, dtype=np.float32).reshape(2, 3) + 100.0 * i


def _identity_step(x):
    return x


def _all_reduce_sum(x):
    return ctx().all_reduce("sum", x)


def _replica_id_times(x):
    return x * (ctx().replica_id_in_sync_group + 1)


# -- reduce: PerReplica values -------------------------------------------------------------------


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("op", SUM_SPELLINGS)
def test_reduce_sum_per_replica_axis_none(n, op):
    s = strategy(n)
    v = distribute(s, lambda c: vector_component(c.replica_id_in_sync_group))
    expected = np.sum(components(n, vector_component), axis=0)
    out = s.reduce(op, v, axis=None)
    assert out.shape == (2,)
    np.testing.assert_allclose(np.asarray(out), expected)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("op", MEAN_SPELLINGS)
def test_reduce_mean_per_replica_axis_none(n, op):
    s = strategy(n)
    v = distribute(s, lambda c: vector_component(c.replica_id_in_sync_group))
    expected = np.mean(components(n, vector_component), axis=0)
    np.testing.assert_allclose(np.asarray(s.reduce(op, v, axis=None)), expected, rtol=1e-6)


def test_reduce_default_axis_is_none():
    s = strategy(2)
    v = distribute(s, lambda c: vector_component(c.replica_id_in_sync_group))
    np.testing.assert_allclose(np.asarray(s.reduce("sum", v)), [1.0, 12.0])


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("axis", [0, 1, -1, -2])
def test_reduce_sum_along_axis(n, axis):
    s = strategy(n)
    v = distribute(s, lambda c: matrix_component(c.replica_id_in_sync_group))
    comps = components(n, matrix_component)
    # TF: each replica sums along `axis`, then the replicas' sums are added.
    expected = np.concatenate(comps, axis=axis).sum(axis=axis)
    out = s.reduce("sum", v, axis=axis)
    assert out.shape == expected.shape
    np.testing.assert_allclose(np.asarray(out), expected)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("axis", [0, 1, -1, -2])
def test_reduce_mean_along_axis_divides_by_all_elements_along_axis(n, axis):
    s = strategy(n)
    v = distribute(s, lambda c: matrix_component(c.replica_id_in_sync_group))
    comps = components(n, matrix_component)
    expected = np.concatenate(comps, axis=axis).mean(axis=axis)
    out = s.reduce(jaxmirror.ReduceOp.MEAN, v, axis=axis)
    assert out.shape == expected.shape
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6)


def test_reduce_concrete_numbers_two_replicas():
    # The TF docs' example: global batch [0..7] on 2 replicas -> [0..3] and [4..7].
    s = strategy(2)
    v = distribute(s, lambda c: np.arange(4, dtype=np.float32) + 4 * c.replica_id_in_sync_group)
    np.testing.assert_array_equal(np.asarray(s.reduce("sum", v, axis=None)), [4, 6, 8, 10])
    assert float(s.reduce("sum", v, axis=0)) == 28.0
    assert float(s.reduce("mean", v, axis=0)) == 3.5
    np.testing.assert_array_equal(np.asarray(s.reduce("mean", v, axis=None)), [2, 3, 4, 5])


@pytest.mark.parametrize("n", [2, 4])
def test_reduce_run_output_replica_ids(n):
    # The TF docs' reduce example: sum of replica ids.
    s = strategy(n)
    out = s.run(lambda: ctx().replica_id_in_sync_group)
    assert isinstance(out, jaxmirror.PerReplica)
    assert int(s.reduce("SUM", out, axis=None)) == sum(range(n))
    assert local(s, out) == list(range(n))


# -- reduce: bad op and bad axis -----------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("op", ["MAX", "max", "min", "prod"])
def test_reduce_bad_op_raises(n, op):
    s = strategy(n)
    v = distribute(s, lambda c: vector_component(c.replica_id_in_sync_group))
    with pytest.raises(ValueError, match=re.escape(f"'{op}' is not a valid ReduceOp")):
        s.reduce(op, v, axis=None)


def test_reduce_bad_op_message_matches_tf():
    s = strategy(2)
    v = distribute(s, lambda c: vector_component(c.replica_id_in_sync_group))
    with pytest.raises(ValueError, match=re.escape("'MAX' is not a valid ReduceOp")):
        s.reduce("MAX", v, axis=0)
    with pytest.raises(ValueError, match=re.escape("'MAX' is not a valid ReduceOp")):
        jaxmirror.get_strategy().reduce("MAX", 1.0, axis=None)


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("axis", [2, -3, 5, 1.0, "0"])
def test_reduce_bad_axis_raises(n, axis):
    s = strategy(n)
    v = distribute(s, lambda c: matrix_component(c.replica_id_in_sync_group))
    with pytest.raises(ValueError):
        s.reduce("sum", v, axis=axis)


@pytest.mark.parametrize("n", [1, 2])
def test_reduce_axis_on_scalar_components_raises(n):
    s = strategy(n)
    v = distribute(s, lambda c: np.float32(c.replica_id_in_sync_group))
    with pytest.raises(ValueError):
        s.reduce("sum", v, axis=0)


# -- reduce: Mirrored values ---------------------------------------------------------------------


@pytest.mark.parametrize("n", NS)
def test_reduce_mirrored_run_output_counts_n_times(n):
    s = strategy(n)
    v = distribute(s, lambda c: vector_component(c.replica_id_in_sync_group))
    total = np.sum(components(n, vector_component), axis=0)
    m = s.run(_all_reduce_sum, args=(v,))
    assert not isinstance(m, jaxmirror.PerReplica)
    assert isinstance(m, jax.Array)
    np.testing.assert_allclose(np.asarray(m), total)
    np.testing.assert_allclose(np.asarray(s.reduce("sum", m, axis=None)), n * total)
    np.testing.assert_allclose(np.asarray(s.reduce("mean", m, axis=None)), total)
    np.testing.assert_allclose(float(s.reduce("sum", m, axis=0)), n * total.sum())
    np.testing.assert_allclose(float(s.reduce("mean", m, axis=0)), total.mean())
    assert len(s.experimental_local_results(m)) == n
    for c in local(s, m):
        np.testing.assert_allclose(c, total)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_reduce_replicated_input_passed_through_run_is_mirrored(n):
    s = strategy(n)
    x = jnp.array([1.0, 2.0, 3.0])
    m = s.run(_identity_step, args=(x,))
    assert not isinstance(m, jaxmirror.PerReplica)
    np.testing.assert_allclose(np.asarray(s.reduce("sum", m)), n * np.array([1.0, 2.0, 3.0]))
    np.testing.assert_allclose(np.asarray(s.reduce("mean", m)), [1.0, 2.0, 3.0])


@pytest.mark.parametrize("n", NS)
def test_reduce_mirrored_wrapper(n):
    s = strategy(n)
    x = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    placed = jax.device_put(x, s.extended.replicated_sharding)
    for m in (jaxmirror.Mirrored(placed), jaxmirror.Mirrored(jnp.asarray(x), n)):
        assert isinstance(m, jaxmirror.DistributedValues)
        np.testing.assert_allclose(np.asarray(s.reduce("sum", m, axis=None)), n * x)
        np.testing.assert_allclose(np.asarray(s.reduce("mean", m, axis=None)), x)
        np.testing.assert_allclose(np.asarray(s.reduce("sum", m, axis=0)), n * x.sum(0))
        np.testing.assert_allclose(np.asarray(s.reduce("mean", m, axis=-1)), x.mean(-1))
        results = local(s, m)
        assert len(results) == n
        for c in results:
            np.testing.assert_array_equal(c, x)


def test_mirrored_wrapper_docstring_example():
    s = strategy(2)
    m = jaxmirror.Mirrored(jax.device_put(jnp.float32(3), s.extended.replicated_sharding))
    assert float(s.reduce("sum", m, axis=None)) == 6.0
    assert len(m.values) == 2


# -- reduce: non-distributed values --------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("op", MEAN_SPELLINGS)
def test_reduce_mean_of_non_distributed_value_returns_it(n, op):
    s = strategy(n)
    x = np.array([1.5, -2.0, 4.0], np.float32)
    for value in (x, jnp.asarray(x)):
        np.testing.assert_array_equal(np.asarray(s.reduce(op, value, axis=None)), x)
    assert float(s.reduce(op, 2.5, axis=None)) == 2.5


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("op", SUM_SPELLINGS)
def test_reduce_sum_of_non_distributed_value_raises(n, op):
    s = strategy(n)
    for value in (jnp.array([1.0, 2.0]), np.float32(3.0), 3.0):
        with pytest.raises(ValueError, match="A non-DistributedValues value") as info:
            s.reduce(op, value, axis=None)
        assert "cannot be reduced with the given reduce op ReduceOp.SUM." in str(info.value)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_reduce_non_distributed_value_with_axis_counts_as_copied(n):
    s = strategy(n)
    x = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32)
    np.testing.assert_allclose(np.asarray(s.reduce("sum", x, axis=0)), n * x.sum(0))
    np.testing.assert_allclose(np.asarray(s.reduce("sum", x, axis=-1)), n * x.sum(-1))
    np.testing.assert_allclose(np.asarray(s.reduce("mean", x, axis=0)), x.mean(0))
    np.testing.assert_allclose(np.asarray(s.reduce("mean", x, axis=1)), x.mean(1))


def test_reduce_nest_with_a_non_distributed_leaf_and_sum_raises():
    s = strategy(2)
    v = distribute(s, lambda c: vector_component(c.replica_id_in_sync_group))
    with pytest.raises(ValueError, match=NON_DISTRIBUTED_SUM):
        s.reduce("sum", {"ok": v, "plain": jnp.ones(2)}, axis=None)


# -- reduce: one replica, OneDeviceStrategy, default strategy ------------------------------------


def single_replica_strategies():
    return [strategy(1), one_device(), jaxmirror.get_strategy()]


@pytest.mark.parametrize("which", ["mirrored1", "one_device", "default"])
@pytest.mark.parametrize("op", ["sum", "MEAN", jaxmirror.ReduceOp.SUM])
def test_reduce_single_replica_returns_value(which, op):
    s = dict(zip(["mirrored1", "one_device", "default"], single_replica_strategies()))[which]
    assert s.num_replicas_in_sync == 1
    x = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 7.0]], np.float32)
    np.testing.assert_array_equal(np.asarray(s.reduce(op, jnp.asarray(x), axis=None)), x)
    assert float(s.reduce(op, 4.0, axis=None)) == 4.0
    is_sum = jaxmirror.ReduceOp(op) is jaxmirror.ReduceOp.SUM
    for axis in (0, 1, -1):
        expected = x.sum(axis) if is_sum else x.mean(axis)
        np.testing.assert_allclose(np.asarray(s.reduce(op, x, axis=axis)), expected, rtol=1e-6)


@pytest.mark.parametrize("which", ["mirrored1", "one_device", "default"])
def test_reduce_single_replica_run_output(which):
    s = dict(zip(["mirrored1", "one_device", "default"], single_replica_strategies()))[which]
    out = s.run(lambda: jnp.arange(4.0) * 2)
    assert not isinstance(out, jaxmirror.DistributedValues)
    np.testing.assert_array_equal(np.asarray(s.reduce("sum", out, axis=None)), [0, 2, 4, 6])
    assert float(s.reduce("sum", out, axis=0)) == 12.0
    assert float(s.reduce("mean", out, axis=0)) == 3.0
    np.testing.assert_array_equal(np.asarray(s.experimental_local_results(out)[0]), [0, 2, 4, 6])
    assert len(s.experimental_local_results(out)) == 1


def test_default_strategy_reduce_and_gather_outside_any_scope():
    s = jaxmirror.get_strategy()
    assert not jaxmirror.has_strategy()
    assert s.reduce("sum", 3.0, axis=None) == 3.0
    np.testing.assert_array_equal(np.asarray(s.gather(jnp.arange(3), axis=0)), [0, 1, 2])
    assert s.experimental_local_results(5) == (5,)


# -- reduce: nests -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", NS)
def test_reduce_nested_per_replica_structures(n):
    s = strategy(n)
    v = distribute(s, lambda c: {
        "a": vector_component(c.replica_id_in_sync_group),
        "b": (np.float32(c.replica_id_in_sync_group), matrix_component(c.replica_id_in_sync_group)),
        "p": Point(np.float32(1.0), np.float32(2.0 * c.replica_id_in_sync_group)),
    })
    vec = components(n, vector_component)
    mat = components(n, matrix_component)
    out = s.reduce("sum", v, axis=None)
    assert set(out) == {"a", "b", "p"}
    assert isinstance(out["b"], tuple) and len(out["b"]) == 2
    assert type(out["p"]) is Point
    np.testing.assert_allclose(np.asarray(out["a"]), np.sum(vec, 0))
    assert float(out["b"][0]) == sum(range(n))
    np.testing.assert_allclose(np.asarray(out["b"][1]), np.sum(mat, 0))
    assert float(out["p"].x) == n
    assert float(out["p"].y) == 2.0 * sum(range(n))

    mean = s.reduce("mean", v, axis=None)
    assert type(mean["p"]) is Point
    np.testing.assert_allclose(np.asarray(mean["a"]), np.mean(vec, 0), rtol=1e-6)
    np.testing.assert_allclose(float(mean["p"].y), 2.0 * np.mean(range(n)), rtol=1e-6)


@pytest.mark.parametrize("n", NS)
def test_reduce_nested_run_output_mixing_per_replica_and_mirrored(n):
    s = strategy(n)
    v = distribute(s, lambda c: vector_component(c.replica_id_in_sync_group))

    def step(x):
        summed = ctx().all_reduce("sum", x)
        return {"per": x, "pair": (x * 2.0, Point(summed, x + 1.0))}

    out = s.run(step, args=(v,))
    vec = np.stack(components(n, vector_component))
    total = vec.sum(0)
    red = s.reduce("sum", out, axis=None)
    assert type(red["pair"][1]) is Point
    np.testing.assert_allclose(np.asarray(red["per"]), total)
    np.testing.assert_allclose(np.asarray(red["pair"][0]), 2.0 * total)
    np.testing.assert_allclose(np.asarray(red["pair"][1].x), n * total)  # Mirrored: N copies
    np.testing.assert_allclose(np.asarray(red["pair"][1].y), total + n)

    red0 = s.reduce("mean", out, axis=0)
    np.testing.assert_allclose(float(red0["per"]), vec.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(red0["pair"][1].x), total.mean(), rtol=1e-6)


# -- gather --------------------------------------------------------------------------------------


def test_gather_tf_docs_example_two_replicas():
    s = strategy(2)
    v = distribute(s, lambda _: jnp.array([[1], [2]]))
    out = s.gather(v, axis=0)
    assert out.shape == (4, 1)
    assert jnp.issubdtype(out.dtype, jnp.integer)
    np.testing.assert_array_equal(np.asarray(out), [[1], [2], [1], [2]])


@pytest.mark.parametrize("axis, expected", [
    (0, [[[0, 1, 2], [3, 4, 5]]] * 4),
    (1, [[[0, 1, 2], [3, 4, 5]] * 4]),
    (2, [[[0, 1, 2] * 4, [3, 4, 5] * 4]]),
])
def test_gather_tf_docs_example_four_replicas(axis, expected):
    s = strategy(4)
    single = jnp.reshape(jnp.arange(6), (1, 2, 3))
    v = distribute(s, lambda _: single)
    out = s.gather(v, axis=axis)
    expected = np.array(expected)
    assert out.shape == {0: (4, 2, 3), 1: (1, 8, 3), 2: (1, 2, 12)}[axis] == expected.shape
    np.testing.assert_array_equal(np.asarray(out), expected)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_gather_concatenates_in_replica_order(n, axis):
    s = strategy(n)

    def comp(i):
        return np.arange(6, dtype=np.int32).reshape(1, 2, 3) + 10 * i

    v = distribute(s, lambda c: comp(c.replica_id_in_sync_group))
    expected = np.concatenate(components(n, comp), axis=axis)
    out = s.gather(v, axis=axis)
    assert out.shape == expected.shape
    np.testing.assert_array_equal(np.asarray(out), expected)


@pytest.mark.parametrize("n", [2, 4])
def test_gather_run_output_and_nests(n):
    s = strategy(n)
    v = distribute(s, lambda c: vector_component(c.replica_id_in_sync_group))
    out = s.run(lambda x: {"x": x, "m": ctx().all_reduce("sum", x)}, args=(v,))
    vec = components(n, vector_component)
    g = s.gather(out, axis=0)
    np.testing.assert_allclose(np.asarray(g["x"]), np.concatenate(vec))
    # A Mirrored value gathers as N identical components.
    np.testing.assert_allclose(np.asarray(g["m"]), np.tile(np.sum(vec, 0), n))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_gather_scalar_components_raise(n):
    s = strategy(n)
    v = distribute(s, lambda c: np.float32(c.replica_id_in_sync_group))
    with pytest.raises(ValueError):
        s.gather(v, axis=0)


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("axis", [3, 7, -4, 0.0, None])
def test_gather_bad_axis_raises(n, axis):
    s = strategy(n)
    v = distribute(s, lambda c: np.zeros((1, 2, 3), np.float32) + c.replica_id_in_sync_group)
    with pytest.raises(ValueError):
        s.gather(v, axis=axis)


@pytest.mark.parametrize("which", ["mirrored1", "one_device", "default"])
def test_gather_single_replica_returns_value(which):
    s = dict(zip(["mirrored1", "one_device", "default"], single_replica_strategies()))[which]
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for axis in (0, 1):
        np.testing.assert_array_equal(np.asarray(s.gather(jnp.asarray(x), axis=axis)), x)
    with pytest.raises(ValueError):
        s.gather(jnp.float32(1.0), axis=0)
    with pytest.raises(ValueError):
        s.gather(jnp.asarray(x), axis=2)


# -- experimental_local_results ------------------------------------------------------------------


@pytest.mark.parametrize("n", NS)
def test_local_results_of_per_replica_is_tuple_of_components(n):
    s = strategy(n)
    v = distribute(s, lambda c: matrix_component(c.replica_id_in_sync_group))
    results = s.experimental_local_results(v)
    assert isinstance(results, tuple) and len(results) == n
    for i, c in enumerate(results):
        assert c.shape == (2, 3)
        np.testing.assert_array_equal(np.asarray(c), matrix_component(i))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_local_results_components_live_on_their_replica_device(n):
    s = strategy(n)
    v = distribute(s, lambda c: vector_component(c.replica_id_in_sync_group))
    for i, c in enumerate(s.experimental_local_results(v)):
        assert c.devices() == {s.extended.devices[i]}


@pytest.mark.parametrize("n", NS)
def test_local_results_of_nests_is_tuple_of_structures(n):
    s = strategy(n)
    v = distribute(s, lambda c: {"a": c.replica_id_in_sync_group + 1})
    results = s.experimental_local_results(v)
    assert isinstance(results, tuple) and len(results) == n
    assert all(type(r) is dict and set(r) == {"a"} for r in results)
    assert [int(r["a"]) for r in results] == list(range(1, n + 1))
    if n == 2:
        assert jax.tree.map(int, results) == ({"a": 1}, {"a": 2})


@pytest.mark.parametrize("n", [2, 4])
def test_local_results_of_run_output_nest_with_namedtuple(n):
    s = strategy(n)

    def step():
        i = ctx().replica_id_in_sync_group
        return Point(x=i * 3, y=(ctx().all_reduce("sum", i), jnp.float32(7)))

    results = s.experimental_local_results(s.run(step))
    assert len(results) == n
    total = sum(range(n))
    for i, r in enumerate(results):
        assert type(r) is Point
        assert int(r.x) == 3 * i
        assert int(r.y[0]) == total
        assert float(r.y[1]) == 7.0


@pytest.mark.parametrize("n", NS)
def test_local_results_of_plain_value_is_one_tuple(n):
    s = strategy(n)
    x = jnp.array([1.0, 2.0])
    assert s.experimental_local_results(5) == (5,)
    res = s.experimental_local_results(x)
    assert isinstance(res, tuple) and len(res) == 1 and res[0] is x


@pytest.mark.parametrize("n", NS)
def test_local_results_of_mirrored_gives_n_equal_copies(n):
    s = strategy(n)
    m = s.run(lambda: ctx().all_reduce("sum", jnp.float32(1.5)))
    results = s.experimental_local_results(m)
    assert len(results) == n
    assert [float(r) for r in results] == [1.5 * n] * n
    w = jaxmirror.Mirrored(jax.device_put(jnp.arange(3.0), s.extended.replicated_sharding))
    results = s.experimental_local_results(w)
    assert len(results) == n
    for r in results:
        np.testing.assert_array_equal(np.asarray(r), [0.0, 1.0, 2.0])


# -- experimental_distribute_values_from_function ------------------------------------------------


def test_value_context_fields_and_defaults():
    assert ValueContext() == ValueContext(0, 1)
    c = ValueContext(1, 2)
    assert (c.replica_id_in_sync_group, c.num_replicas_in_sync) == (1, 2)
    c = ValueContext(replica_id_in_sync_group=3, num_replicas_in_sync=4)
    assert (c.replica_id_in_sync_group, c.num_replicas_in_sync) == (3, 4)


@pytest.mark.parametrize("n", NS)
def test_distribute_values_from_function_gets_one_context_per_replica(n):
    s = strategy(n)
    seen = []

    def value_fn(c):
        seen.append(c)
        return np.float32(c.replica_id_in_sync_group * 10 + c.num_replicas_in_sync)

    v = distribute(s, value_fn)
    assert all(isinstance(c, ValueContext) for c in seen)
    assert [c.replica_id_in_sync_group for c in seen] == list(range(n))
    assert {c.num_replicas_in_sync for c in seen} == {n}
    assert [float(x) for x in s.experimental_local_results(v)] == [10.0 * i + n for i in range(n)]
    if n > 1:
        assert isinstance(v, jaxmirror.PerReplica)
        assert v.stacked.shape == (n,)


@pytest.mark.parametrize("n", NS)
def test_distribute_values_from_function_nests(n):
    s = strategy(n)
    v = distribute(s, lambda c: {
        "w": np.full((2,), c.replica_id_in_sync_group, np.float32),
        "t": (c.replica_id_in_sync_group, Point(np.ones(1, np.float32), np.int32(5))),
    })
    assert set(v) == {"w", "t"}
    assert type(v["t"][1]) is Point
    if n > 1:
        assert all(isinstance(leaf, jaxmirror.PerReplica)
                   for leaf in jax.tree.leaves(v, is_leaf=lambda x: isinstance(x, jaxmirror.PerReplica)))
    results = s.experimental_local_results(v)
    assert len(results) == n
    for i, r in enumerate(results):
        np.testing.assert_array_equal(np.asarray(r["w"]), [i, i])
        assert int(r["t"][0]) == i
        assert type(r["t"][1]) is Point and int(r["t"][1].y) == 5
    # The value feeds `run`: each replica sees its own component.
    out = s.run(lambda x: ctx().all_reduce("sum", x["w"] * x["t"][0]), args=(v,))
    expected = sum(i * i for i in range(n))
    np.testing.assert_allclose(np.asarray(out), [expected, expected])


@pytest.mark.parametrize("n", [2, 4])
def test_distribute_values_from_function_mismatched_shapes_raise(n):
    s = strategy(n)
    with pytest.raises(ValueError):
        distribute(s, lambda c: np.zeros(c.replica_id_in_sync_group + 1, np.float32))
    with pytest.raises(ValueError):
        distribute(s, lambda c: np.zeros((2, 2) if c.replica_id_in_sync_group else (4,)))


@pytest.mark.parametrize("n", [2, 4])
def test_distribute_values_from_function_mismatched_structures_raise(n):
    s = strategy(n)
    with pytest.raises(ValueError):
        distribute(s, lambda c: {"a": 1.0} if c.replica_id_in_sync_group == 0 else {"b": 1.0})
    with pytest.raises(ValueError):
        distribute(s, lambda c: (1.0,) * (c.replica_id_in_sync_group + 1))


# -- cross-replica methods inside run ------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4])
def test_reduce_inside_run_raises_pointing_at_merge_call(n):
    s = strategy(n)

    def step(x):
        return s.reduce("sum", x, axis=None)

    with pytest.raises(RuntimeError, match="merge_call"):
        s.run(step, args=(jnp.ones(2),))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_gather_inside_run_raises_pointing_at_merge_call(n):
    s = strategy(n)

    def step(x):
        return s.gather(x, axis=0)

    with pytest.raises(RuntimeError, match="merge_call") as info:
        s.run(step, args=(jnp.ones(2),))
    assert "all_gather" in str(info.value)


def test_reduce_after_failed_run_still_works():
    s = strategy(2)
    with pytest.raises(RuntimeError):
        s.run(lambda: s.reduce("sum", jnp.ones(()), axis=None))
    # The replica context was popped: we are back in the (default) cross-replica world.
    assert jaxmirror.get_strategy() is not s
    v = distribute(s, lambda c: vector_component(c.replica_id_in_sync_group))
    np.testing.assert_allclose(np.asarray(s.reduce("sum", v)), [1.0, 12.0])


def test_reduce_and_gather_inside_scope_are_cross_replica():
    s = strategy(4)
    v = distribute(s, lambda c: vector_component(c.replica_id_in_sync_group))
    vec = components(4, vector_component)
    with s.scope():
        assert jaxmirror.in_cross_replica_context()
        np.testing.assert_allclose(np.asarray(s.reduce("sum", v)), np.sum(vec, 0))
        np.testing.assert_allclose(np.asarray(s.gather(v, axis=0)), np.concatenate(vec))
        assert len(s.experimental_local_results(v)) == 4


def test_local_results_of_mirrored_follow_the_replica_devices():
    s = jaxmirror.MirroredStrategy(["CPU:5", "CPU:2", "CPU:7"])
    m = s.run(lambda: ctx().all_reduce("sum", 1.0))
    results = s.experimental_local_results(m)
    assert [float(r) for r in results] == [3.0, 3.0, 3.0]
    assert [r.devices() for r in results] == [{d} for d in s.extended.devices]
