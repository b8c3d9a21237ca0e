"""What a variable holds, and how a step's writes to it commit or roll back.

A compiled step returns its variables' new arrays as soon as it is *dispatched*; whether it
*succeeds* (a ``jax.debug.callback`` can raise, a check can fail, XLA can fail at run time) is
known only later. Storing the new arrays at once keeps dispatch asynchronous, but an array of a
failed execution carries that failure forever. So a step's writes are stored *open*: each
variable's ``VariableState`` keeps the last array known good (``committed``) until every step
that wrote it is known to have succeeded; then it holds one copy again. When a step is seen to have failed, each variable it wrote goes back to
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
import threading
import weakref

from jaxmirror.core import _compat
from jaxmirror.core.values import PerReplica

# Steps whose writes may be open at once; the next step first waits for the oldest. An open
# step holds its written arrays (the base a later failure rolls back to) until it is closed;
# while it is queued, its runtime holds them anyway. Above the CPU in-flight bound (8), so that
# dispatch stays as asynchronous as the steps without variables.
MAX_OPEN = 32

lock = threading.RLock()

class VariableState:
    """What one variable holds: its state, and what undoing a failed step needs.

    A variable owns one for its whole life (``Variable.variable_state``); only this module
    changes it: the queue of open steps, and eager writes through ``set``. While a call plan's
    ``CommitRecord`` holds the variable (it captures it), the record keeps the value, the open
    count and the last good value for all its variables at once, and these read through it.

    Attributes:
        value: the state (an array, or a ``PerReplica`` of components); a compiled step takes
            it as input (it may be open: the step runs after the one that wrote it).
        open: how many open steps wrote it.
        committed: while some are open, the state before them, known good; ``None`` once
            every step that wrote it is known to have succeeded (one copy held then).
        failure: a failed step whose writes it lost, not reported yet.
        own_value, own_open, own_committed: the same, kept here while no record holds it.
        record, index: the ``CommitRecord`` holding it, and its place there (or ``None``).

    Example:
        >>> s = VariableState(1.0)
        >>> s.set(2.0); (s.value, s.committed, s.open)
        (2.0, None, 0)
    """

    __slots__ = ("own_value", "own_open", "own_committed", "failure", "record", "index")

    def __init__(self, value):
        self.own_value = value
        self.own_open = 0
        self.own_committed = None
        self.failure = None
        self.record = None  # the CommitRecord holding it, if any (at ``index`` there)
        self.index = 0

    @property
    def value(self):
        record = self.record
        return self.own_value if record is None else record.values[self.index]

    @property
    def open(self) -> int:
        record = self.record
        if record is None:
            return self.own_open
        index = self.index
        return sum(index in e.keys for e in record.entries)

    @property
    def committed(self):
        record = self.record
        if record is None:
            return self.own_committed
        return record.committed[self.index] if self.open else None

    def set(self, value) -> None:
        """An eager write (callers settled the variable first: nothing is open)."""
        if self.record is not None:
            self.record.release(self)
        self.own_value = value

    def detached(self) -> "VariableState":
        """A new state holding this one's value, nothing open or failed (a copy's)."""
        return VariableState(self.value)


def state_of(var):
    """``var``'s state (an array or a ``PerReplica``), open or not, as a step takes it.

    Args:
        var: a variable.

    Returns:
        ``var.variable_state.value``.

    Example:
        >>> import jaxmirror
        >>> float(state_of(jaxmirror.Variable(3.0)))
        3.0
    """
    return var.variable_state.value


class CommitRecord:
    """The variables one call plan captures, and its steps' writes to them, as one tuple.

    A step that captures variables (TF's style) reads them all and writes most of them on
    every call. The record keeps their values as the tuple the step takes (``current``), takes
    the step's new values as one tuple (``write_record``), and commits the whole tuple when a
    step is known good: no work per variable per call. A failed step's writes are rolled back
    index by index. A variable another record holds (a second program capturing it) is read
    through that record, and taken over only when this record's step writes it; a write from
    elsewhere (an eager ``assign``, a variable passed as an argument, a restore) takes the
    variable back (``release``), after the record's open steps that wrote it.

    Args:
        held: the ``VariableState``s of the captured variables, in the step's input order.

    Example:
        >>> import jax.numpy as jnp, jaxmirror
        >>> v = jaxmirror.Variable(1.0)
        >>> record = CommitRecord((v.variable_state,))
        >>> float(record.current()[0])
        1.0
    """

    __slots__ = ("held", "values", "committed", "entries", "valid", "foreign", "__weakref__")

    def __init__(self, held: tuple):
        self.held = held
        self.values = ()
        self.committed = None  # while steps are open: the values before the oldest
        self.entries = collections.deque()  # its open steps (``_RecordWrites``), oldest first
        self.valid = False  # whether ``values`` is current
        self.foreign = False  # whether another record (or open writes of its own) holds one

    def current(self) -> tuple:
        """The variables' current values (open ones included), as the step's input."""
        if not self.valid or self.foreign:
            self._take_all()
        return self.values

    def _take_all(self) -> None:
        old, values, taken, foreign = self.values, [], [], False
        for i, s in enumerate(self.held):
            if s.record is self:
                values.append(old[i])
            elif s.record is not None or s.own_open:  # read through whoever holds it
                values.append(s.value)
                foreign = True
            else:
                values.append(s.own_value)
                taken.append((s, i))
        self.values = tuple(values)  # first: a reader outside the lock sees a whole tuple
        for s, i in taken:
            s.index, s.record = i, self
            s.own_value = s.own_committed = None  # the record holds it now: one copy
        self.valid, self.foreign = True, foreign

    def take_written(self, keys) -> None:
        """Hold the variables at ``keys`` (the step writes them) that another holds now."""
        for i in keys:
            s = self.held[i]
            if s.record is self:
                continue
            if s.record is not None:
                s.record.release(s)  # after that record's open steps that wrote it
            while s.own_open and _open:  # open writes of its own: closed first
                _close_oldest()
            s.index, s.record = i, self
            s.own_value = s.own_committed = None
        self.foreign = any(s.record is not self for s in self.held)

    def release(self, s) -> None:
        """Give ``s`` back its own state, once this record's open steps that wrote it are
        closed (a write from elsewhere follows)."""
        while s.open and _open:
            _close_oldest()
        s.own_value, s.own_open, s.own_committed = self.values[s.index], 0, None
        s.record = None
        self.valid = False

    def release_all(self) -> None:
        """Give every variable it holds back its own state (its plan is gone)."""
        for s in self.held:
            if s.record is self:
                self.release(s)
        if not self.entries:
            self.values = self.committed = None


class _Writes:
    """One dispatched step's writes to variables outside a record: ``[(VariableState, new
    value)]``, and one array of the step that tells when it finished and whether it failed."""

    __slots__ = ("handle", "pairs", "has_outputs", "error", "reported", "tainted")

    def __init__(self, handle, pairs, has_outputs: bool):
        self.handle = handle
        self.pairs = pairs
        self.has_outputs = has_outputs
        self.error = None
        self.reported = False
        self.tainted = []  # once failed: the VariableStates whose ``failure`` it is

    def written(self):
        return (s for s, _ in self.pairs)

    def close(self, failure) -> None:
        """Known: succeeded (``failure`` None) or undone as part of ``failure``."""
        if failure is None:
            for s, new in self.pairs:
                s.own_open -= 1
                # Later open steps build on it; with none, nothing is kept to roll back to.
                s.own_committed = new if s.own_open else None
            return
        for s, new in self.pairs:
            s.own_open -= 1
            if s.own_value is new:  # its latest write: back to the last good state
                s.own_value = s.own_committed
            _taint(s, failure)
            if not s.own_open:
                s.own_committed = None


class _RecordWrites(_Writes):
    """One dispatched step's writes through a ``CommitRecord``: its new values tuple."""

    __slots__ = ("record", "new", "keys")  # keys: the written indices (the writes' dict)

    def __init__(self, handle, record, new: tuple, keys, has_outputs: bool):
        super().__init__(handle, (), has_outputs)
        self.record, self.new, self.keys = record, new, keys

    def written(self):
        held = self.record.held
        return (held[i] for i in self.keys)

    def close(self, failure) -> None:
        record = self.record
        record.entries.popleft()  # the record's oldest: steps close in dispatch order
        if failure is None:
            record.committed = self.new if record.entries else None
            return
        # Undone: each variable it wrote goes back to its value before it, in the values and
        # in the later open steps that carried the write over (those that did not write it).
        before, new = record.committed, self.new
        record.values = _undone(record.values, new, before, self.keys)
        for later in record.entries:
            later.new = _undone(later.new, new, before, self.keys)
        for s in self.written():
            _taint(s, failure)
        if not record.entries:
            record.committed = None


