"""CentralStorageStrategy: variables and parameters kept once on the parameter device, each step
broadcasting them to the compute devices and bringing the mirrored results back; TF's numbers."""

import copy
import gc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmirror as jm
from jaxmirror.core import inflight
from jaxmirror.variables import state

Central = jm.experimental.CentralStorageStrategy


def _cpu(i):
    return jax.devices()[i]


def _tf_example(strategy):
    """The StrategyExtended page's reduce_to / update example."""
    def step_fn(var):
        def merge_fn(strategy, value, var):
            reduced = strategy.extended.reduce_to("sum", value, destinations=var)
            strategy.extended.update(var, lambda var, value: var.assign(value), args=(reduced,))
        jm.get_replica_context().merge_call(merge_fn, args=(jnp.asarray(1.0), var))

    with strategy.scope():
        v = jm.Variable(0.)
        strategy.run(step_fn, args=(v,))
        return v


def test_the_tf_example_gives_tfs_numbers():
    two = _tf_example(Central(compute_devices=["CPU:0", "CPU:1"], parameter_device="CPU:2"))
    assert repr(two) == "<jaxmirror.Variable 'Variable:0' shape=() dtype=float32, numpy=2.0>"
    one = _tf_example(Central(compute_devices=["CPU:0"]))
    assert repr(one) == "<jaxmirror.Variable 'Variable:0' shape=() dtype=float32, numpy=1.0>"
    assert type(one) is jm.Variable


def test_devices_it_reports():
    s = Central(["CPU:0", "CPU:1"], "CPU:2")
    assert s.extended.parameter_devices == ("/job:localhost/replica:0/task:0/device:CPU:2",)
    assert s.extended.worker_devices == ("/job:localhost/replica:0/task:0/device:CPU:0",
                                         "/job:localhost/replica:0/task:0/device:CPU:1")
    assert s.num_replicas_in_sync == 2


def test_defaults_as_tf():
    s = Central()  # every local device computes; variables on the host CPU
    assert s.num_replicas_in_sync == len(jax.devices())
    assert s.extended.parameter_devices == ("/job:localhost/replica:0/task:0/device:CPU:0",)
    one = Central(["CPU:3"])  # one compute device holds the variables too
    assert one.extended.parameter_devices == one.extended.worker_devices
    assert not one.extended.placement.central


