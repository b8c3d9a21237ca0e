"""The ledger: workers agree, call by call, on the calls that every worker must make.

A call that communicates between workers (the first run of a compiled step, an eager
``strategy.reduce``/``gather``, a metric's ``result()``, ``checkpoint.save``/``restore``, a new
pass over a distributed dataset, a value placed on every worker's devices) must be made by every
worker, in the same order, with the same shapes: XLA pairs the workers' collectives by order
alone, so otherwise a worker's sum is silently paired with another call's, or the workers hang.
Before such a call, each worker writes its n-th entry (``call``, ``detail``) to the coordination
service's key-value store and reads the others' n-th (``agree``); only when they all match does
the call go ahead. A difference raises ``errors.CollectiveMismatchError`` on every worker,
naming both calls.

While it waits for a worker, ``agree`` looks every half second at whether that worker

- failed, or died (``runtime/failures.py``, ``runtime/watch.py``): ``errors.UnavailableError``;
- ended its program: ``errors.CollectiveMismatchError`` (this call was made on some workers
  only: TF's print-on-the-chief habit around a call that communicates);
- waits in a program this worker never dispatched (``watch.peer_activity``): it runs a step
  while this worker is here, so neither can go on: ``errors.CollectiveMismatchError``;
- is past ``CommunicationOptions(timeout_seconds)``: ``errors.DeadlineExceededError``.

A worker busy with its own work is waited for (without a timeout set, for as long as it takes,
as TF waits in a collective). Compiled steps run without an entry once compiled: their first
run is agreed (input shapes and the program's fingerprint), then they cost nothing per step.

Example:
    >>> agree("doc", "one process: nothing to agree with", payload=3)
    [3]
"""

from __future__ import annotations

import contextlib
import json
import time

from jaxmirror.core import _compat, errors
from jaxmirror.runtime import failures, watch

PREFIX = "jaxmirror/ledger/"
_SLICE_MS = 500
_state = {"round": 0, "name": None}
# What every worker must call the same way: for the messages.
SAME_CALLS = ("steps, strategy.reduce/gather, metric results, checkpoint.save/restore and "
              "iterating a distributed dataset")
_TODO = ("make the call on every worker, in the same order (TF requires it too); to print or "
         "write on one worker, test `strategy.extended.should_checkpoint` around the print, not "
         "the call")


def active() -> bool:
    """Whether this process is one worker of several (agreement is needed)."""
    return failures.joined() is not None


@contextlib.contextmanager
def named(call: str):
    """Inside, ``agree`` names its calls ``call`` (the API the user called: a metric's
    ``result()`` reads several variables, each agreed as ``call``); the outermost name wins.

    Args:
        call: the user's call, e.g. ``"SparseCategoricalAccuracy.result()"``.
    """
    outer = _state["name"]
    if outer is None:
        _state["name"] = call
    try:
        yield
    finally:
        _state["name"] = outer


def agree(call: str, detail: str = "", payload=None) -> list:
    """Agree with every worker that this is the call each makes next; their payloads.

    Args:
        call: what is called, as the user wrote it (``"strategy.reduce"``, ``"step train"``).
        detail: what must match too (shapes, a fingerprint); shown when it differs.
        payload: a JSON-serializable value to hand to the others.

    Returns:
        Every worker's ``payload``, in process order (``[payload]`` in one process).

    Raises:
        errors.CollectiveMismatchError: a worker made another call here, or never will.
        errors.UnavailableError: a worker failed or is gone.
        errors.DeadlineExceededError: past ``CommunicationOptions(timeout_seconds)``.
    """
    layout = failures.joined()
    if layout is None:
        return [payload]
    client = _compat.distributed_client()
    failures.check_not_ending(client)
    if _state["name"] is not None and _state["name"] != call:
        call, detail = _state["name"], f"{call} {detail}".strip()
    with failures.waiting():  # a failure found meanwhile is raised here, not into this code
        entries = _entries(client, layout, call, detail, payload)
    return [entries[p]["payload"] for p in range(layout.num_processes)]


