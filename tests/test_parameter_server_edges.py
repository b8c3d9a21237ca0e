"""Parameter-server training at its edges: calls of several closures, failures inside them, stale
values, NNX objects changed on the coordinator, TF habits that would go silently wrong.

A local Ray runtime (2 workers, 2 PS); the coordinator sends one call at a time per worker
(``max_in_flight=1``), so closures queued behind busy workers go out together, in one call.
"""

import itertools
import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmirror as jm
from ps_helpers import TIMEOUT, joined, local_cluster
from jaxmirror.coordinator import actors, closures, shipping, worker_runtime
from jaxmirror.coordinator.ps_variables import coordinator_writes
from jaxmirror.experimental.coordinator import (
    CancelledError,
    ClusterCoordinator,
    OutOfRangeError,
)

_FN_IDS = itertools.count(10 ** 15)  # function and closure ids no coordinator gives


@pytest.fixture(scope="module")
def resolver():
    yield from local_cluster()


@pytest.fixture(scope="module")
def strategy(resolver):
    return jm.experimental.ParameterServerStrategy(resolver)


@pytest.fixture(scope="module")
def coordinator(strategy):
    return ClusterCoordinator(strategy, max_in_flight=1, max_closures_per_call=8)


def _busy_then(coordinator, *fns):
    """Occupy both workers, then queue ``fns``: they go to the first free worker in one call."""
    coordinator.schedule(time.sleep, args=(0.6,))
    coordinator.schedule(time.sleep, args=(2.0,))
    return [coordinator.schedule(fn) for fn in fns]


def test_a_function_whose_closure_was_skipped_still_runs_later(strategy, coordinator):
    with strategy.scope():
        counter = jm.Variable(0.0)

    def fail():
        counter.assign_add(1.0)
        raise ValueError("boom")

    def add():  # first shipped in the call where `fail` failed, so it never ran there
        counter.assign_add(1.0)
        return 1

    _, skipped = _busy_then(coordinator, fail, add)
    with pytest.raises(ValueError, match="boom"):
        joined(coordinator)
    with pytest.raises(CancelledError):
        skipped.fetch(timeout=TIMEOUT)
    later = [coordinator.schedule(add) for _ in range(4)]
    joined(coordinator)
    assert [rv.fetch() for rv in later] == [1] * 4
    assert float(counter.numpy()) == 4.0


def test_a_result_that_cannot_travel_fails_its_closure_only(strategy, coordinator):
    with strategy.scope():
        counter = jm.Variable(0.0)

    def add_ok():
        counter.assign_add(1.0)
        return 1

    def add_lock():
        counter.assign_add(1.0)
        return threading.Lock()

    ok, bad, after = _busy_then(coordinator, add_ok, add_lock, add_ok)
    with pytest.raises(TypeError, match="pickle"):
        joined(coordinator)
    assert ok.fetch(timeout=TIMEOUT) == 1
    with pytest.raises(CancelledError):
        after.fetch(timeout=TIMEOUT)
    assert float(counter.numpy()) == 1.0  # the failed closure's change never landed


@pytest.mark.parametrize("f_writes", [True, False])
def test_values_brought_back_earlier_are_not_used_later(strategy, coordinator, f_writes):
    # Worker 0 runs g, then f (another variable: written, or only read), then g again, each
    # call right behind the one before; meanwhile counter gains 100 elsewhere. The second g
    # must start from 101.
    import ray
    with strategy.scope():
        counter = jm.Variable(0.0)
        other = jm.Variable(0.0)

    def g():
        counter.assign_add(1.0)
        return counter.read_value()

    def f():
        if f_writes:
            other.assign_add(1.0)
        return other.read_value()

    sg, sf, no_args = shipping.ship(g), shipping.ship(f), shipping.ship(((), {}))
    g_id, f_id = next(_FN_IDS), next(_FN_IDS)  # ids the coordinator never gives
    worker = strategy.extended.ray_cluster.workers[0]
    writes = coordinator_writes()

    def run(fn_id, shipment, follows):
        closure_id = next(_FN_IDS)  # never a coordinator's closure id either
        outcome, = ray.get(worker.run.remote(
            [(closure_id, fn_id, shipment.blob, no_args.blob, sorted(shipment.variables))],
            writes, follows, True, closure_id), timeout=TIMEOUT)
        assert outcome[0] == "ok", outcome
        return shipping.unpack(outcome[1])

    assert float(run(g_id, sg, False)) == 1.0
    counter.assign_add(100.0)  # as another worker's push would (the calls carry the old
    run(f_id, sf, True)  # count of coordinator writes: not seen as one)
    assert float(run(g_id, sg, True)) == 102.0


