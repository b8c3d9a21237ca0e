"""What a variable holds, and how a step's writes to it commit or roll back.

A compiled step returns its variables' new arrays as soon as it is *dispatched*; whether it
*succeeds* (a ``jax.debug.callback`` can raise, a check can fail, XLA can fail at run time) is
known only later. Storing the new arrays at once keeps dispatch asynchronous, but an array of a
failed execution carries that failure forever. So a step's writes are stored *open*: each
variable keeps the last array known good (``_committed``) until every step that wrote it is
known to have succeeded. When a step is seen to have failed, each variable it wrote goes back to
that array, so a failed step changes nothing and every variable stays readable.

Steps are seen finished without waiting where possible: before every step with variables
(``poll``: the oldest steps that are ready), on any eager use of a variable (``settle``: the
steps that wrote it, waiting for them), and when more than ``MAX_OPEN`` steps are open (the
oldest is waited for, so that at most that many steps' arrays are held).

A failed step's error is raised by its results when they are read (JAX raises it) and, once,
by its variables: results are often dropped unread, and the loss of a step must never be silent.
From the failure until that report, every step that writes one of its variables is rolled back
too (those dispatched on its writes fail anyway; the others would make what the variables hold
depend on timing), so they hold exactly the steps before it. The report comes from the next
step call on one of them (``check`` before it dispatches; ``write_open`` after, for a caller
that does not check) or the first eager read of one (``settle``), after every open step is
closed. A call that waited for its own step and raised its failure itself (a fused step) says
so through ``_compat.forget_failed_effect_tokens``: its variables do not raise it again.

``lock`` serializes every read-modify-write of variables (a step's call with its write-back, an
eager ``assign*``, ``extended.update``): threads that share variables lose no update.
"""

from __future__ import annotations

import collections
import operator
import threading

from jaxmirror.core import _compat
from jaxmirror.core.values import PerReplica

# Steps whose writes may be open at once; the next step first waits for the oldest. An open
# step holds its written arrays (the base a later failure rolls back to) until it is closed;
# while it is queued, its runtime holds them anyway. Above the CPU in-flight bound (8), so that
# dispatch stays as asynchronous as the steps without variables.
MAX_OPEN = 32

lock = threading.RLock()

# A variable's state, for the compiled step that takes it as input. An attrgetter: it is on the
# hot path of steps that use variables, and a step may take an open state (it runs after it).
state_of = operator.attrgetter("_state")


class _Writes:
    """One dispatched step's writes: ``[(variable, new state)]`` and one array of the step."""

    __slots__ = ("handle", "pairs", "has_outputs", "error", "reported", "tainted")

    def __init__(self, handle, pairs, has_outputs: bool):
        self.handle = handle
        self.pairs = pairs
        self.has_outputs = has_outputs
        self.error = None
        self.reported = False
        self.tainted = []  # once failed: the variables whose ``_failure`` it is


# Open steps, oldest first.
_open: collections.deque = collections.deque()
# Failures seen and not reported yet, oldest first (``_reported_by_caller`` takes those seen
# while it closes the open steps as its own).
_failures: list = []


def initialize(var, state) -> None:
    """Give a new variable its first state (nothing open, nothing failed).

    Args:
        var: the variable.
        state: its array (or ``PerReplica`` of components).
    """
    var._state = state
    var._open = 0  # open steps that wrote it
    var._committed = None  # while some are open: its state before them, known good
    var._failure = None  # a failed step whose writes it lost, not yet reported


def detached_attributes(var) -> dict:
    """``var``'s attributes for a copy of it (copy, pickle): its settled state, nothing open.

    Args:
        var: the variable being copied.

    Returns:
        A new dict of its attributes; what is open or failed stays with ``var``.
    """
    settle(var, report=False)
    attributes = dict(var.__dict__)
    attributes.update(_open=0, _committed=None, _failure=None)  # as ``initialize`` sets them
    return attributes


def write_back(variables, states: dict) -> None:
    """Store new states now: writes done outside a compiled step (eager, ``update``, restore).

    Callers hold ``lock`` and have settled the variables (``settled``), so nothing is open.

    Args:
        variables: a sequence of variables.
        states: ``{index into variables: new state}``, each placed as ``state_of`` would be.

    Returns:
        None.

    Example:
        >>> import jax.numpy as jnp, jaxmirror
        >>> v = jaxmirror.Variable(1.0)
        >>> write_back([v], {0: jnp.float32(2.0)})
        >>> float(v.numpy())
        2.0
    """
    for i, new in states.items():
        variables[i]._state = new


