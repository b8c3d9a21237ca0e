"""Steps that fail at run time change nothing and poison nothing; threads lose no update;
jax_debug_nans works inside `run`; programs are released with their functions."""

import gc
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

import jaxmirror as jm
from jaxmirror.core import inflight
from jaxmirror.step.program import cache_of
from jaxmirror.variables import state

from conftest import strategy


class Boom(Exception):
    pass


def _raise_if(flag):
    if flag:
        raise Boom("boom on request")


def _raises_boom(thunk):
    with pytest.raises(Exception, match="boom on request"):
        thunk()


pytestmark = pytest.mark.usefixtures("nothing_open")


def _counter_step(s, v, *, returns=True):
    @s.function
    def step(flag):
        v.assign_add(1.0)
        jax.debug.callback(_raise_if, flag)
        return v.read_value() if returns else None
    return step


@pytest.mark.parametrize("n", [1, 2, 4])
def test_a_step_failing_at_run_time_changes_no_variable_and_raises_from_its_result(n):
    s = jm.MirroredStrategy([f"CPU:{i}" for i in range(n)])
    with s.scope():
        v = jm.Variable(10.0)
        w = jm.Variable([1.0, 2.0], aggregation="mean")
    step = _counter_step(s, v)

    @s.function
    def both(flag):
        w.assign(w * 2.0)
        return step.fn(flag)

    assert float(step(jnp.int32(0))) == 11.0

    def run_failing():
        float(both(jnp.int32(1)))  # one replica runs synchronously: the call itself raises
    _raises_boom(run_failing)
    if n > 1:  # dispatched asynchronously: its variables report it too, once
        _raises_boom(v.numpy)
    # Every variable it wrote is readable, with its previous value, as often as asked.
    for _ in range(2):
        assert float(v.numpy()) == 11.0
        assert w.numpy().tolist() == [1.0, 2.0]
        assert [float(c) for c in v.values] == [11.0] * n
    # The next steps run from there; nothing raises the old error again.
    assert float(step(jnp.int32(0))) == 12.0
    assert float(both(jnp.int32(0))) == 13.0 and w.numpy().tolist() == [2.0, 4.0]


def test_a_failed_step_never_read_does_not_raise_from_later_unrelated_calls():
    s = strategy(4)
    with s.scope():
        v = jm.Variable(0.0)
        other = jm.Variable(0.0)
    step = _counter_step(s, v)

    @s.function
    def unrelated():
        other.assign_add(1.0)
        return jm.get_replica_context().all_reduce("sum", 1.0)

    step(jnp.int32(1))  # fails; its result is dropped unread
    # More calls than the in-flight bound, so the failed one is waited for in between.
    for _ in range(3 * inflight.MAX_IN_FLIGHT):
        out = unrelated()
    assert float(out) == 4.0
    total = s.reduce("sum", s.experimental_distribute_values_from_function(lambda c: 1.0), axis=None)
    assert float(total) == 4.0
    assert float(other.numpy()) == 3 * inflight.MAX_IN_FLIGHT
    _raises_boom(v.numpy)  # its results were dropped: its variables report it, once
    assert float(v.numpy()) == 0.0  # rolled back, readable
    assert float(step(jnp.int32(0))) == 1.0


def test_an_error_read_from_the_results_is_raised_once_more_by_the_next_step_on_its_variable():
    s = strategy(2)
    with s.scope():
        v = jm.Variable(0.0)
    step = _counter_step(s, v)
    out = step(jnp.int32(1))
    _raises_boom(lambda: float(out))
    _raises_boom(lambda: step(jnp.int32(0)))  # its variables report it too, once; undone
    # The failed step is reported now: the next steps start from the rolled-back value.
    assert float(step(jnp.int32(0))) == 1.0
    assert float(step(jnp.int32(0))) == 2.0


def test_steps_dispatched_on_a_failed_steps_writes_are_rolled_back_with_it():
    s = strategy(2)
    with s.scope():
        v = jm.Variable(0.0)
    release = threading.Event()

    def fail_when_released(flag):
        if flag:
            release.wait(timeout=30)
            raise Boom("boom on request")

    @s.function
    def step(flag):
        v.assign_add(1.0)
        jax.debug.callback(fail_when_released, flag)
        return v.read_value()

    good = [step(jnp.int32(0)) for _ in range(2)]
    failing = step(jnp.int32(1))  # blocks in its callback until released
    later = [step(jnp.int32(0)) for _ in range(2)]  # dispatched on its open writes
    release.set()
    assert [float(x) for x in good] == [1.0, 2.0]
    for x in [failing] + later:  # they ran on the failed step's writes: its error is theirs
        _raises_boom(lambda x=x: float(x))
    _raises_boom(v.numpy)  # and its variable, once
    assert float(v.numpy()) == 2.0
    assert float(step(jnp.int32(0))) == 3.0


