"""Behaviours where jaxmirror once differed from TF 2.21 without saying so (issue 29).

Each test pins TF's answer, read from TF's source (named in the test) and checked on TF 2.21.
"""

import numpy as np
import pytest

import jaxmirror as jm
from conftest import strategy


# -- reduce of a non-distributed value (TF: cross_device_ops.reduce_non_distributed_value) ----
def test_reduce_of_a_host_value_on_one_process_is_tfs():
    s = strategy(2)
    # MEAN: the value itself, on every replica.
    assert float(s.reduce("MEAN", 3.0, axis=None)) == 3.0
    assert float(s.extended.reduce_to("MEAN", 3.0, destinations="/cpu:0")) == 3.0
    # SUM of identical copies is refused, TF's ValueError and wording.
    with pytest.raises(ValueError, match="non-DistributedValues value .* cannot be reduced"):
        s.reduce("SUM", 1.0, axis=None)
    with pytest.raises(ValueError, match="non-DistributedValues value .* cannot be reduced"):
        s.extended.reduce_to("SUM", 1.0, destinations="/cpu:0")
    # ...except NumPy zeros, which reduce to zeros of their shape and dtype by any op.
    for got in (s.reduce("SUM", np.zeros(3, np.int32), axis=None),
                s.extended.reduce_to("SUM", np.zeros(3, np.int32), destinations="/cpu:0")):
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, [0, 0, 0])
    # With an axis each replica reduces its copy first, then the copies are summed.
    np.testing.assert_allclose(s.reduce("SUM", np.array([1.0, 2.0]), axis=0), 6.0)
    np.testing.assert_allclose(s.reduce("MEAN", np.array([1.0, 2.0]), axis=0), 1.5)
    # One replica: the value itself, for SUM too.
    assert float(strategy(1).reduce("SUM", 1.0, axis=None)) == 1.0


# -- CentralStorageStrategy: an AggregatingVariable is one value (TF: ps_values) -------------
def _central():
    s = jm.experimental.CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:2")
    with s.scope():
        v = jm.Variable(1.0, aggregation="mean")
    return s, v


def test_central_storage_variable_is_its_own_one_local_result():
    # TF (ParameterServerStrategyExtended._local_results): not a DistributedValues, so (v,).
    s, v = _central()
    results = s.experimental_local_results(v)
    assert len(results) == 1 and results[0] is v
    assert [float(x) for x in s.experimental_local_results({"v": v, "x": 2.0})[0].values()] \
        == [1.0, 2.0]


# -- distribute_datasets_from_function with unbatched per-replica datasets --------------------
def _scalars(ctx):
    # TF: [5, 6, 7, 8] sharded per replica (input_pipeline_id), each element one scalar.
    return [np.float32(x) for x in [5.0, 6.0, 7.0, 8.0][ctx.input_pipeline_id::2]]


def test_unbatched_per_replica_datasets_give_each_replica_one_element_per_step():
    s = strategy(2)
    options = jm.InputOptions(experimental_replication_mode=jm.InputReplicationMode.PER_REPLICA)
    steps = [[np.asarray(c) for c in s.experimental_local_results(b)]
             for b in s.distribute_datasets_from_function(_scalars, options)]
    assert [[c.tolist() for c in step] for step in steps] == [[5.0, 6.0], [7.0, 8.0]]
    assert all(c.shape == () and c.dtype == np.float32 for step in steps for c in step)
    spec = s.distribute_datasets_from_function(_scalars, options).element_spec
    assert spec.shape == () and spec.dtype == np.float32
    # Nests with scalars, one replica: the element as it is.
    one = strategy(1).distribute_datasets_from_function(
        lambda ctx: [{"x": np.float32(i), "y": np.arange(2) + i} for i in range(2)])
    got = [(float(e["x"]), np.asarray(e["y"]).tolist()) for e in one]
    assert got == [(0.0, [0, 1]), (1.0, [1, 2])]


def test_unbatched_pipelines_that_end_unevenly_are_refused():
    s = strategy(2)
    options = jm.InputOptions(experimental_replication_mode=jm.InputReplicationMode.PER_REPLICA)
    ds = s.distribute_datasets_from_function(
        lambda ctx: [np.float32(i) for i in range(1 + ctx.input_pipeline_id)], options)
    it = iter(ds)
    next(it)
    with pytest.raises(ValueError, match="unbatched"):
        next(it)


def test_legacy_iterator_initialize_restarts_it_as_tf():
    # TF (v1/input_lib.py): in eager, initialize() recreates the underlying iterators.
    s = strategy(2)
    it = s.make_dataset_iterator([np.arange(2.0), np.arange(2.0, 4.0)])
    first = [np.asarray(c).tolist() for c in s.experimental_local_results(it.get_next())]
    assert first == [[0.0], [1.0]]
    assert it.initialize() == []
    assert [np.asarray(c).tolist() for c in s.experimental_local_results(next(it))] == first
    next(it)
    assert it.initializer == []  # TF's property, which initializes too
    assert [np.asarray(c).tolist() for c in s.experimental_local_results(next(it))] == first


def test_central_storage_assign_results_eager_one_value_in_a_step_one_per_replica():
    s, v = _central()
    # Eagerly an assignment returns the variable (TF: its update's one result): one value.
    (got,) = s.experimental_local_results(v.assign_add(2.0))
    assert float(got) == 3.0
    # Differs from TF, on purpose (README): `run` returns arrays, never variables, so a step's
    # `v.assign_add(...)` comes back as the new value, a mirrored result stored once on the
    # parameter device that stands for every replica's (TF: the one variable, `[5.]`).
    results = s.experimental_local_results(s.run(lambda: v.assign_add(2.0)))
    assert [float(x) for x in results] == [5.0, 5.0]
    assert float(s.reduce("SUM", s.run(lambda: v.read_value()), axis=None)) == 10.0
