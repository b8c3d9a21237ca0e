"""Strategies and devices, by TF's rules: which devices a strategy
takes, how TF device strings are read, the names and mesh it exposes, and ``cross_device_ops``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmirror


def full_name(i):
    return f"/job:localhost/replica:0/task:0/device:CPU:{i}"


@functools.lru_cache(maxsize=None)
def all_cpus():
    return jaxmirror.MirroredStrategy()


def cpu(i):
    return jax.devices("cpu")[i]


def ctx():
    return jaxmirror.get_replica_context()


# -- MirroredStrategy(devices=None) --------------------------------------------------------------


def test_default_devices_are_all_eight_cpus():
    s = all_cpus()
    assert isinstance(s, jaxmirror.Strategy)
    assert s.num_replicas_in_sync == 8
    assert s.extended.devices == tuple(jax.devices())
    assert s.extended.worker_devices == tuple(full_name(i) for i in range(8))
    assert s.extended.parameter_devices == s.extended.worker_devices
    explicit = jaxmirror.MirroredStrategy(devices=None)
    assert explicit.extended.devices == tuple(jax.devices())


def test_default_strategy_runs_one_replica_per_cpu():
    s = all_cpus()
    out = s.run(lambda: ctx().replica_id_in_sync_group * 2)
    results = s.experimental_local_results(out)
    assert [int(r) for r in results] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert [r.devices() for r in results] == [{d} for d in jax.devices()]
    assert float(s.run(lambda: ctx().all_reduce("sum", 1.0))) == 8.0


# -- device strings and jax.Device objects -------------------------------------------------------


@pytest.mark.parametrize("spec, index", [
    ("CPU:0", 0),
    ("cpu:6", 6),
    ("/cpu:1", 1),
    ("/CPU:7", 7),
    ("/device:CPU:2", 2),
    ("/device:cpu:5", 5),
    ("/job:localhost/replica:0/task:0/device:CPU:3", 3),
    ("cpu", 0),
    ("CPU", 0),
])
def test_device_strings(spec, index):
    s = jaxmirror.MirroredStrategy([spec])
    assert s.num_replicas_in_sync == 1
    assert s.extended.devices == (cpu(index),)
    assert s.extended.worker_devices == (full_name(index),)


def test_tf_style_strings_mixed_in_one_list_keep_their_order():
    specs = ["CPU:0", "/cpu:1", "/device:CPU:2", "/job:localhost/replica:0/task:0/device:CPU:3"]
    s = jaxmirror.MirroredStrategy(specs)
    assert s.num_replicas_in_sync == 4
    assert s.extended.devices == tuple(cpu(i) for i in range(4))
    assert s.extended.worker_devices == tuple(full_name(i) for i in range(4))


def test_device_order_is_the_given_order():
    s = jaxmirror.MirroredStrategy(["CPU:5", "/cpu:2", "/device:CPU:7"])
    assert s.extended.devices == (cpu(5), cpu(2), cpu(7))
    assert s.extended.worker_devices == (full_name(5), full_name(2), full_name(7))
    assert s.extended.parameter_devices == (full_name(5), full_name(2), full_name(7))
    assert list(s.extended.mesh.devices.flat) == [cpu(5), cpu(2), cpu(7)]
    # Replica i runs on the i-th given device.
    out = s.run(lambda: ctx().replica_id_in_sync_group + 10)
    results = s.experimental_local_results(out)
    assert [int(r) for r in results] == [10, 11, 12]
    assert [r.devices() for r in results] == [{cpu(5)}, {cpu(2)}, {cpu(7)}]


def test_jax_device_objects():
    devs = jax.devices()[2:5]
    s = jaxmirror.MirroredStrategy(devs)
    assert s.extended.devices == tuple(devs)
    assert s.extended.worker_devices == (full_name(2), full_name(3), full_name(4))


def test_jax_devices_and_strings_mixed():
    s = jaxmirror.MirroredStrategy([cpu(6), "CPU:1", "/device:CPU:0"])
    assert s.extended.devices == (cpu(6), cpu(1), cpu(0))
    assert s.extended.worker_devices == (full_name(6), full_name(1), full_name(0))


def test_tuple_of_devices_accepted():
    s = jaxmirror.MirroredStrategy(("CPU:0", "CPU:1"))
    assert s.extended.devices == (cpu(0), cpu(1))


# -- bad device lists ----------------------------------------------------------------------------


@pytest.mark.parametrize("specs", [
    ["CPU:0", "CPU:0"],
    ["CPU:0", "/device:CPU:0"],
    ["CPU:1", "/job:localhost/replica:0/task:0/device:CPU:1", "CPU:2"],
    ["cpu", "CPU:0"],
    "devices-as-objects",
    "device-and-string",
])
def test_duplicate_devices_raise(specs):
    if specs == "devices-as-objects":
        specs = [cpu(3), cpu(3)]
    elif specs == "device-and-string":
        specs = [cpu(0), "/cpu:0"]
    with pytest.raises(ValueError, match="devices"):
        jaxmirror.MirroredStrategy(specs)


@pytest.mark.parametrize("specs", [
    ["GPU:0"],
    ["/gpu:1"],
    ["/device:GPU:0"],
    ["CPU:99"],
    ["CPU:8"],
    ["foo"],
    ["CPU:0", "foo"],
    ["CPU:0", "GPU:0"],
    ["/job:localhost/replica:0/task:7/device:CPU:0"],
    [""],
    [3],
    [None],
])
def test_unknown_devices_raise_naming_the_argument(specs):
    with pytest.raises(ValueError, match="`devices`"):
        jaxmirror.MirroredStrategy(specs)


@pytest.mark.parametrize("specs", [[], ()])
def test_empty_device_list_raises(specs):
    with pytest.raises(ValueError, match="devices"):
        jaxmirror.MirroredStrategy(specs)


# -- names and mesh ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_worker_and_parameter_devices_are_full_tf_names(n):
    s = jaxmirror.MirroredStrategy([f"CPU:{i}" for i in range(n)])
    names = tuple(full_name(i) for i in range(n))
    assert s.extended.worker_devices == names
    assert s.extended.parameter_devices == names
    assert all(isinstance(x, str) for x in names)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_mesh_is_one_dimensional_over_the_replica_axis(n):
    s = jaxmirror.MirroredStrategy([f"/device:CPU:{i}" for i in range(n)])
    mesh = s.extended.mesh
    assert isinstance(mesh, jax.sharding.Mesh)
    assert mesh.axis_names == ("replica",)
    assert mesh.devices.shape == (n,)
    assert dict(mesh.shape) == {"replica": n}
    assert list(mesh.devices.flat) == [cpu(i) for i in range(n)]
    assert s.extended.axis_name == "replica"
    assert s.extended.replicated_sharding.mesh == mesh
    assert s.extended.replica_sharding.mesh == mesh


def test_mesh_follows_a_non_contiguous_device_choice():
    s = jaxmirror.MirroredStrategy(["CPU:7", "CPU:0", "CPU:4"])
    assert list(s.extended.mesh.devices.flat) == [cpu(7), cpu(0), cpu(4)]
    assert s.extended.mesh.axis_names == ("replica",)


# -- OneDeviceStrategy ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [
    "CPU:3", "cpu:3", "/cpu:3", "/device:CPU:3", "/job:localhost/replica:0/task:0/device:CPU:3",
    "jax-device",
])
def test_one_device_strategy_device_spellings(spec):
    if spec == "jax-device":
        spec = cpu(3)
    s = jaxmirror.OneDeviceStrategy(spec)
    assert s.num_replicas_in_sync == 1
    assert s.extended.devices == (cpu(3),)
    assert s.extended.worker_devices == (full_name(3),)
    assert s.extended.parameter_devices == (full_name(3),)
    assert list(s.extended.mesh.devices.flat) == [cpu(3)]
    out = s.run(lambda x: x * 2.0, args=(jnp.arange(3.0),))
    assert not isinstance(out, jaxmirror.DistributedValues)
    np.testing.assert_array_equal(np.asarray(out), [0.0, 2.0, 4.0])
    assert out.devices() == {cpu(3)}


def test_one_device_strategy_cpu_shorthand_is_cpu0():
    s = jaxmirror.OneDeviceStrategy("/cpu")
    assert s.extended.devices == (cpu(0),)


@pytest.mark.parametrize("spec", ["GPU:0", "/gpu:0", "CPU:8", "CPU:99", "bogus", "", None, 0])
def test_one_device_strategy_bad_device_raises_naming_device(spec):
    with pytest.raises(ValueError, match="`device`"):
        jaxmirror.OneDeviceStrategy(spec)


# -- cross_device_ops ----------------------------------------------------------------------------


@pytest.mark.parametrize("ops", [
    None,
    jaxmirror.NcclAllReduce(),
    jaxmirror.NcclAllReduce(num_packs=2),
    jaxmirror.HierarchicalCopyAllReduce(),
    jaxmirror.HierarchicalCopyAllReduce(num_packs=0),
    jaxmirror.ReductionToOneDevice(),
    jaxmirror.ReductionToOneDevice("/cpu:0"),
], ids=lambda o: type(o).__name__)
def test_cross_device_ops_accepted(ops):
    s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"], cross_device_ops=ops)
    assert s.num_replicas_in_sync == 2
    # Whatever was chosen, the all-reduce is right.
    out = s.run(lambda: ctx().all_reduce("sum", ctx().replica_id_in_sync_group + 1.0))
    assert float(out) == 3.0


def test_cross_device_ops_classes_are_cross_device_ops():
    for cls in (jaxmirror.NcclAllReduce, jaxmirror.HierarchicalCopyAllReduce,
                jaxmirror.ReductionToOneDevice):
        assert isinstance(cls(), jaxmirror.CrossDeviceOps)
    assert jaxmirror.NcclAllReduce(num_packs=2).num_packs == 2
    assert jaxmirror.HierarchicalCopyAllReduce().num_packs == 1
    assert jaxmirror.ReductionToOneDevice("/cpu:0").reduce_to_device == "/cpu:0"


@pytest.mark.parametrize("ops", [
    "nccl", jaxmirror.NcclAllReduce, object(), 1, {"num_packs": 1}, True,
], ids=["str", "class", "object", "int", "dict", "bool"])  # not repr: object()'s has its address
def test_cross_device_ops_rejects_other_objects(ops):
    with pytest.raises(ValueError, match="cross_device_ops"):
        jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"], cross_device_ops=ops)


def test_negative_num_packs_raises():
    # TF: "NCCL all-reduce requires num_packs >= 0".
    with pytest.raises(ValueError, match="num_packs"):
        jaxmirror.NcclAllReduce(num_packs=-1)
    with pytest.raises(ValueError, match="num_packs"):
        jaxmirror.HierarchicalCopyAllReduce(num_packs=-1)