def test_a_failed_step_without_outputs_reports_its_error_at_the_first_read_only():
    s = strategy(2)
    with s.scope():
        v = jm.Variable(5.0)
        m = jm.Variable(0.0, synchronization="on_read", aggregation="sum")

    @s.function
    def step(flag):
        v.assign_add(1.0)
        m.assign_add(1.0)
        jax.debug.callback(_raise_if, flag)

    assert step(jnp.int32(0)) is None
    assert float(v.numpy()) == 6.0 and float(m.numpy()) == 2.0
    assert step(jnp.int32(1)) is None
    _raises_boom(v.numpy)  # its variables are its only results: the first read reports it
    assert float(v.numpy()) == 6.0  # ... once; then the previous value
    assert float(m.numpy()) == 2.0  # reported already, through v
    assert [float(c) for c in m.values] == [1.0, 1.0]


def test_io_and_pure_callbacks_failing_roll_back_variables_passed_as_arguments():
    s = strategy(2)
    with s.scope():
        v = jm.Variable(1.0)

    def io_step(var, flag):
        var.assign(var * 3.0)
        io_callback(lambda f: _raise_if(f) or np.int32(0), jax.ShapeDtypeStruct((), jnp.int32),
                    flag)
        return var.read_value()

    def pure_step(var, flag):
        y = jax.pure_callback(lambda f: (_raise_if(f), np.float32(1.0))[1],
                              jax.ShapeDtypeStruct((), jnp.float32), flag)
        var.assign_add(y)
        return var.read_value()

    for fn, ok in [(io_step, 3.0), (pure_step, 4.0)]:
        out = s.run(fn, args=(v, jnp.int32(1)))
        _raises_boom(lambda: float(out))
        _raises_boom(v.numpy)  # its variable reports it too, once
        assert float(v.numpy()) == ok / 3.0 if fn is io_step else float(v.numpy()) == 3.0
        assert float(s.run(fn, args=(v, jnp.int32(0)))) == ok


def test_a_repr_of_a_variable_after_a_silent_failure_does_not_swallow_the_report():
    s = strategy(2)
    with s.scope():
        v = jm.Variable(1.0, name="x")

    @s.function
    def step():
        v.assign(2.0)
        jax.debug.callback(_raise_if, True)

    step()
    assert "numpy=1.0" in repr(v)
    _raises_boom(v.read_value)
    assert float(v.read_value()) == 1.0


def test_open_writes_stay_bounded_and_commit_in_order():
    s = strategy(2)
    with s.scope():
        v = jm.Variable(0.0)

    @s.function
    def step():
        v.assign_add(1.0)

    for _ in range(5 * state.MAX_OPEN):
        step()
        assert state.open_steps() <= state.MAX_OPEN
    assert float(v.numpy()) == 5 * state.MAX_OPEN
    assert state.open_steps() == 0 and v.variable_state.committed is None


# -- jax_debug_nans / jax_debug_infs ----------------------------------------------------------
@pytest.mark.parametrize("flag,make,kind", [
    ("jax_debug_nans", lambda x: jnp.log(x - 2.0), "nan"),
    ("jax_debug_infs", lambda x: 1.0 / (x - 1.0), "inf"),
])
def test_debug_nans_and_infs_raise_jaxs_own_error_inside_run(flag, make, kind):
    s = strategy(2)
    with s.scope():
        v = jm.Variable(7.0)

    @s.function
    def step(x):
        total = jm.get_replica_context().all_reduce("sum", x) / 2.0
        y = make(total)
        v.assign(y)
        return y

    jax.config.update(flag, True)
    try:
        with pytest.raises(FloatingPointError, match=f"invalid value \\({kind}\\)"):
            step(jnp.float32(1.0))
        assert float(step(jnp.float32(3.0))) == pytest.approx(float(make(jnp.float32(3.0))))
    finally:
        jax.config.update(flag, False)
    assert float(v.numpy()) == pytest.approx(float(make(jnp.float32(3.0))))
    assert step.compile_count >= 1


def test_debug_nans_names_the_operation_when_each_replica_differs():
    s = strategy(4)
    x = s.experimental_distribute_values_from_function(
        lambda c: jnp.float32(c.replica_id_in_sync_group))
    jax.config.update("jax_debug_nans", True)
    try:
        with pytest.raises(FloatingPointError, match="sqrt"):
            s.run(lambda a: jnp.sqrt(a - 2.0), args=(x,))
    finally:
        jax.config.update("jax_debug_nans", False)


# -- threads --------------------------------------------------------------------------------------
def _join_all(threads, timeout=120):
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread hung"