def test_a_function_that_kills_its_worker_each_time_is_the_one_blamed(strategy, coordinator):
    with strategy.scope():
        counter = jm.Variable(0.0)

    def killer():
        os._exit(1)

    def innocent():
        counter.assign_add(1.0)
        return "fine"

    bad, good = _busy_then(coordinator, killer, innocent)
    with pytest.raises(RuntimeError, match="started 5 times and each time its worker died"):
        joined(coordinator)
    with pytest.raises(RuntimeError, match="started 5 times"):
        bad.fetch(timeout=TIMEOUT)
    assert good.fetch(timeout=TIMEOUT) == "fine"
    assert float(counter.numpy()) == 1.0


def _nnx_model(strategy, tx=optax.sgd(0.1)):
    return strategy.init(lambda: (m := nnx.Linear(4, 1, rngs=nnx.Rngs(0)),
                                  nnx.Optimizer(m, tx, wrt=nnx.Param)))


def _data():
    x = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    return x, x.sum(1, keepdims=True)


def test_nnx_jit_on_the_coordinator_between_joins_loses_no_training(strategy, coordinator):
    model, opt = _nnx_model(strategy)
    start = np.asarray(model.kernel[...]).copy()

    def step(x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, grads)
        return loss

    x, y = _data()
    for _ in range(10):
        coordinator.schedule(step, args=(x, y))
    nnx.jit(lambda m, x: m(x))(model, x)  # new array objects in every leaf, same values
    joined(coordinator)
    assert int(opt.step[...]) == 10
    kernel = np.asarray(model.kernel[...])
    assert not np.allclose(kernel, start)
    read = coordinator.schedule(lambda: model.kernel[...]).fetch(timeout=TIMEOUT)
    np.testing.assert_array_equal(read, kernel)


def test_an_nnx_change_between_schedules_is_sent_at_the_next_schedule(strategy, coordinator):
    model, _ = _nnx_model(strategy)
    joined(coordinator)
    coordinator.schedule(time.sleep, args=(0.5,))  # the first schedule after the join
    model.bias[...] = jnp.full((1,), 1000.0)  # changed while closures run
    seen = coordinator.schedule(lambda: model.bias[...])
    joined(coordinator)
    assert float(seen.fetch()[0]) == 1000.0
    assert float(model.bias[...][0]) == 1000.0  # and join() kept it


def test_workers_draw_their_own_random_numbers(strategy, coordinator):
    drop = strategy.init(lambda: nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1)))

    def draw():
        mask = np.asarray(drop(jnp.ones(64)))
        time.sleep(0.5)  # the other worker draws meanwhile
        return worker_runtime.worker_index(), mask

    a, b = coordinator.schedule(draw), coordinator.schedule(draw)
    joined(coordinator)
    (wa, ma), (wb, mb) = a.fetch(), b.fetch()
    assert {wa, wb} == {0, 1}
    assert not np.array_equal(ma, mb)


def test_join_refreshes_nnx_objects_even_when_a_closure_failed(strategy, coordinator):
    model, opt = _nnx_model(strategy)

    def step(x, y):
        grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, grads)

    def fail():
        raise KeyError("late")

    x, y = _data()
    coordinator.schedule(step, args=(x, y))
    joined(coordinator)
    coordinator.schedule(step, args=(x, y))
    coordinator.schedule(fail)
    with pytest.raises(KeyError):
        joined(coordinator)
    assert int(opt.step[...]) == 2


def test_tf_habits_that_would_lose_updates_are_refused(strategy, coordinator):
    outside = jm.Variable(0.0, name="outside")
    with pytest.raises(ValueError, match="'outside', which is not on the parameter servers.*"
                                         "strategy.scope"):
        coordinator.schedule(lambda: outside.assign_add(1.0))
    with pytest.raises(ValueError, match="not on the parameter servers"):
        coordinator.schedule(lambda v: v.assign_add(1.0), args=(outside,))
    metric = jm.metrics.Mean()
    with pytest.raises(ValueError, match="not on the parameter servers"):
        coordinator.schedule(lambda: metric.update_state(1.0))
    mirrored = jm.MirroredStrategy(["CPU:0", "CPU:1"])
    with mirrored.scope():
        other = jm.Variable(1.0, name="mirrored_w")
    with pytest.raises(ValueError, match="'mirrored_w'.*another strategy"):
        coordinator.schedule(lambda: other.read_value())
    model, _ = _nnx_model(strategy)
    kernel = model.kernel
    with pytest.raises(ValueError, match="Param of an NNX object on the parameter servers"):
        coordinator.schedule(lambda: kernel[...])
    with pytest.raises(ValueError, match="ParameterServerStrategy.function: pass the plain"):
        strategy.function(lambda: None)
    with strategy.scope():
        inside = jm.Variable(0.0)
        metric = jm.metrics.Mean()
    coordinator.schedule(lambda: (inside.assign_add(1.0), metric.update_state(4.0)))
    joined(coordinator)  # nothing half-done by the refusals above
    assert float(inside.numpy()) == 1.0 and float(metric.result()) == 4.0