def _undone(values: tuple, failed: tuple, before: tuple, keys) -> tuple:
    """``values`` with each written index still holding the failed step's value set back."""
    values = list(values)
    for i in keys:
        if values[i] is failed[i]:
            values[i] = before[i]
    return tuple(values)


def _taint(s, failure) -> None:
    if s.failure is None:
        s.failure = failure
        failure.tainted.append(s)


# Open steps, oldest first.
_open: collections.deque = collections.deque()
# Records whose plan is gone (weak references): their variables are given back at the next
# poll (a finalizer may run anywhere, even inside this module's own work, so it only queues).
_retired: list = []
# Failures seen and not reported yet, oldest first (``_reported_by_caller`` takes those seen
# while it closes the open steps as its own).
_failures: list = []


def detached_attributes(var) -> dict:
    """``var``'s attributes for a copy of it (copy, pickle): its settled state, nothing open.

    Args:
        var: the variable being copied.

    Returns:
        A new dict of its attributes, whose ``VariableState`` is a new one holding the settled
        value; what is open or failed stays with ``var``.
    """
    settle(var, report=False)
    held = var.variable_state
    return {k: (held.detached() if v is held else v) for k, v in var.__dict__.items()}


def open_steps() -> int:
    """How many dispatched steps' writes are open (for tests and diagnostics).

    Returns:
        An int, at most ``MAX_OPEN``.

    Example:
        >>> settle_all(); open_steps()
        0
    """
    return len(_open)


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
        variables[i].variable_state.set(new)


