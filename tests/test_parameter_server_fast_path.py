"""The parameter-server fast path (issue 32): compiled loads of a closure's variables give what
the slow path gives (one ``assign`` per variable: ``JAXMIRROR_PS_FAST_PATHS=0``), bit for bit,
and keep exactly-once when a worker dies.
"""

import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ray

import jaxmirror as jm
from ps_helpers import TIMEOUT, joined, local_cluster
from jaxmirror.experimental import partitioners
from jaxmirror.experimental.coordinator import ClusterCoordinator

FEATURES, BATCH = 16, 32


@pytest.fixture(scope="module")
def resolver():
    yield from local_cluster()


def _loads(cluster) -> dict:
    """The workers' loads of closures' variables, by how: compiled or one assign each."""
    counts = ray.get([w.load_counts.remote() for w in cluster.workers])
    return {k: sum(c[k] for c in counts) for k in counts[0]}


def _data(n):
    rng = np.random.default_rng(7)
    xs = rng.normal(size=(n, BATCH, FEATURES)).astype(np.float32)
    ys = (xs @ rng.normal(size=(FEATURES,)).astype(np.float32)
          + rng.normal(size=(n, BATCH)).astype(np.float32))
    return xs, ys


def _train(monkeypatch, fast: bool, one_per_call: bool, n: int = 24) -> tuple:
    """``n`` closures on 1 worker and 2 parameter servers (fresh reads, TF's default): an SGD
    step on ``w`` (split over both servers), an increment, an overwrite and a bool flip.
    Returns (per-closure results, final values, compiled loads)."""
    monkeypatch.setenv("JAXMIRROR_PS_FAST_PATHS", "1" if fast else "0")
    r = jm.cluster_resolver.RayClusterResolver(1, 2)  # joins the module's Ray runtime
    try:
        s = jm.experimental.ParameterServerStrategy(
            r, variable_partitioner=partitioners.FixedShardsPartitioner(2))
        with s.scope():
            w = jm.Variable(np.zeros((FEATURES,), np.float32), name="w")
            steps = jm.Variable(np.int32(0), name="steps")
            ema = jm.Variable(np.float32(1.0), name="ema")
            odd = jm.Variable(False, name="odd")
        c = ClusterCoordinator(s)  # fresh_reads=True, up to 8 closures a call

        def step(x, y):
            def replica_fn(x, y):
                loss, g = jax.value_and_grad(lambda w_: jnp.mean((x @ w_ - y) ** 2))(
                    w.read_value())
                w.assign_sub(0.05 * g)
                return loss
            loss = s.run(replica_fn, args=(x, y))
            read = (w.read_value(), steps.read_value(), ema.read_value(), odd.read_value())
            steps.assign_add(1)
            ema.assign(0.9 * ema.read_value() + 0.1 * loss)
            odd.assign(jnp.logical_not(odd.read_value()))
            return (loss,) + read

        xs, ys = _data(n)
        before = _loads(s.extended.ray_cluster)["compiled"]
        if one_per_call:
            results = [c.schedule(step, args=(x, y)).fetch(timeout=TIMEOUT)
                       for x, y in zip(xs, ys)]
        else:
            rvs = [c.schedule(step, args=(x, y)) for x, y in zip(xs, ys)]
            joined(c)
            results = [rv.fetch(timeout=TIMEOUT) for rv in rvs]
        final = (w.numpy(), steps.numpy(), ema.numpy(), odd.numpy())
        compiled = _loads(s.extended.ray_cluster)["compiled"] - before
        return results, final, compiled
    finally:
        r.shutdown()


def _same(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_fast_paths_give_the_slow_paths_results_bit_for_bit(resolver, monkeypatch):
    slow = _train(monkeypatch, fast=False, one_per_call=True)
    assert slow[2] == 0  # the slow path: one assign per variable
    for one_per_call in (True, False):
        fast = _train(monkeypatch, fast=True, one_per_call=one_per_call)
        assert fast[2] >= 12  # compiled loads from the second load of the same variables on
        _same(fast[0], slow[0])  # each closure read what it read one per call, by Ray
        _same(fast[1], slow[1])
    results, final, _ = slow
    # Fresh reads: closure i starts from closure i-1's changes.
    assert [int(r[2]) for r in results] == list(range(24)) and int(final[1]) == 24
    assert [bool(r[4]) for r in results] == [i % 2 == 1 for i in range(24)]


def test_a_killed_worker_with_compiled_loads_still_gives_one_update_per_closure(resolver):
    s = jm.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=partitioners.FixedShardsPartitioner(2))
    cluster = s.extended.ray_cluster
    try:
        c = ClusterCoordinator(s)
        with s.scope():
            v = jm.Variable(np.zeros((4,), np.float32))  # 2 shards: one on each server

        def add():
            time.sleep(0.005)
            v.assign_add(np.ones((4,), np.float32))
            return v.read_value()

        [c.schedule(add) for _ in range(20)]
        joined(c)
        assert _loads(cluster)["compiled"] >= 1
        pid = cluster.worker_pids()[0]
        more = [c.schedule(add) for _ in range(60)]
        time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
        joined(c)
        np.testing.assert_array_equal(v.numpy(), np.full((4,), 80.0, np.float32))
        assert all(rv.fetch() is not None for rv in more)
        assert cluster.worker_pids()[0] != pid
    finally:
        cluster.close()