def _entries(client, layout, call: str, detail: str, payload) -> dict:
    """Every worker's entry of this round, checked to match this worker's."""
    number = _state["round"]
    _state["round"] += 1
    mine = {"call": call, "detail": detail, "payload": payload}
    _compat.kv_set(client, f"{PREFIX}{number}/{layout.process_id}", json.dumps(mine))
    entries = {layout.process_id: mine}
    for process in range(layout.num_processes):
        if process != layout.process_id:
            text = wait_for_peer(client, f"{PREFIX}{number}/{process}", layout, process, call,
                                 deadlock=True)
            entries[process] = json.loads(text)
    for process, theirs in entries.items():
        if (theirs["call"], theirs["detail"]) != (call, detail):
            raise failures.fail_here(errors.CollectiveMismatchError,
                                     _mismatch(layout, number, mine, process, theirs))
    failures.check_not_ending(client)
    if number >= 2:  # every worker has read round number - 2: drop this worker's entry
        _compat.kv_delete(client, f"{PREFIX}{number - 2}/{layout.process_id}")
    return entries


def wait_for_peer(client, key: str, layout, process: int, call: str, deadlock: bool = False,
                  cancelled=None, record: bool = True):
    """The value worker ``process`` writes at ``key``, waited for in half-second slices that
    check the cluster between them (see the module's docstring).

    Args:
        client: the distributed client.
        key: the key the worker writes.
        layout: the cluster's ``Layout``.
        process: the worker waited for.
        call: this worker's call, for messages (``"strategy.reduce"``).
        deadlock: whether the worker's waiting in a program this one has not dispatched
            means neither can go on (the ledger's calls; not per-step exchanges, which run
            beside the steps).
        cancelled: a function returning True when the wait is no longer wanted.
        record: whether an error found here goes into the cluster's failure record (the
            ledger's, which every worker waits for); a prefetch thread's exchange raises its
            errors to whoever takes the batch instead.

    Returns:
        The value, or ``None`` when ``cancelled`` (or when this worker left the cluster while a
        cancellable wait ran).

    Raises:
        As ``agree``.
    """
    task = layout.tasks[process]
    limit = watch.timeout()
    start = time.monotonic()
    shown = call if "`" in call else f"`{call}`"

    def fail(error_class, message):
        return failures.fail_here(error_class, message) if record else error_class(message)

    with failures.waiting():
        while True:
            value = _compat.kv_get(client, key, _SLICE_MS)
            if value is not None:
                return value
            failures.check_not_ending(client)
            if cancelled is not None and cancelled():
                return None
            if _compat.distributed_client() is not client:  # left the cluster meanwhile
                if cancelled is not None:
                    return None
                raise RuntimeError(f"{call}: this worker, {layout.me}, left the cluster "
                                   f"(experimental_finalize) while it waited for {task}; make "
                                   f"every call between workers before leaving.")
            if failures.has_ended(client, process):
                raise fail(errors.CollectiveMismatchError, (
                    f"{call}: {task} ended its program without making this call, which "
                    f"{layout.me} made ({shown}): {SAME_CALLS} communicate between workers; "
                    f"{_TODO}."))
            if deadlock:
                activity = watch.peer_activity(client, process)
                if activity is not None and activity[0] > watch.dispatched_count():
                    raise fail(errors.CollectiveMismatchError, (
                        f"{call}: {layout.me} made this call ({shown}), but {task} is running "
                        f"`{activity[1]}` (its cross-worker call {activity[0]}), which "
                        f"{layout.me} never called there, so neither can go on: {SAME_CALLS} "
                        f"communicate between workers; {_TODO}."))
            if limit is not None and time.monotonic() - start > limit:
                raise fail(errors.DeadlineExceededError, (
                    f"{call}: {layout.me} waited {limit:g} s "
                    f"(CommunicationOptions(timeout_seconds={limit:g})) for {task} to make this "
                    f"call ({shown}); it is slow, stuck, or does not make that call: make it on "
                    f"every worker, or raise timeout_seconds."))


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _mismatch(layout, number: int, mine: dict, process: int, theirs: dict) -> str:
    task = layout.tasks[process]
    if theirs["call"] == mine["call"] and mine["call"].startswith("step "):
        return (f"{mine['call']}: {task} runs a different step from {layout.me}: with "
                f"{theirs['detail']} on {task}, with {mine['detail']} on {layout.me}; every "
                f"worker must run the same program with the same input shapes (TF requires it "
                f"too), or a sum across workers is paired with another program's: give every "
                f"worker the same step and batch shapes.")
    there = f"{theirs['call']}" + (f" ({theirs['detail']})" if theirs["detail"] else "")
    here = f"{mine['call']}" + (f" ({mine['detail']})" if mine["detail"] else "")
    return (f"{mine['call']}: {layout.me} made `{here}` as its {_ordinal(number + 1)} call "
            f"that communicates between workers, but {task} made `{there}` there: "
            f"{SAME_CALLS} communicate between workers, so every worker must make them with "
            f"the same shapes; {_TODO}.")