def write_open(held: tuple, states: dict, has_outputs: bool, single_device: bool = False) -> None:
    """Store a dispatched step's new states, open until the step is known to have succeeded.

    Args:
        held: the ``VariableState``s of the step's variables (passed ones, then captured).
        states: ``{index into held: new state}`` (the step's extra outputs; one of them
            tells when the step finished, and whether it failed).
        has_outputs: whether the step returned values (which then report its failure).
        single_device: the step ran on one device, where it has often finished already (one
            CPU device runs small programs at once): then it is stored as committed.
    """
    handle = _handle_of(states)
    failure = _failure_of(held[i] for i in states)
    if _done_already(handle, failure, single_device):
        for i, new in states.items():
            held[i].set(new)
        return
    pairs = [(held[i], new) for i, new in states.items()]
    for s, new in pairs:
        if s.record is not None:  # a record holds it: take it back (waits for its steps)
            s.record.release(s)
        if not s.own_open:
            s.own_committed = s.own_value
        s.own_open += 1
        s.own_value = new
    _open.append(_Writes(handle, pairs, has_outputs))
    if failure is not None:  # dispatched after a failure on its variables: it fails with it
        _report(failure)


def write_record(record: CommitRecord, states: dict, has_outputs: bool,
                 single_device: bool = False) -> None:
    """Store a dispatched step's new states of a record's variables, open as ``write_open``
    stores them, as one tuple: no work per variable when the step wrote them all.

    Args:
        record: the call plan's ``CommitRecord`` (its ``current()`` was the step's input).
        states: ``{index into record.held: new state}``, in index order.
        has_outputs: whether the step returned values (which then report its failure).
        single_device: as for ``write_open``.
    """
    handle = _handle_of(states)
    failure = None
    if _failures:
        failure = _failure_of(record.held[i] for i in states)
    if record.foreign:  # the step wrote variables another holds: take them first
        record.take_written(states)
    values = record.values
    if len(states) == len(values):  # every variable written (dict keys come sorted)
        new = tuple(states.values())
    else:
        merged = list(values)
        for i, value in states.items():
            merged[i] = value
        new = tuple(merged)
    if _done_already(handle, failure, single_device):
        record.values = new
        return
    if not record.entries:
        record.committed = values
    record.values = new
    writes = _RecordWrites(handle, record, new, states, has_outputs)
    record.entries.append(writes)
    _open.append(writes)
    if failure is not None:  # dispatched after a failure on its variables: it fails with it
        _report(failure)