def test_jax_functions_take_parameter_server_variables_on_the_coordinator(strategy):
    with strategy.scope():
        v = jm.Variable(np.arange(4.0, dtype=np.float32))
    assert float(jnp.sum(v)) == 6.0
    assert jax.jit(lambda a: a * 2)(v).tolist() == [0.0, 2.0, 4.0, 6.0]
    assert float(jnp.dot(v, v)) == 14.0


def test_per_worker_datasets_take_generator_functions_and_run_out_as_tf(strategy, coordinator):
    def gen():
        yield from (np.full((2,), float(i), np.float32) for i in range(2))

    iterator = iter(coordinator.create_per_worker_dataset(lambda: gen))

    def take(it):
        return next(it)

    got = [coordinator.schedule(take, args=(iterator,)) for _ in range(2)]
    joined(coordinator)
    assert all(rv.fetch().shape == (2,) for rv in got)
    for _ in range(6):  # 4 batches in all (2 per worker): more than that runs out
        coordinator.schedule(take, args=(iterator,))
    with pytest.raises(OutOfRangeError, match="per-worker iterator ran out of data"):
        joined(coordinator)


def test_parameter_servers_forget_finished_closure_ids(monkeypatch):
    monkeypatch.setattr(actors, "FORGET_AT", 4)
    ps = actors.ParameterServer(0)
    ps.create([(1, np.float32(0.0))])
    for closure_id in range(10):
        ps.apply_closures([(closure_id, [(1, "add", np.float32(1.0))])], [], watermark=8)
    assert ps.applied == {8, 9}  # pruned below the watermark
    assert ps.apply_closures([(9, [(1, "add", np.float32(1.0))])], [1])[0] == [False]
    assert float(ps.values[1]) == 10.0


@pytest.fixture
def installed_worker():
    """This process made worker 0 of 1 for the test, and no worker again after it."""
    worker_runtime.install(0, 1, [], lambda: None)
    yield
    worker_runtime.uninstall()


def test_a_worker_without_the_function_asks_for_it_again(installed_worker):
    no_args = shipping.ship(((), {})).blob
    fn = shipping.ship(lambda: 5).blob
    calls = [(1, 7, None, no_args, []), (2, 8, fn, no_args, [])]
    assert closures.run_closures(calls) == [("missing",), ("missing",)]
    outcome, = closures.run_closures([(1, 7, fn, no_args, [])])
    assert outcome[0] == "ok" and shipping.unpack(outcome[1]) == 5
    worker_runtime.uninstall()  # as the fixture does after the test: no worker any more
    with pytest.raises(RuntimeError, match="only resolves inside a worker process"):
        worker_runtime.worker_index()


def test_what_travels_by_value_and_what_is_imported(tmp_path, monkeypatch):
    # A function of the user's own module travels by value with the globals it uses; a module
    # it refers to is imported on the worker, so unrelated globals there (a lock) do not matter.
    (tmp_path / "ps_local_helpers.py").write_text(
        "import threading\nLOCK = threading.Lock()\nSCALE = 3\n\n"
        "def scale(x):\n    return SCALE * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import ps_local_helpers
    import cloudpickle
    shipped = shipping.ship(ps_local_helpers.scale)  # by value: no worker can import it
    by_reference = shipping.ship(lambda: ps_local_helpers.scale(1))  # no lock pickled
    assert "ps_local_helpers" not in cloudpickle.list_registry_pickle_by_value()  # unregistered
    monkeypatch.delitem(sys.modules, "ps_local_helpers")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    assert cloudpickle.loads(shipped.blob)(2) == 6  # loads where the module cannot be imported
    with pytest.raises(ModuleNotFoundError):
        cloudpickle.loads(by_reference.blob)
    lock = threading.Lock()
    with pytest.raises(TypeError, match="cannot send the function or its arguments to the "
                                        "workers.*lock"):
        shipping.ship(lambda: lock.locked())
    assert not any(m in ("numpy", "jax", "flax") for m in cloudpickle.list_registry_pickle_by_value())

