"""PerReplica and Mirrored: representation, repr, pytree behaviour, StrategyExtended basics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmirror as jm
from jaxmirror.step.program import cache_of
from conftest import mirrored


def test_per_replica_is_a_stacked_sharded_array():
    s = mirrored(4)
    v = s.experimental_distribute_values_from_function(
        lambda c: np.full((2,), c.replica_id_in_sync_group, np.int32))
    assert isinstance(v, jm.PerReplica) and isinstance(v, jm.DistributedValues)
    assert v.stacked.shape == (4, 2)
    assert v.stacked.sharding == s.extended.replica_sharding
    # Each component lives on its replica's device.
    for comp, dev in zip(v.values, s.extended.devices):
        assert comp.devices() == {dev}
    assert [c.tolist() for c in v.values] == [[i, i] for i in range(4)]


def test_repr_like_tf():
    s = mirrored(2)
    v = s.experimental_distribute_values_from_function(lambda c: np.float32(c.replica_id_in_sync_group))
    assert repr(v) == ("PerReplica:{\n  0: Array(0., dtype=float32),\n"
                       "  1: Array(1., dtype=float32)\n}")
    m = jm.Mirrored(s.run(lambda: jnp.float32(5)))
    assert repr(m) == "Mirrored:{\n  0: Array(5., dtype=float32),\n  1: Array(5., dtype=float32)\n}"


def test_pytree_registration():
    s = mirrored(2)
    v = s.experimental_distribute_values_from_function(lambda c: np.float32(c.replica_id_in_sync_group))
    doubled = jax.tree.map(lambda x: x * 2, {"v": v})
    assert isinstance(doubled["v"], jm.PerReplica)
    assert [float(c) for c in doubled["v"].values] == [0.0, 2.0]
    assert jax.tree.leaves(v) == [v.stacked]
    jitted = jax.jit(lambda t: t)(v)
    assert isinstance(jitted, jm.PerReplica) and [float(c) for c in jitted.values] == [0.0, 1.0]
    m = jm.Mirrored(jnp.ones(2), num_replicas=3)
    m2 = jax.tree.map(lambda x: x + 1, m)
    assert isinstance(m2, jm.Mirrored) and m2.num_replicas == 3 and m2.value.tolist() == [2.0, 2.0]
    assert len(m2.values) == 3


def test_mirrored_wrapper_is_accepted_by_run_and_reduce():
    s = mirrored(4)
    m = jm.Mirrored(jnp.float32(2.0))
    assert float(s.run(lambda x: x * 3, args=(m,))) == 6.0
    assert float(s.reduce("sum", m, axis=None)) == 8.0
    assert float(s.reduce("mean", m, axis=None)) == 2.0
    assert [float(x) for x in s.experimental_local_results(m)] == [2.0] * 4


def test_values_from_function_with_one_replica_is_plain():
    s = jm.OneDeviceStrategy("CPU:2")
    v = s.experimental_distribute_values_from_function(lambda c: jnp.float32(c.num_replicas_in_sync))
    assert not isinstance(v, jm.DistributedValues) and float(v) == 1.0
    assert v.devices() == {jax.devices()[2]}


def test_extended_basics():
    s = mirrored(2)
    assert s.cluster_resolver is None
    assert s.extended.experimental_require_static_shapes is False
    assert s.extended.axis_name == "replica"
    assert s.extended.parameter_devices == s.extended.worker_devices
    out = s.extended.call_for_each_replica(lambda x: x + jm.get_replica_context().replica_id_in_sync_group,
                                           args=(jnp.float32(1),))
    assert [float(x) for x in s.experimental_local_results(out)] == [1.0, 2.0]


def test_errors_before_device_work_leave_no_program_behind():
    s = mirrored(2)
    before = cache_of(s).programs()
    with pytest.raises(ValueError):
        s.run(lambda x: x, args=3)
    assert cache_of(s).programs() == before