def _handle_of(states: dict):
    """One array of the step's writes: it tells when the step finished, and whether it failed."""
    handle = next(iter(states.values()))
    return handle.stacked if isinstance(handle, PerReplica) else handle


def _done_already(handle, failure, single_device: bool) -> bool:
    """Whether a step on one device finished already and succeeded (one CPU device runs small
    programs at once): then its writes are stored as committed, with nothing open."""
    if not (single_device and failure is None and not _open and handle.is_ready()):
        return False
    try:
        handle.block_until_ready()
    except Exception:  # noqa: BLE001 - failed: kept open, closed by the next poll
        return False
    return True


def retire(record: CommitRecord) -> None:
    """``record``'s plan is gone: give its variables back (at the next ``poll``), so that it
    keeps none of their arrays alive.

    Args:
        record: the record.
    """
    _retired.append(weakref.ref(record))  # not kept alive here: gone with its variables


def _release_retired() -> None:
    """Give back the variables of every record whose plan is gone (callers hold ``lock``)."""
    while _retired:
        record = _retired.pop()()
        if record is not None:
            record.release_all()


def poll() -> None:
    """Close the oldest open steps that are finished; wait for the oldest past ``MAX_OPEN``.

    Called (under ``lock``) before a step reads its variables, so that a step seen to have
    failed is rolled back before the next one starts from its writes.
    """
    _release_retired()
    while _open and (len(_open) >= MAX_OPEN or _open[0].handle.is_ready()):
        _close_oldest()


def check(held) -> None:
    """Before a step dispatches: raise the unreported failure that one of its variables lost
    writes to (every open step is closed first; see ``settle``), so that no step runs after a
    failure that was not reported yet.

    Args:
        held: the ``VariableState``s of the step's variables (captured and passed ones).

    Raises:
        Exception: that failure's own error, once.
    """
    failure = _failure_of(held)
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
    held = var.variable_state
    if _retired:  # records whose plan is gone: they may hold this one
        with lock:
            _release_retired()
    if held.open:
        with lock:
            while held.open and _open:
                _close_oldest()
    failed = held.failure
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
    return var.variable_state.value


def settle_all() -> None:
    """Wait for every open step and close it (tests and benchmarks start from nothing open)."""
    with lock:
        while _open:
            _close_oldest()
        _release_retired()


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
    failure = _failure_of(writes.written())
    if failure is None and failed:
        failure = writes
        _failures.append(writes)
    writes.close(failure)


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
    for s in failed.tainted:
        if s.failure is failed:
            s.failure = None


def _failure_of(held):
    """The unreported failure that one of ``held`` (VariableStates) lost writes to, or None."""
    if not _failures:  # the usual case, on the hot path: none anywhere
        return None
    for s in held:
        if s.failure is not None:
            return s.failure
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

__all__ = ["MAX_OPEN", "CommitRecord", "VariableState", "check", "detached_attributes", "lock",
           "open_steps", "poll", "retire", "settle", "settle_all", "settled", "state_of",
           "write_back", "write_open", "write_record"]
