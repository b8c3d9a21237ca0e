"""ParameterServerStrategy and ClusterCoordinator on a local Ray runtime (2 workers, 2 PS).

Every wait is bounded; Ray is shut down by the module fixture and the last test checks that no
Ray process is left.
"""

import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmirror as jm
from ps_helpers import (OWN, STARTUP_TIMEOUT, TIMEOUT, joined, left_after_shutdown,
                        local_cluster, own_processes)
from jaxmirror.coordinator import shipping
from jaxmirror.experimental import partitioners
from jaxmirror.experimental.coordinator import (
    CancelledError,
    ClusterCoordinator,
    RemoteValue,
    UnavailableError,
)



@pytest.fixture(scope="module")
def resolver():
    yield from local_cluster()


@pytest.fixture(scope="module")
def strategy(resolver):
    return jm.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=partitioners.FixedShardsPartitioner(2))


@pytest.fixture(scope="module")
def coordinator(strategy):
    c = ClusterCoordinator(strategy)
    strategy.extended.ray_cluster.wait_ready(STARTUP_TIMEOUT)
    return c


def test_cluster_spec_and_replicas(resolver, strategy):
    spec = resolver.cluster_spec()
    assert spec.num_tasks("worker") == 2 and spec.num_tasks("ps") == 2
    assert spec.num_tasks("chief") == 1
    assert strategy.num_replicas_in_sync == 1  # CPU workers: one replica each, as TF
    assert strategy.extended.parameter_devices == (
        "/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0")


def test_variables_round_robin_and_sharded_as_tf(strategy):
    with strategy.scope():
        a = jm.Variable(1.0)               # rank 0: never partitioned
        w = jm.Variable(np.arange(15, dtype=np.float32).reshape(5, 3))
        one = jm.Variable(np.ones((1, 4), np.float32))  # min(2, dim 0) = 1 shard
    assert type(a).__name__ == "PSVariable" and type(one).__name__ == "PSVariable"
    assert isinstance(w, jm.experimental.ShardedVariable)
    assert [v.shape for v in w.variables] == [(3, 3), (2, 3)]  # TF's div split
    devices = [a.device] + [v.device for v in w.variables] + [one.device]
    assert [d.split("task:")[1][0] for d in devices] == ["0", "1", "0", "1"]  # round-robin
    np.testing.assert_array_equal(w.numpy(), np.arange(15).reshape(5, 3))
    w.assign_sub(np.ones((5, 3), np.float32))
    np.testing.assert_array_equal(w.variables[1].numpy(), np.arange(9, 15).reshape(2, 3) - 1)
    assert float(a + 1.0) == 2.0


def test_remote_values(coordinator):
    rv = coordinator.schedule(lambda x: {"double": x * 2, "n": 3},
                              args=(np.arange(3.0, dtype=np.float32),))
    assert isinstance(rv, RemoteValue)
    out = rv.fetch(timeout=TIMEOUT)
    np.testing.assert_array_equal(out["double"], [0.0, 2.0, 4.0])
    assert out["n"] == 3
    assert isinstance(rv.get()["double"], jax.Array)
    assert coordinator.fetch([rv, 5])[0]["n"] == 3
    with pytest.raises(ValueError, match="RemoteValue cannot be passed"):
        coordinator.schedule(lambda v: v, args=(rv,))


def test_thirty_increments_give_exactly_thirty(strategy, coordinator):
    with strategy.scope():
        counter = jm.Variable(0.0)

    def increment():
        counter.assign_add(1.0)

    for _ in range(30):
        coordinator.schedule(increment)
    joined(coordinator)
    assert float(counter.numpy()) == 30.0


def test_assign_overwrites_and_increments_add_up(strategy, coordinator):
    with strategy.scope():
        v = jm.Variable(0.0)
    coordinator.schedule(lambda: v.assign(5.0))
    joined(coordinator)
    for _ in range(4):
        coordinator.schedule(lambda: v.assign_sub(0.5))
    joined(coordinator)
    assert float(v.numpy()) == 3.0