@pytest.mark.parametrize("kwargs,arg", [
    ({"compute_devices": []}, "compute_devices"),
    ({"compute_devices": ["CPU:0", "CPU:0"]}, "compute_devices"),
    ({"compute_devices": ["CPU:0"], "parameter_device": "GPU:7"}, "parameter_device"),
])
def test_bad_arguments(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        Central(**kwargs)


def test_variables_live_once_on_the_parameter_device():
    s = Central(["CPU:0", "CPU:1", "CPU:2", "CPU:3"], "CPU:5")
    with s.scope():
        v = jm.Variable(jnp.zeros(3), aggregation="mean")
    assert isinstance(v, jm.MirroredVariable)  # aggregated as a mirrored variable is
    assert v.read_value().sharding.device_set == {_cpu(5)}

    @s.function
    def step():
        ctx = jm.get_replica_context()
        v.assign_add(jnp.ones(3) * (ctx.replica_id_in_sync_group + 1.0))
        return v.read_value()

    out = step()
    np.testing.assert_allclose(v.numpy(), [2.5, 2.5, 2.5])
    assert v.read_value().sharding.device_set == {_cpu(5)}
    assert out.sharding.device_set == {_cpu(5)}  # a mirrored result, back on it too
    assert [float(x[0]) for x in s.experimental_local_results(out)] == [2.5] * 4


def _buffers_of_shape(shape) -> int:
    # Steps in flight hold their outputs (at most 8) and the variables' previous values until
    # they are known to have finished: count what stays after that.
    inflight.drain()
    state.settle_all()
    gc.collect()
    # Buffers, not arrays: a shard read as its own array shares its array's buffer.
    return len({shard.data.unsafe_buffer_pointer() for x in jax.live_arrays()
                if x.shape == shape for shard in x.addressable_shards})


@pytest.mark.parametrize("make,copies", [
    (lambda: Central(["CPU:0", "CPU:1", "CPU:2", "CPU:3"], "CPU:6"), 1),
    (lambda: jm.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"]), 4),
])
def test_memory_one_copy_of_each_variable_between_steps(make, copies):
    shape = (1237, 3)  # a shape nothing else here has
    s = make()
    before = _buffers_of_shape(shape)
    with s.scope():
        w = jm.Variable(jnp.ones(shape), aggregation="mean")
    params = s.experimental_replicate({"p": jnp.ones(shape)})

    @s.run
    def step(params):
        ctx = jm.get_replica_context()
        g = ctx.all_reduce("mean", params["p"] * (ctx.replica_id_in_sync_group + 1.0))
        w.assign_sub(0.1 * g)
        return {"p": params["p"] - 0.1 * g}

    for _ in range(3):
        params = step(params)
    jax.block_until_ready(params)
    np.testing.assert_allclose(w.numpy(), np.ones(shape) * 0.75 ** 3, rtol=1e-6)
    # the variable and the parameters, as buffers on devices
    assert _buffers_of_shape(shape) - before == 2 * copies
    if copies == 1:
        assert params["p"].sharding.device_set == {_cpu(6)}


def test_none_aggregation_cannot_be_assigned_in_a_replica_context():
    s = Central(["CPU:0", "CPU:1"], "CPU:2")
    with s.scope():
        v = jm.Variable(1.0)
    with pytest.raises(ValueError, match="lives once on the parameter device.*aggregation"):
        s.run(lambda: v.assign(2.0))
    assert float(v.numpy()) == 1.0  # unchanged, readable
    v.assign(5.0)  # cross-replica: fine
    assert float(v.numpy()) == 5.0 and v.read_value().sharding.device_set == {_cpu(2)}


@pytest.mark.parametrize("aggregation,expected", [("sum", 3.0), ("mean", 1.5),
                                                  ("only_first_replica", 1.0)])
def test_aggregations_in_a_replica_context(aggregation, expected):
    s = Central(["CPU:0", "CPU:1"], "CPU:2")
    with s.scope():
        v = jm.Variable(0.0, aggregation=aggregation)
    s.run(lambda: v.assign(jnp.float32(jm.get_replica_context().replica_id_in_sync_group + 1)))
    assert float(v.numpy()) == expected


def test_parameters_built_with_init_and_reduced_results():
    s = Central(["CPU:0", "CPU:1", "CPU:2"], "CPU:4")
    params = s.init(lambda: {"w": jnp.ones((2, 2))})
    assert params["w"].sharding.device_set == {_cpu(4)}

    @s.run
    def step(params):
        ctx = jm.get_replica_context()
        return params, ctx.all_reduce("sum", jnp.float32(1)), ctx.replica_id_in_sync_group

    params, total, ids = step(params)
    assert params["w"].sharding.device_set == {_cpu(4)}
    assert float(total) == 3.0
    assert float(s.reduce("sum", total, axis=None)) == 9.0  # a mirrored value counts N times
    assert float(s.reduce("mean", total, axis=None)) == 3.0
    assert int(s.reduce("sum", ids, axis=None)) == 3
    assert s.gather(s.run(lambda: jnp.ones(1)), axis=0).shape == (3,)


def test_reduce_to_a_variable_lands_on_the_parameter_device():
    s = Central(["CPU:0", "CPU:1"], "CPU:3")
    with s.scope():
        v = jm.Variable(0.0, aggregation="sum")
    ids = s.run(lambda: jnp.float32(jm.get_replica_context().replica_id_in_sync_group + 1))
    out = s.extended.reduce_to("sum", ids, destinations=v)
    assert float(out) == 3.0 and out.sharding.device_set == {_cpu(3)}


class _MLP(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(4, 8, rngs=rngs)
        self.b = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


def _train_nnx(strategy):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 8, 4)).astype(np.float32)
    y = rng.normal(size=(4, 8, 1)).astype(np.float32)
    with strategy.scope():
        model = _MLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    strategy.experimental_replicate((model, optimizer))

    @strategy.run
    def step(model, optimizer, xb, yb):
        def loss_fn(model):
            return jm.compute_average_loss(jnp.sum((model(xb) - yb) ** 2, -1))
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        grads = jm.get_replica_context().all_reduce("sum", grads)
        optimizer.update(model, grads)
        return loss

    losses = [float(strategy.reduce("sum", step(model, optimizer, xb, yb), axis=None))
              for xb, yb in strategy.experimental_distribute_dataset(list(zip(x, y)))]
    return losses, nnx.state(model, nnx.Param)


def test_a_flax_nnx_model_trains_as_under_mirrored_strategy():
    central = Central(["CPU:0", "CPU:1", "CPU:2", "CPU:3"], "CPU:7")
    losses, state = _train_nnx(central)
    want_losses, want_state = _train_nnx(jm.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2",
                                                              "CPU:3"]))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want_state)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
        assert a.sharding.device_set == {_cpu(7)}


