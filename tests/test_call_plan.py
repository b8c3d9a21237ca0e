"""The call plan (``step/call_plan.py``): one plan per kind of arguments, chosen on the slow
path, moved on when JAX's call meets what it does not cover; no stack walk, no exception other
than the one named signal (``binding.PlanMiss``) choosing a path."""

import gc
import pathlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmirror as jm
from jaxmirror.step import call_plan
from jaxmirror.step.program import cache_of
from jaxmirror.variables import state
from conftest import strategy

PACKAGE = pathlib.Path(jm.__file__).parent


def first(s, out) -> float:
    return float(s.experimental_local_results(out)[0])


def _program(s, fn):
    return cache_of(s).get(fn, ())


def test_a_variable_where_the_first_call_had_an_array_is_taken_as_a_variable():
    s = strategy(2)
    with s.scope():
        v = jm.Variable(1.0, aggregation="mean")

    def step(x):
        if isinstance(x, jm.Variable):
            x.assign_add(2.0)
            return x.read_value()
        return x * 10.0

    assert first(s, s.run(step, args=(jnp.float32(3.0),))) == 30.0
    assert type(_program(s, step).plan) is call_plan.ArrayCall
    out = s.run(step, args=(v,))  # JAX's call met the variable: the plan moved on
    assert first(s, out) == 3.0 and float(v.numpy()) == 3.0
    assert type(_program(s, step).plan) is call_plan.VariableCall
    assert first(s, s.run(step, args=(jnp.float32(4.0),))) == 40.0  # arrays still run
    assert float(v.numpy()) == 3.0


def test_nnx_objects_after_arrays_move_the_plan_to_graphs_and_update_the_objects():
    s = strategy(2)

    def step(m):
        if isinstance(m, nnx.Module):
            m.count[...] = m.count[...] + 1
            return m.count[...]
        return m + 1

    class Counter(nnx.Module):
        def __init__(self):
            self.count = nnx.Variable(jnp.float32(0.0))

    assert first(s, s.run(step, args=(jnp.float32(1.0),))) == 2.0
    counter = Counter()
    assert first(s, s.run(step, args=(counter,))) == 1.0
    assert first(s, s.run(step, args=(counter,))) == 2.0
    assert float(counter.count[...]) == 2.0
    program = _program(s, step)
    assert type(program.plan) is call_plan.GraphCall and len(program.nested_programs()) == 1


def test_closure_variables_are_found_by_the_first_trace_and_taken_as_inputs():
    s = strategy(2)
    with s.scope():
        w = jm.Variable(2.0)

    def step(x):
        w.assign(w * x)
        return w.read_value()

    assert first(s, s.run(step, args=(jnp.float32(3.0),))) == 6.0
    program = _program(s, step)
    assert program.captured == (w,) and type(program.plan) is call_plan.CapturedCall
    assert program.trace_count == 1  # found in the first trace, not traced again
    assert first(s, s.run(step, args=(jnp.float32(0.5),))) == 3.0


def test_the_users_own_jit_takes_a_variable_as_its_value_inside_and_outside_a_step():
    s = strategy(2)
    with s.scope():
        v = jm.Variable(jnp.arange(3.0))
    double = jax.jit(lambda a: a * 2)
    np.testing.assert_array_equal(double(v), [0.0, 2.0, 4.0])  # no step: the guard is off

    def step(x):
        return double(v) + x  # the user's jit inside the trace: the guard is cleared

    out = s.run(step, args=(jnp.ones(3),))
    np.testing.assert_array_equal(s.experimental_local_results(out)[1], [1.0, 3.0, 5.0])
    np.testing.assert_array_equal(double(v), [0.0, 2.0, 4.0])  # and off again after the call


def test_another_thread_jitting_a_variable_is_not_refused_while_a_step_is_called():
    s = strategy(2)
    with s.scope():
        v = jm.Variable(jnp.float32(5.0))
    plus = jax.jit(lambda a: a + 1)
    results, stop = [], threading.Event()

    def other():
        while not stop.is_set() and len(results) < 200:
            results.append(float(plus(v)))

    thread = threading.Thread(target=other)
    thread.start()
    step = s.function(lambda x: x * 2)
    try:
        for i in range(50):
            assert first(s, step(jnp.float32(i))) == 2.0 * i
    finally:
        stop.set()
        thread.join(60)
    assert results and set(results) == {6.0}


def test_a_variable_holds_one_copy_once_its_steps_are_known_good():
    s = strategy(2)
    with s.scope():
        v = jm.Variable(1.0)

    @s.function
    def step():
        v.assign_add(1.0)

    for _ in range(3):
        step()
    held = v.variable_state
    assert held.committed is not None or held.open == 0  # open: the last good copy kept
    state.settle_all()
    assert held.committed is None and held.open == 0 and state.open_steps() == 0
    assert float(v.numpy()) == 4.0


def test_no_stack_walk_and_one_named_signal_choose_the_path():
    program = (PACKAGE / "step" / "program.py").read_text()
    # Program.__call__ catches only the named signal and JAX refusing the arguments.
    call = program[program.index("    def __call__(self, *args"):program.index("    def capture(")]
    assert call.count("except") == 2 and "except PlanMiss" in call
    assert "Discovered" not in program and "GraphArguments" not in program