def write_open(variables, states: dict, has_outputs: bool, single_device: bool = False) -> None:
    """Store a dispatched step's new states, open until the step is known to have succeeded.

    Args:
        variables: the step's variables (captured and passed ones).
        states: ``{index into variables: new state}`` (the step's extra outputs; one of them
            tells when the step finished, and whether it failed).
        has_outputs: whether the step returned values (which then report its failure).
        single_device: the step ran on one device, where it has often finished already (one
            CPU device runs small programs at once): then it is stored as committed.
    """
    handle = next(iter(states.values()))
    if isinstance(handle, PerReplica):
        handle = handle.stacked
    failure = _failure_of(variables[i] for i in states)
    if single_device and failure is None and not _open and handle.is_ready():
        try:
            handle.block_until_ready()
        except Exception:  # noqa: BLE001 - failed: kept open below, closed by the next poll
            pass
        else:
            write_back(variables, states)
            return
    pairs = [(variables[i], new) for i, new in states.items()]
    for var, new in pairs:
        if not var._open:
            var._committed = var._state
        var._open += 1
        var._state = new
    _open.append(_Writes(handle, pairs, has_outputs))
    if failure is not None:  # dispatched after a failure on its variables: it fails with it
        _report(failure)


def poll() -> None:
    """Close the oldest open steps that are finished; wait for the oldest past ``MAX_OPEN``.

    Called (under ``lock``) before a step reads its variables, so that a step seen to have
    failed is rolled back before the next one starts from its writes.
    """
    while _open and (len(_open) >= MAX_OPEN or _open[0].handle.is_ready()):
        _close_oldest()


def check(variables) -> None:
    """Before a step dispatches on ``variables``: raise the unreported failure that one of them
    lost writes to (every open step is closed first; see ``settle``), so that no step runs
    after a failure that was not reported yet.

    Args:
        variables: the step's variables (captured and passed ones).

    Raises:
        Exception: that failure's own error, once.
    """
    failure = _failure_of(variables)
    if failure is not None:
        _report(failure)


def settle(var, report: bool = True) -> None:
    """Wait for the steps that wrote ``var``; roll back failed ones; report a silent failure.

    Args:
        var: the variable about to be used outside a step.
        report: raise the error of a failed step that returned nothing and wrote ``var``, if no
            read reported it yet (once; the variable already holds its previous value).

    Raises:
        Exception: that step's own error, as described.
    """
    if var._open:
        with lock:
            while var._open and _open:
                _close_oldest()
    failed = var._failure
    if failed is not None and report:
        _report(failed)


def settled(var):
    """``var``'s state once ``settle`` has run: for eager reads outside ``Variable``.

    Args:
        var: a variable.

    Returns:
        Its state (an array, or a ``PerReplica``).
    """
    settle(var)
    return var._state


def settle_all() -> None:
    """Wait for every open step and close it (tests and benchmarks start from nothing open)."""
    with lock:
        while _open:
            _close_oldest()


def _close_oldest() -> None:
    writes = _open[0]  # taken off only once known: a KeyboardInterrupt here leaves it open
    try:
        writes.handle.block_until_ready()
        failed = False
    except Exception as e:  # the step failed at run time: its writes are undone
        writes.error = e
        failed = True
        _compat.forget_failed_effect_tokens(reported_here=False)
    _open.popleft()
    # A step after an unreported failure on one of its variables is undone with it, and
    # reported as it (one failure, one report), succeeded or not.
    failure = _failure_of(var for var, _ in writes.pairs)
    if failure is None and not failed:
        for var, new in writes.pairs:
            var._open -= 1
            # Later open steps build on it; with none, nothing is kept to roll back to.
            var._committed = new if var._open else None
        return
    if failure is None:
        failure = writes
        _failures.append(writes)
    for var, new in writes.pairs:
        var._open -= 1
        if var._state is new:  # its latest write: back to the last good state
            var._state = var._committed
        if var._failure is None:
            var._failure = failure
            failure.tainted.append(var)
        if not var._open:
            var._committed = None


def _reported_by_caller() -> None:
    """A call raised its own step's failure (it waited for it): the failures seen from now,
    with every open step closed, are that one; their variables report them no more."""
    with lock:
        known = len(_failures)
        settle_all()
        for failed in _failures[known:]:
            failed.reported = True
            _clear(failed)


def _clear(failed) -> None:
    if failed in _failures:
        _failures.remove(failed)
    for var in failed.tainted:
        if var._failure is failed:
            var._failure = None


def _failure_of(variables):
    """The unreported failure that one of ``variables`` lost writes to, or ``None``."""
    if not _failures:  # the usual case, on the hot path: none anywhere
        return None
    for var in variables:
        if var._failure is not None:
            return var._failure
    return None


def _report(failed) -> None:
    """Raise ``failed``'s error once every open step is closed (the steps after it on its
    variables are undone then); its variables report it no more."""
    settle_all()
    _clear(failed)
    if not failed.reported:
        failed.reported = True
        raise failed.error


_compat.failure_reported_hooks.append(_reported_by_caller)

__all__ = ["MAX_OPEN", "check", "detached_attributes", "initialize", "lock", "poll", "settle",
           "settle_all", "settled", "state_of", "write_back", "write_open"]
