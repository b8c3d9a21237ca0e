"""The call plan (``step/call_plan.py``): one plan per kind of arguments, chosen on the slow
path, moved on when JAX's call meets what it does not cover; no stack walk, no exception other
than the one named signal (``binding.PlanMiss``) choosing a path."""

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