def test_closures_see_the_coordinators_writes(strategy, coordinator):
    # A worker starts a closure from the values its previous push brought back, unless the
    # coordinator wrote since.
    with strategy.scope():
        v = jm.Variable(np.zeros(4, np.float32))
    for _ in range(6):
        coordinator.schedule(lambda: v.assign_add(np.ones(4, np.float32)))
    joined(coordinator)
    v.assign(np.full(4, 100.0, np.float32))
    reads = [coordinator.schedule(lambda: v.read_value()) for _ in range(4)]
    joined(coordinator)
    assert [rv.fetch().tolist() for rv in reads] == [[100.0] * 4] * 4
    coordinator.schedule(lambda: v.assign(v.read_value() * 2))
    joined(coordinator)
    np.testing.assert_array_equal(v.numpy(), np.full(4, 200.0))


def test_a_closure_error_reaches_join_and_the_coordinator_goes_on(strategy, coordinator):
    with strategy.scope():
        v = jm.Variable(0.0)

    def bad():
        v.assign_add(100.0)  # never pushed: the closure failed
        raise KeyError("no such feature: 'age'")

    def slow():
        time.sleep(0.2)
        v.assign_add(1.0)

    first = coordinator.schedule(bad)
    queued = [coordinator.schedule(slow) for _ in range(8)]
    with pytest.raises(KeyError, match="no such feature") as info:
        joined(coordinator)
    assert any("Remote traceback" in n and "bad" in n for n in info.value.__notes__)
    with pytest.raises(KeyError):
        first.fetch(timeout=1)
    cancelled = 0
    for rv in queued:
        try:
            rv.fetch(timeout=TIMEOUT)
        except CancelledError:
            cancelled += 1
    assert cancelled >= 1
    ran = len(queued) - cancelled
    assert float(v.numpy()) == ran  # the failed closure's assignment was not applied
    assert coordinator.schedule(lambda: 7).fetch(timeout=TIMEOUT) == 7
    assert coordinator.done() in (True, False)


def test_async_sgd_on_linear_regression_converges(strategy, coordinator):
    rng = np.random.default_rng(0)
    true_w = np.array([1.0, -2.0, 3.0, 0.5], np.float32)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = x @ true_w
    with strategy.scope():
        w = jm.Variable(np.zeros(4, np.float32))

    def step(x, y):
        def replica_fn(x, y):
            loss, g = jax.value_and_grad(lambda w_: jnp.mean((x @ w_ - y) ** 2))(w.read_value())
            w.assign_sub(0.1 * g)
            return loss
        return strategy.run(replica_fn, args=(x, y))

    losses = [coordinator.schedule(step, args=(x, y)) for _ in range(150)]
    joined(coordinator)
    assert float(losses[0].fetch()) > 1.0
    assert float(losses[-1].fetch()) < 1e-6
    np.testing.assert_allclose(w.numpy(), true_w, atol=1e-3)


