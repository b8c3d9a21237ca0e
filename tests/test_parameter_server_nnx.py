"""flax NNX objects on parameter servers (``ParameterServerStrategy.init``), 2 workers and 2 PS.

Every wait is bounded; Ray is shut down by the module fixture.
"""

import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmirror as jm
from ps_helpers import TIMEOUT, joined, local_cluster
from jaxmirror.coordinator.ps_variables import PSVariable, read_many
from jaxmirror.experimental import partitioners
from jaxmirror.experimental.coordinator import ClusterCoordinator

TRUE_W = np.array([[1.0], [-2.0], [3.0], [0.5]], np.float32)


@pytest.fixture(scope="module")
def resolver():
    yield from local_cluster()


@pytest.fixture(scope="module")
def strategy(resolver):
    return jm.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=partitioners.FixedShardsPartitioner(2))


@pytest.fixture(scope="module")
def coordinator(strategy):
    return ClusterCoordinator(strategy)


def _data():
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    return x, x @ TRUE_W


def _built(strategy, tx):
    return strategy.init(lambda: (m := nnx.Linear(4, 1, rngs=nnx.Rngs(0)),
                                  nnx.Optimizer(m, tx, wrt=nnx.Param)))


def _train_step(strategy, model, opt):
    def train_step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, grads)
        return loss

    def step(x, y):
        return strategy.run(train_step, args=(model, opt, x, y))
    return step


def test_an_nnx_model_and_optimizer_train_on_the_parameter_servers(strategy, coordinator):
    model, opt = _built(strategy, optax.adam(0.05))
    assert isinstance(model, nnx.Linear) and isinstance(opt, nnx.Optimizer)
    start = np.asarray(model.kernel[...]).copy()
    step = _train_step(strategy, model, opt)
    x, y = _data()
    losses = [coordinator.schedule(step, args=(x, y)) for _ in range(120)]
    joined(coordinator)
    # The coordinator's objects hold what the workers' steps made of them, together.
    assert int(opt.step[...]) == 120  # every closure's step counted once, from both workers
    assert int(opt.opt_state[0].count[...]) == 120
    assert float(losses[-1].fetch()) < 0.05 * float(losses[0].fetch())
    np.testing.assert_allclose(np.asarray(model.kernel[...]), TRUE_W, atol=0.15)
    assert not np.allclose(np.asarray(model.kernel[...]), start)
    # and equal the parameter servers' values, which a closure reads
    read = coordinator.schedule(lambda: (model.kernel[...], opt.opt_state[0].mu["kernel"][...],
                                         opt.step[...])).fetch(timeout=TIMEOUT)
    np.testing.assert_array_equal(read[0], np.asarray(model.kernel[...]))
    np.testing.assert_array_equal(read[1], np.asarray(opt.opt_state[0].mu["kernel"][...]))
    assert int(read[2]) == 120


def test_changes_made_on_the_coordinator_reach_the_workers(strategy, coordinator):
    model, opt = _built(strategy, optax.sgd(0.1))
    joined(coordinator)
    model.kernel[...] = jnp.zeros((4, 1))  # e.g. a restored checkpoint
    assert coordinator.schedule(lambda: model.kernel[...]).fetch().tolist() == [[0.0]] * 4
    step = _train_step(strategy, model, opt)
    x, y = _data()
    for _ in range(10):
        coordinator.schedule(step, args=(x, y))
    joined(coordinator)
    assert int(opt.step[...]) == 10
    kernel = np.asarray(model.kernel[...])
    assert not np.allclose(kernel, 0.0)
    # a change made while closures run is a write too: join() sends it before reading back
    coordinator.schedule(lambda: time.sleep(0.2))
    model.bias[...] = jnp.full((1,), 7.0)
    joined(coordinator)
    assert float(model.bias[...][0]) == 7.0
    assert float(coordinator.schedule(lambda: model.bias[...]).fetch()[0]) == 7.0