def test_a_step_erroring_in_its_own_trace_is_not_traced_again():
    s = strategy(2)
    calls = []

    def step(x):
        calls.append(1)
        raise ValueError("mine")

    misplaced = jax.device_put(jnp.ones(2), jax.devices()[3])
    with pytest.raises(ValueError, match="mine"):
        s.run(step, args=(misplaced,))
    assert len(calls) == 1


def test_two_programs_and_eager_writes_share_captured_variables_without_losing_one():
    s = strategy(2)
    with s.scope():
        a = jm.Variable(0.0)
        b = jm.Variable(0.0)

    @s.function
    def both():
        a.assign_add(1.0)
        b.assign_add(10.0)

    @s.function
    def only_a():
        a.assign_add(100.0)

    for i in range(6):  # the records take the variables from each other, and from eager writes
        both()
        if i % 2:
            only_a()
        if i == 3:
            b.assign_add(1000.0)
            assert float(b.numpy()) == 1040.0
    assert float(a.numpy()) == 6 + 300 and float(b.numpy()) == 1060.0
    state.settle_all()
    assert a.variable_state.committed is None and b.variable_state.committed is None


def test_a_captured_variable_passed_as_an_argument_too_is_one_variable():
    s = strategy(2)
    with s.scope():
        v = jm.Variable(1.0)

    @s.function
    def step(w):
        v.assign_add(1.0)  # by closure
        return w.read_value()  # and as the argument: the same variable

    step(v)
    assert float(v.numpy()) == 2.0
    assert first(s, step(v)) == 3.0 and float(v.numpy()) == 3.0


def test_a_handle_where_the_plan_had_an_array_is_a_clear_error_not_a_loop():
    s = strategy(2)
    with s.scope():
        sharded = jm.experimental.ShardedVariable([jm.Variable([1.0, 2.0]), jm.Variable([3.0])])
    step = s.function(lambda x: x * 2)
    np.testing.assert_array_equal(step(jnp.ones(3)), [2.0, 2.0, 2.0])
    with pytest.raises(TypeError, match=r"run: `<lambda>` got ShardedVariable as an argument.*"
                                        r"read_value\(\)"):
        step(sharded)


def _blocking(event):
    """A host callback that holds its step open until ``event`` is set."""
    def wait(x):
        event.wait(30)
        return x
    return lambda x: jax.pure_callback(wait, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def test_reading_or_assigning_a_variable_the_open_step_does_not_write_does_not_wait():
    s = strategy(2)
    with s.scope():
        w = jm.Variable(1.0)
        lr = jm.Variable(0.5)  # read by the step, never written by it (a learning rate)
    release = threading.Event()
    hold = _blocking(release)

    @s.function
    def train():
        w.assign(hold(w.read_value()) * lr.read_value())

    @s.function
    def evaluate():
        return w.read_value() + lr.read_value()

    release.set()
    train()  # compiled, and done: w = 0.5
    state.settle_all()
    release.clear()
    try:
        train()  # open (w = 0.5 * 0.5 once done): its callback waits for `release`
        assert float(lr.numpy()) == 0.5  # returns at once: the open step does not write lr
        lr.assign(0.25)  # an eager schedule update: no wait either
        out = evaluate()  # another program reading w: dispatched without waiting
        assert state.open_steps() >= 1 and not release.is_set()
    finally:
        release.set()
    assert first(s, out) == 0.25 + 0.25  # w after the second step, the new lr
    assert float(w.numpy()) == 0.25


def test_a_failed_step_is_undone_when_a_later_open_step_wrote_other_variables():
    s = strategy(2)
    with s.scope():
        v0 = jm.Variable(0.0)
        v1 = jm.Variable(0.0)
    release = threading.Event()

    def fail(x):
        release.wait(30)
        raise ValueError("boom")

    def step(x):
        if x.shape[0] == 1:  # this signature writes v0 and fails at run time
            jax.debug.callback(fail, x)
            v0.assign_add(1.0)
        else:  # this one writes only v1
            v1.assign_add(1.0)

    s.run(step, args=(jnp.ones(2),))
    s.run(step, args=(jnp.ones(1),))  # open, fails once released
    s.run(step, args=(jnp.ones(2),))  # dispatched while it is open
    release.set()
    with pytest.raises(Exception, match="boom"):  # reported once...
        v0.numpy()
    assert float(v0.numpy()) == 0.0 and float(v1.numpy()) == 2.0  # ...and undone


def test_a_gone_steps_record_keeps_no_array_of_its_variables_alive():
    s = strategy(2)
    with s.scope():
        counter = jm.Variable(0.0)

    def make():
        with s.scope():
            big = jm.Variable(jnp.zeros((123, 45)))

        def step():
            big.assign_add(jnp.ones((123, 45)))
            counter.assign_add(1.0)

        s.run(step)
        return step

    step = make()
    del step
    gc.collect()
    assert float(counter.numpy()) == 1.0  # a read gives the record's variables back
    gc.collect()
    assert not [a for a in jax.live_arrays() if a.shape == (123, 45)]


def test_an_nnx_steps_own_trace_error_is_not_retried_with_mirrored_arguments():
    s = strategy(2)
    model = s.init(lambda: nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    far = jax.device_put(jnp.ones((4, 2)), jax.devices()[5])
    runs = []

    def step(m, x):
        runs.append(1)
        raise ValueError("mine")

    with pytest.raises(ValueError, match="mine"):
        s.run(step, args=(model, far))
    assert len(runs) == 1
