"""Parameter-server training across notebook habits: re-run cells, objects of another strategy,
shut-down clusters, state that does not add up, NNX objects that change shape.

A local Ray runtime (2 workers, 2 PS); every wait is bounded.
"""

import gc
import os
import time
import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmirror as jm
from jaxmirror.experimental.coordinator import ClusterCoordinator
from ps_helpers import TIMEOUT, joined, local_cluster


@pytest.fixture(scope="module")
def resolver():
    yield from local_cluster()


@pytest.fixture(scope="module")
def strategy(resolver):
    return jm.experimental.ParameterServerStrategy(resolver)


@pytest.fixture(scope="module")
def coordinator(strategy):
    return ClusterCoordinator(strategy)


class Tracker(nnx.Module):
    """State that does not add up: a running minimum from +inf, a bfloat16 value."""

    def __init__(self):
        self.best = nnx.Variable(jnp.array(jnp.inf, jnp.float32))
        self.half = nnx.Variable(jnp.array([1.0, 3.0], jnp.bfloat16))


def test_state_that_is_not_a_sum_reaches_the_servers_exactly(strategy, coordinator):
    tracker = strategy.init(Tracker)

    def observe(loss):
        tracker.best[...] = jnp.minimum(tracker.best[...], loss)
        tracker.half[...] = jnp.array([-0.00390625, 3.0], jnp.bfloat16)

    coordinator.schedule(observe, args=(np.float32(0.5),))
    joined(coordinator)
    assert float(tracker.best[...]) == 0.5  # inf + (0.5 - inf) would be NaN
    assert np.asarray(tracker.half[...], np.float32).tolist() == [-0.00390625, 3.0]
    coordinator.schedule(observe, args=(np.float32(0.25),))
    joined(coordinator)
    assert float(tracker.best[...]) == 0.25


class Sowing(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(2, 1, rngs=rngs)

    def __call__(self, x):
        y = self.linear(x)
        self.sow(nnx.Intermediate, "activations", y)
        return y


class Growing(nnx.Module):
    def __init__(self):
        self.count = nnx.Variable(jnp.zeros(()))

    def __call__(self):
        self.extra = nnx.Variable(jnp.ones(()))  # made in a step: no place on the servers


def test_nnx_objects_that_sow_train_and_ones_that_grow_are_refused(strategy, coordinator):
    model, opt = strategy.init(lambda: (m := Sowing(nnx.Rngs(0)),
                                        nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param)))
    x = np.ones((4, 2), np.float32)

    def step():
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        opt.update(model, grads)

    for _ in range(3):
        coordinator.schedule(step)
    joined(coordinator)
    assert int(opt.step[...]) == 3
    growing = strategy.init(Growing)
    coordinator.schedule(lambda: growing())
    with pytest.raises(ValueError, match="changed the structure of NNX objects"):
        joined(coordinator)


def test_an_old_function_after_init_is_re_run_warns(strategy, coordinator):
    throwaway = strategy.init(lambda: nnx.Linear(3, 1, rngs=nnx.Rngs(0)))
    model = strategy.init(lambda: nnx.Linear(2, 1, rngs=nnx.Rngs(0)))

    def read():
        return model.kernel[...]

    coordinator.schedule(read)
    joined(coordinator)
    model_again = strategy.init(lambda: nnx.Linear(2, 1, rngs=nnx.Rngs(0)))  # the cell re-run
    # Objects that go meanwhile (collected in a full run) leave as many bundles as before:
    # the check must see the new init all the same.
    del throwaway
    gc.collect()
    with pytest.warns(UserWarning, match="'.*read' uses NNX objects from an earlier "
                                         "strategy.init"):
        coordinator.schedule(read)
    joined(coordinator)
    assert model_again is not model