def test_per_worker_dataset_and_iterator(coordinator):
    def dataset_fn(ctx):
        base = 100 * ctx.input_pipeline_id
        return [np.float32(base + i) for i in range(1000)]

    it = iter(coordinator.create_per_worker_dataset(dataset_fn))
    with pytest.raises(TypeError, match="inside a function passed to"):
        next(it)
    seen = [coordinator.schedule(lambda i: next(i), args=(it,)) for _ in range(20)]
    joined(coordinator)
    values = sorted(float(rv.fetch()) for rv in seen)
    by_worker = {v // 100 for v in values}
    assert by_worker <= {0, 1} and len(values) == len(set(values)) == 20
    with pytest.raises(TypeError, match="must be a function"):
        coordinator.create_per_worker_dataset([1, 2])


def test_checkpoint_of_ps_variables_restores_into_mirrored_and_other_shards(
        strategy, coordinator, tmp_path):
    with strategy.scope():
        w = jm.Variable(np.arange(10, dtype=np.float32).reshape(5, 2))
        b = jm.Variable(0.5)
    coordinator.schedule(lambda: w.assign_add(np.ones((5, 2), np.float32)))
    joined(coordinator)
    path = str(tmp_path / "ckpt")
    jm.checkpoint.save(path, {"w": w, "b": b})
    mirrored = jm.MirroredStrategy(["CPU:0", "CPU:1"])
    with mirrored.scope():
        target = {"w": jm.Variable(np.zeros((5, 2), np.float32)), "b": jm.Variable(0.0)}
    jm.checkpoint.restore(path, target)
    np.testing.assert_array_equal(target["w"].numpy(), np.arange(10).reshape(5, 2) + 1)
    assert float(target["b"].numpy()) == 0.5
    other = jm.experimental.ParameterServerStrategy(
        strategy.cluster_resolver, variable_partitioner=partitioners.FixedShardsPartitioner(3))
    with other.scope():
        w3 = jm.Variable(np.zeros((5, 2), np.float32))
        b3 = jm.Variable(0.0)
    assert [v.shape[0] for v in w3.variables] == [2, 2, 1]
    jm.checkpoint.restore(path, {"w": w3, "b": b3})
    np.testing.assert_array_equal(w3.numpy(), np.arange(10).reshape(5, 2) + 1)
    other.extended.ray_cluster.close()


def test_a_killed_worker_still_gives_one_update_per_closure(strategy, coordinator):
    with strategy.scope():
        counter = jm.Variable(0.0)

    def increment():
        time.sleep(0.02)
        counter.assign_add(1.0)

    cluster = strategy.extended.ray_cluster
    pid = cluster.worker_pids()[0]
    for _ in range(40):
        coordinator.schedule(increment)
    time.sleep(0.3)
    os.kill(pid, signal.SIGKILL)
    for _ in range(20):
        coordinator.schedule(increment)
    joined(coordinator)
    assert float(counter.numpy()) == 60.0
    assert cluster.worker_pids()[0] != pid  # replaced


def _counts(cluster) -> dict:
    import ray
    counts = ray.get([p.counts.remote() for p in cluster.ps])
    return {k: sum(c[k] for c in counts) for k in counts[0]}


def _increments_with_death_after_push(strategy, coordinator, dedup: bool) -> tuple:
    """(the counter after 12 increments, closures the parameter servers got pushed twice)."""
    cluster = strategy.extended.ray_cluster
    import ray
    with strategy.scope():
        counter = jm.Variable(0.0)

    def increment():
        counter.assign_add(1.0)

    ray.get([p.set_deduplication.remote(dedup) for p in cluster.ps])
    before = _counts(cluster)["pushed_again"]
    pid = cluster.worker_pids()[0]
    try:
        # Worker 0 gets the first closure (the least loaded worker, lowest index, first) and
        # exits right after pushing its changes.
        ray.get(cluster.workers[0].exit_after_pushes.remote(1))
        rvs = [coordinator.schedule(increment) for _ in range(12)]
        joined(coordinator)
        assert all(rv.fetch() is None for rv in rvs)
        assert cluster.worker_pids()[0] != pid  # it did die, and was replaced
        again = _counts(cluster)["pushed_again"] - before
        return float(counter.numpy()), again
    finally:
        ray.get([p.set_deduplication.remote(True) for p in cluster.ps])


def test_a_worker_dying_after_its_push_is_deduplicated(strategy, coordinator):
    total, again = _increments_with_death_after_push(strategy, coordinator, dedup=True)
    assert again >= 1  # the death came after a push: its closures were re-run and pushed again
    assert total == 12.0


def test_without_deduplication_the_same_death_counts_twice(strategy, coordinator):
    # What the previous test guards against: the re-run closures' updates applied again.
    total, again = _increments_with_death_after_push(strategy, coordinator, dedup=False)
    assert again >= 1
    assert total == 12.0 + again


def test_a_worker_idle_since_its_last_push_reads_the_other_workers_changes(strategy,
                                                                           coordinator):
    # The values a push brings back are fresh only for a call queued right behind it.
    with strategy.scope():
        v = jm.Variable(0.0)

    def slow_add():
        time.sleep(0.5)
        v.assign_add(100.0)

    coordinator.schedule(lambda: v.assign_add(1.0))  # worker 0: the least loaded, first
    coordinator.schedule(slow_add)  # worker 1, pushing after worker 0's push came back
    joined(coordinator)
    read = coordinator.schedule(lambda: v.read_value())  # worker 0 again, idle since
    assert float(read.fetch(timeout=TIMEOUT)) == 101.0


def _batched_coordinator(resolver, fresh_reads):
    s = jm.experimental.ParameterServerStrategy(resolver)
    c = ClusterCoordinator(s, max_closures_per_call=8, fresh_reads=fresh_reads)
    with s.scope():
        v = jm.Variable(0.0)  # on parameter server 0
    return s, c, v


@pytest.mark.parametrize("fresh_reads", [True, False])
def test_closures_per_call_and_messages_per_closure(resolver, fresh_reads):
    s, c, v = _batched_coordinator(resolver, fresh_reads)
    cluster = s.extended.ray_cluster
    try:
        def add():
            time.sleep(0.01)
            v.assign_add(1.0)
            return v.read_value()

        before = _counts(cluster)["pushes"]
        seen = [c.schedule(add) for _ in range(40)]
        joined(c)
        pushes = _counts(cluster)["pushes"] - before
        assert float(v.numpy()) == 40.0  # each closure's change applied once
        reads = [float(rv.fetch()) for rv in seen]
        assert all(1.0 <= r <= 40.0 for r in reads)
        if fresh_reads:  # TF's way: every closure sends its change when it ends
            assert pushes == 40
            # and starts from the servers' values: the last one to start missed at most the
            # one closure running on the other worker.
            assert max(reads) >= 39.0
        else:  # a call's closures send theirs together
            assert pushes < 20
        # A worker killed with calls of several closures in flight: still one change each.
        c.schedule(lambda: time.sleep(0.2))
        more = [c.schedule(add) for _ in range(30)]
        time.sleep(0.1)
        os.kill(cluster.worker_pids()[0], signal.SIGKILL)
        joined(c)
        assert float(v.numpy()) == 70.0
        assert all(rv.fetch() is not None for rv in more)
    finally:
        cluster.close()


def test_coordinator_settings_are_checked(strategy, coordinator):
    with pytest.raises(ValueError, match="`max_closures_per_call` must be an integer >= 1, "
                                         "got 0"):
        ClusterCoordinator(strategy, max_closures_per_call=0)
    with pytest.raises(TypeError, match="`fresh_reads` must be True or False, got 'yes'"):
        ClusterCoordinator(strategy, fresh_reads="yes")
    with pytest.raises(ValueError, match="already has a coordinator.*'max_in_flight': 2, "
                                         "'max_closures_per_call': 8, 'fresh_reads': True"):
        ClusterCoordinator(strategy, fresh_reads=False)
    assert ClusterCoordinator(strategy, 2, 8, True) is coordinator


def test_a_killed_ps_gives_a_clear_error(resolver):
    s = jm.experimental.ParameterServerStrategy(resolver)
    with s.scope():
        v = jm.Variable(1.0)
        u = jm.Variable(2.0)
    c = ClusterCoordinator(s)
    c.schedule(lambda: v.assign_add(1.0))
    joined(c)
    pid = s.extended.ray_cluster.ps_pids()[1]
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    c.schedule(lambda: u.assign_add(1.0))
    with pytest.raises(UnavailableError, match="/job:ps/replica:0/task:1.*checkpoint"):
        joined(c)
    with pytest.raises(UnavailableError, match="task:1"):
        u.numpy()
    assert float(v.numpy()) == 2.0  # the other parameter server is fine
    s.extended.ray_cluster.close()


def test_bad_arguments(strategy, coordinator):
    with pytest.raises(ValueError, match="`num_workers` must be an integer >= 1, got 0"):
        jm.cluster_resolver.RayClusterResolver(0, 1)
    with pytest.raises(ValueError, match="worker and ps jobs"):
        jm.experimental.ParameterServerStrategy(jm.cluster_resolver.SimpleClusterResolver(
            jm.cluster_resolver.ClusterSpec({"worker": ["localhost:2222"]})))
    with pytest.raises(ValueError, match="must be a ParameterServerStrategy"):
        ClusterCoordinator(jm.MirroredStrategy(["CPU:0"]))
    with pytest.raises(TypeError, match="`fn` must be callable"):
        coordinator.schedule(3)
    with pytest.raises(TypeError, match="`args` must be a tuple or list"):
        coordinator.schedule(lambda x: x, args=3)
    with pytest.raises(RuntimeError, match="inside a function passed to"):
        strategy.run(lambda: 1)
    assert ClusterCoordinator(strategy) is coordinator  # one per strategy, as TF
    with pytest.raises(TypeError, match="cannot be pickled"):
        import pickle
        with strategy.scope():
            pickle.dumps(jm.Variable(1.0))
    assert not shipping.shipping()


def test_ray_is_gone_after_shutdown(resolver):
    before, raylets = OWN[id(resolver)]
    mine = own_processes(before, raylets)
    assert any("raylet" in p for p in mine) and any("gcs_server" in p for p in mine)
    resolver.shutdown()
    assert left_after_shutdown(resolver) == []
