"""A step that fails at run time while its results are dropped: its error is raised (by the next
call on its variables or the first read of one), and the variables hold exactly the steps
before it, whatever the timing (issue 29, trial a2)."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmirror as jm
from jaxmirror.variables import state

from conftest import strategy

VALS = [1, 2, -100, 4, 8, 16, 32]


pytestmark = pytest.mark.usefixtures("nothing_open")


def _read(v, errors) -> float:
    """``v``'s value; the failure its first read raises goes to ``errors``."""
    try:
        return float(v.read_value())
    except Exception as e:  # noqa: BLE001
        errors.append(e)
        return float(v.read_value())


def _run_loop(s, v, step):
    """The trial's loop (results dropped), then a read of ``v``: ``(errors seen, value)``."""
    errors = []
    try:
        for val in VALS:
            step(np.full(s.num_replicas_in_sync, val, np.float32))
    except Exception as e:  # noqa: BLE001 - asserted below
        errors.append(e)
    try:
        value = float(v.read_value())
    except Exception as e:  # noqa: BLE001
        errors.append(e)
        value = float(v.read_value())
    return errors, value


def _make(s, release=None, write="assign_add"):
    with s.scope():
        v = jm.Variable(0.0, aggregation="sum")

    def cb(x):
        if float(x) < 0:
            if release is not None:
                release.wait(timeout=30)
            raise RuntimeError("neg batch")

    def fn(x):
        jax.debug.callback(cb, x[0])
        if write == "assign_add":
            v.assign_add(x[0])
        else:  # a write that does not read the failed step's value
            v.assign(jnp.where(x[0] > 0, x[0], 0.0))
        return x[0]

    return v, s.function(fn)


def _check(s, v, step, errors, value, expected):
    n = s.num_replicas_in_sync
    assert len(errors) == 1 and "neg batch" in str(errors[0])
    assert value == expected
    assert float(v.read_value()) == expected  # reported once
    step(np.full(n, 1, np.float32))  # the variable stays usable
    assert float(v.read_value()) == expected + n


@pytest.mark.parametrize("rep", range(4))
def test_a_dropped_failed_step_raises_and_keeps_exactly_the_steps_before_it(rep):
    s = strategy(8)
    v, step = _make(s)
    errors, value = _run_loop(s, v, step)
    _check(s, v, step, errors, value, 8.0 * (1 + 2))


def test_steps_dispatched_before_the_failure_is_seen_are_rolled_back_and_it_is_raised():
    s = strategy(4)
    release = threading.Event()
    v, step = _make(s, release)
    errors = []
    try:
        for val in VALS:
            step(np.full(4, val, np.float32))
            if val < 0:
                threading.Timer(0.2, release.set).start()
    except Exception as e:  # noqa: BLE001
        errors.append(e)
    release.set()
    value = _read(v, errors)
    _check(s, v, step, errors, value, 4.0 * (1 + 2))


@pytest.mark.parametrize("seen", [False, True])
def test_later_writes_that_do_not_read_the_failed_value_are_rolled_back_too(seen):
    s = strategy(2)
    release = threading.Event()
    if seen:
        release.set()
    v, step = _make(s, release, write="assign")
    errors = []
    try:
        for val in [2, -100, 32]:
            step(np.full(2, val, np.float32))
            if val < 0 and seen:
                state.settle_all()  # the failure is known before the next call
    except Exception as e:  # noqa: BLE001
        errors.append(e)
    release.set()
    value = _read(v, errors)
    assert len(errors) == 1 and "neg batch" in str(errors[0])
    assert value == 4.0  # assign of a mirrored sum: 2 * 2; the write of 32 is after the failure