@pytest.mark.parametrize("style", ["closure", "argument", "eager", "mixed"])
def test_threads_sharing_variables_lose_no_update(style):
    s = strategy(2)
    with s.scope():
        counter = jm.Variable(0.0)
        metric = jm.Variable(0.0, synchronization="on_read", aggregation="sum")

    @s.function
    def by_closure():
        counter.assign_add(1.0)
        metric.assign_add(0.5)  # each replica: the total grows by 1

    def by_argument(c, m):
        c.assign_add(1.0)
        m.assign_add(0.5)

    def eager():  # each assign* is one read-modify-write
        counter.assign_add(1.0)

    calls = {"closure": [by_closure] * 2, "eager": [eager] * 2, "mixed": [by_closure, eager],
             "argument": [lambda: s.run(by_argument, args=(counter, metric))] * 2}[style]
    errors = []

    def work(call):
        try:
            for _ in range(150):
                call()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    _join_all([threading.Thread(target=work, args=(c,)) for c in calls])
    assert not errors
    assert float(counter.numpy()) == 300.0
    assert float(metric.numpy()) == 150.0 * sum(c is not eager for c in calls)


def test_threads_running_extended_update_and_steps_lose_no_update():
    s = strategy(2)
    with s.scope():
        v = jm.Variable(0.0)

    @s.function
    def step():
        v.assign_add(1.0)

    def updates():
        for _ in range(100):
            s.extended.update(v, lambda var: var.assign_add(2.0))

    def steps():
        for _ in range(100):
            step()

    _join_all([threading.Thread(target=updates), threading.Thread(target=steps)])
    assert float(v.numpy()) == 300.0


# -- memory: programs go with their functions ------------------------------------------------------
def test_a_program_is_released_with_its_function():
    s = strategy(2)
    with s.scope():
        v = jm.Variable(1.0)

    def step():
        v.assign_add(1.0)
        return v.read_value()

    assert float(s.run(step)) == 2.0
    gc.collect()  # programs of earlier tests' functions, garbage already, go first
    before = len(cache_of(s))
    program = weakref.ref(cache_of(s).get(step, ()))
    decorated = s.function(lambda: v.read_value() * 2)
    assert float(decorated()) == 4.0
    assert len(cache_of(s)) == before + 1
    del decorated
    gc.collect()
    assert len(cache_of(s)) == before and program() is not None
    del step
    gc.collect()
    assert len(cache_of(s)) == before - 1 and program() is None


def test_program_cache_of_finds_each_strategys_own_cache():
    a, b = strategy(2), strategy(4)

    def double(x):
        return x * 2

    assert float(a.run(double, args=(jnp.float32(1.5),))) == 3.0
    assert cache_of(a).get(double, ()).trace_count == 1  # the program run made
    assert cache_of(b) is not cache_of(a)
    assert double not in [p.fn for p in cache_of(b).programs()]
    assert cache_of(object()) is None and cache_of(3) is None


def _strategy_variable_and_steps():
    s = jm.MirroredStrategy(["CPU:0", "CPU:1"])
    with s.scope():
        v = jm.Variable(1.0)
        m = jm.Variable(0.0, synchronization="on_read", aggregation="sum")

    @s.function
    def step(x):
        v.assign_add(x)
        m.assign_add(x)
        return v.read_value()

    assert float(step(jnp.float32(1.0))) == 2.0
    assert float(s.run(lambda var: var * 2, args=(v,))) == 4.0  # variables as arguments too
    return weakref.ref(s), weakref.ref(v), weakref.ref(step.program)


def test_a_strategy_its_variables_and_programs_are_released_with_their_last_user():
    refs = _strategy_variable_and_steps()
    gc.collect()
    assert [r() for r in refs] == [None] * 3  # JAX's compilation caches keep none of them


def test_bound_methods_share_a_program_while_their_object_lives():
    s = strategy(2)

    class Model:
        def __init__(self):
            self.scale = 3.0

        def step(self, x):
            return x * self.scale

    m = Model()
    assert float(s.run(m.step, args=(jnp.float32(2.0),))) == 6.0
    assert float(s.run(m.step, args=(jnp.float32(3.0),))) == 9.0  # a new bound method object
    program = cache_of(s).get(m.step, ())
    assert program.trace_count == 1 and program.fn == m.step
    owner = weakref.ref(m)
    del m
    gc.collect()
    assert owner() is None and program not in cache_of(s).programs()


def test_callables_that_cannot_be_weakly_referenced_still_run_and_are_cached():
    s = strategy(2)

    class Negate:
        __slots__ = ()  # no __weakref__

        def __call__(self, x):
            return -x

    negate = Negate()
    with pytest.raises(TypeError):
        weakref.ref(negate)
    assert float(s.run(negate, args=(jnp.float32(2.0),))) == -2.0
    program = cache_of(s).get(negate, ())
    assert float(s.run(negate, args=(jnp.float32(3.0),))) == -3.0
    assert cache_of(s).get(negate, ()) is program and program.trace_count == 1