def test_checkpoint_round_trip(tmp_path):
    s = Central(["CPU:0", "CPU:1"], "CPU:2")
    with s.scope():
        v = jm.Variable(jnp.arange(3.0), aggregation="mean")
    jm.checkpoint.save(tmp_path / "ckpt", {"v": v})
    s2 = Central(["CPU:0", "CPU:1"], "CPU:5")
    with s2.scope():
        w = jm.Variable(jnp.zeros(3), aggregation="mean")
    jm.checkpoint.restore(tmp_path / "ckpt", {"v": w})
    np.testing.assert_array_equal(w.numpy(), [0.0, 1.0, 2.0])
    assert w.read_value().sharding.device_set == {_cpu(5)}


def test_deepcopy_makes_an_equivalent_strategy():
    s = Central(["CPU:0", "CPU:1"], "CPU:2")
    twin = copy.deepcopy(s)
    assert twin is not s and type(twin) is Central
    assert twin.extended.parameter_devices == s.extended.parameter_devices
    assert twin.extended.worker_devices == s.extended.worker_devices


def test_one_compute_device_with_its_own_parameter_device():
    s = Central(["CPU:1"], "CPU:4")
    with s.scope():
        v = jm.Variable(1.0)
    assert type(v) is jm.Variable  # plain, as TF's with one compute device
    params = s.experimental_replicate({"w": jnp.ones(3)})

    @s.function
    def step(params):
        v.assign_add(1.0)
        return {"w": params["w"] * 2}, v.read_value()

    for _ in range(2):
        params, value = step(params)
    assert float(v.numpy()) == 3.0 and float(value) == 3.0
    assert params["w"].tolist() == [4.0, 4.0, 4.0]
    for x in (v.read_value(), params["w"], value):
        assert x.devices() == {_cpu(4)}


def test_per_replica_values_cannot_be_written_to_a_single_copy():
    s = Central(["CPU:0", "CPU:1"], "CPU:3")
    with s.scope():
        v = jm.Variable(jnp.zeros(2), aggregation="mean")
    per_replica = s.run(lambda: jnp.ones(2) * (jm.get_replica_context().replica_id_in_sync_group
                                               + 2.0))
    with pytest.raises(ValueError, match="stored once.*reduce them first"):
        s.extended.update(v, lambda c, x: c.assign(x), args=(per_replica,))

    def step():
        x = jnp.ones(2) * (jm.get_replica_context().replica_id_in_sync_group + 2.0)
        return s.extended.update(v, lambda c, x: c.assign(x), args=(x,))

    with pytest.raises(ValueError, match="stored once"):
        s.run(step)
    assert v.numpy().tolist() == [0.0, 0.0]
    assert v.read_value().sharding.device_set == {_cpu(3)}


def test_a_plain_array_on_the_parameter_device_is_not_a_mirrored_value():
    s = Central(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])  # parameters on CPU:0, where jnp puts arrays
    with pytest.raises(ValueError, match="non-DistributedValues"):
        s.reduce("sum", jnp.float32(2.0), axis=None)
    assert float(s.reduce("mean", jnp.float32(2.0), axis=None)) == 2.0
    total = s.run(lambda: jm.get_replica_context().all_reduce("sum", jnp.float32(1.0)))
    assert float(s.reduce("sum", total, axis=None)) == 16.0  # a step's mirrored result: N copies


def test_gradients_through_all_reduce_go_back_to_the_parameter_device():
    s = Central(["CPU:0", "CPU:1", "CPU:2", "CPU:3"], "CPU:6")
    w = s.experimental_replicate(jnp.arange(3.0))

    @s.function
    def step(w):
        ctx = jm.get_replica_context()
        return w - 0.1 * jax.grad(lambda w: jnp.sum(ctx.all_reduce("mean", w * w)))(w)

    out = step(w)
    assert out.devices() == {_cpu(6)}
    np.testing.assert_allclose(out, np.arange(3.0) * 0.8, rtol=1e-6)