def test_a_failed_closure_changes_no_nnx_state(strategy, coordinator):
    model, opt = _built(strategy, optax.sgd(0.1))
    step = _train_step(strategy, model, opt)
    x, y = _data()
    coordinator.schedule(step, args=(x, y))
    joined(coordinator)
    before = np.asarray(model.kernel[...]).copy()

    def step_then_fail(x, y):
        step(x, y)
        raise RuntimeError("bad batch")

    coordinator.schedule(step_then_fail, args=(x, y))
    with pytest.raises(RuntimeError, match="bad batch"):
        joined(coordinator)
    joined(coordinator)
    np.testing.assert_array_equal(np.asarray(model.kernel[...]), before)
    assert int(opt.step[...]) == 1
    coordinator.schedule(step, args=(x, y))  # the worker's copy was reloaded: it goes on
    joined(coordinator)
    assert int(opt.step[...]) == 2


def test_a_killed_worker_still_counts_each_nnx_step_once(strategy, coordinator):
    model, opt = _built(strategy, optax.sgd(0.05))
    train = _train_step(strategy, model, opt)

    def step(x, y):
        time.sleep(0.01)
        return train(x, y)

    x, y = _data()
    cluster = strategy.extended.ray_cluster
    for _ in range(40):
        coordinator.schedule(step, args=(x, y))
    time.sleep(0.3)
    os.kill(cluster.worker_pids()[1], signal.SIGKILL)
    for _ in range(20):
        coordinator.schedule(step, args=(x, y))
    joined(coordinator)
    assert int(opt.step[...]) == 60


def test_an_nnx_object_not_made_by_init_is_refused(strategy, coordinator):
    plain = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"NNX object \(Linear\) that is not on the parameter "
                                         r"servers.*strategy.init"):
        coordinator.schedule(lambda: plain(np.ones((1, 4), np.float32)))
    with pytest.raises(ValueError, match=r"NNX object \(Rngs\)"):
        coordinator.schedule(lambda r: r(), args=(nnx.Rngs(0),))
    assert coordinator.schedule(lambda: 3).fetch(timeout=TIMEOUT) == 3  # nothing half-done


def test_init_makes_other_arrays_parameter_server_variables(strategy, coordinator):
    params = strategy.init(lambda: {"w": jnp.arange(4.0), "b": jnp.zeros(())})
    assert isinstance(params["b"], PSVariable)
    assert isinstance(params["w"], jm.experimental.ShardedVariable)  # the partitioner applies
    np.testing.assert_array_equal(np.asarray(read_many([params["w"], params["b"]])[0]),
                                  [0.0, 1.0, 2.0, 3.0])

    def sgd_step():
        g = jax.grad(lambda p: jnp.sum(p["w"] ** 2) + p["b"])(jm.read_values(params))
        jax.tree.map(lambda v, d: v.assign_sub(0.5 * d), params, g)

    for _ in range(3):  # one at a time: each reads the last one's result
        coordinator.schedule(sgd_step)
        joined(coordinator)
    np.testing.assert_array_equal(params["w"].numpy(), [0.0, 0.0, 0.0, 0.0])
    assert float(params["b"].numpy()) == -1.5


def test_rich_display_of_the_strategy_and_its_variables(strategy):
    shown = strategy._repr_html_()
    assert "<td>workers</td><td>2</td>" in shown and "<td>parameter servers</td><td>2</td>" in shown
    assert "FixedShardsPartitioner" in shown and "running (Ray actors)" in shown
    with strategy.scope():
        sharded = jm.Variable(jnp.arange(6.0), name="w")
        one = jm.Variable(jnp.float32(2.5), name="b")
    table = sharded._repr_html_()  # a row per shard: its rows of the whole value, where, values
    assert "<td>0</td><td>0:3</td>" in table and "<td>1</td><td>3:6</td>" in table
    assert "[0.0, 1.0, 2.0]" in table and "[3.0, 4.0, 5.0]" in table
    assert "/job:ps/replica:0/task:0" in table and "/job:ps/replica:0/task:1" in table
    assert "<td>2.5</td>" in one._repr_html_() and one.device in one._repr_html_()
    assert len(repr(strategy)) < 100  # the plain repr stays one short line