def test_objects_of_another_strategy_and_parts_of_objects_are_refused(resolver, strategy,
                                                                      coordinator):
    other = jm.experimental.ParameterServerStrategy(resolver)  # a re-run strategy cell
    try:
        with other.scope():
            v = jm.Variable(1.0, name="from_the_other")
        model = other.init(lambda: nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
        with pytest.raises(ValueError, match="'from_the_other' belongs to another "
                                             "ParameterServerStrategy"):
            coordinator.schedule(lambda: v.read_value())
        with pytest.raises(ValueError, match="NNX object Linear belongs to another"):
            coordinator.schedule(lambda: model.kernel[...])
    finally:
        other.extended.ray_cluster.close()
    mine = strategy.init(lambda: nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
                                                nnx.Linear(2, 1, rngs=nnx.Rngs(1))))
    first = mine.layers[0]
    with pytest.raises(ValueError, match=r"a part \(Linear\) of an NNX object on the "
                                         r"parameter servers"):
        coordinator.schedule(lambda: first(np.ones((1, 2), np.float32)))
    assert coordinator.schedule(lambda: mine(np.ones((1, 2), np.float32)).shape).fetch(
        timeout=TIMEOUT) == (1, 1)


def test_a_shut_down_cluster_says_so(resolver):
    s = jm.experimental.ParameterServerStrategy(resolver)
    c = ClusterCoordinator(s)
    assert c.schedule(lambda: 1).fetch(timeout=TIMEOUT) == 1
    s.extended.ray_cluster.close()
    with pytest.raises(RuntimeError, match="cluster was shut down"):
        c.schedule(lambda: 2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_strategy_nobody_refers_to_frees_its_actors_and_objects(resolver, strategy):
    s = jm.experimental.ParameterServerStrategy(resolver)
    c = ClusterCoordinator(s)
    c.schedule(lambda: None)
    joined(c)
    pids = s.extended.ray_cluster.worker_pids() + s.extended.ray_cluster.ps_pids()
    del s, c
    gc.collect()
    deadline = time.monotonic() + 30
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(_alive, pids))
    # and NNX objects nobody refers to leave their strategy
    before = len(strategy.extended.nnx_bundles)
    model = strategy.init(lambda: nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
    assert len(strategy.extended.nnx_bundles) == before + 1
    del model
    gc.collect()
    assert len(strategy.extended.nnx_bundles) == before


def test_join_does_not_hang_when_the_watcher_loses_ray(resolver, monkeypatch):
    import ray
    s = jm.experimental.ParameterServerStrategy(resolver)
    c = ClusterCoordinator(s)
    try:
        slow = c.schedule(lambda: time.sleep(1.0))
        real_wait = ray.wait

        def broken_wait(*args, **kwargs):
            raise ConnectionError("GCS unreachable")

        monkeypatch.setattr(ray, "wait", broken_wait)
        with pytest.raises(RuntimeError, match="lost track of the running functions.*GCS"):
            joined(c)
        monkeypatch.setattr(ray, "wait", real_wait)
        with pytest.raises(RuntimeError, match="lost track"):
            slow.fetch(timeout=TIMEOUT)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert c.schedule(lambda: 3).fetch(timeout=TIMEOUT) == 3  # it goes on
    finally:
        s.extended.ray_cluster.close()


def test_nnx_objects_collected_during_a_join_do_not_break_it(strategy, coordinator,
                                                              monkeypatch):
    from jaxmirror.coordinator import nnx_binding
    holder = [strategy.init(lambda: nnx.Linear(2, 1, rngs=nnx.Rngs(0)))]
    read_many = nnx_binding.read_many

    def collecting(handles):  # the last reference goes, and the collector runs, mid-refresh
        holder.clear()
        gc.collect()
        return read_many(handles)

    monkeypatch.setattr(nnx_binding, "read_many", collecting)
    coordinator.schedule(lambda: None)
    joined(coordinator)
    monkeypatch.setattr(nnx_binding, "read_many", read_many)
    gc.collect()
    assert not holder
