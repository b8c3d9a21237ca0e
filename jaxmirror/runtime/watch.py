"""The failure watch: a thread in every joined worker that notices when the cluster breaks.

About once a second it looks at

- the cluster's failure record (``failures``): another worker's program raised;
- the coordination service's live processes: a worker that stopped sending heartbeats (killed,
  crashed, its machine gone) is dead after the heartbeat timeout (10 s by default); the
  service runs in a helper process of the chief (``runtime/service.py``), so this holds for
  the chief too, and a service that does not answer means the chief's machine is gone;
- this worker's own cross-worker programs (``dispatched``, one record per program call): the
  oldest one not finished is published once it has run ``STALL_S`` seconds (``activity``), so
  a worker waiting for this one in a call that every worker must make (``runtime/ledger.py``)
  can see that this one waits in a program it never called; and it ends the worker with
  ``errors.DeadlineExceededError`` past ``CommunicationOptions(timeout_seconds)``, or with
  ``errors.CollectiveMismatchError`` when a worker it waits for has ended its program.

Any of these ends this worker (``failures.end_for``) with a message naming the worker and the
call. The cost per step is one ``deque.append`` in the worker's main thread; the watch's own
requests go to the service once a second from its thread.
"""

from __future__ import annotations

import collections
import json
import threading
import time

from jaxmirror.core import _compat, errors
from jaxmirror.runtime import failures

STALL_S = 2.0  # a program running this long is published as what this worker waits in
ACTIVITY_PREFIX = "jaxmirror/activity/"
_POLL_MS = 500
_UNWIND_S = 30.0
_pending: collections.deque = collections.deque()  # (seq, name, array, dispatched at)
_state = {"count": 0, "layout": None, "thread": None, "timeout": None, "leaving": False,
          "published": None, "done_at": 0.0, "entering": None}


def entering(name: str) -> None:
    """This worker's main thread starts a call of a cross-worker program (it may run inside
    the call: with one device per process the CPU runtime does).

    Args:
        name: the program's name.
    """
    _state["entering"] = (name, time.monotonic())


def left() -> None:
    """The call ``entering`` announced returned (dispatched, or raised)."""
    _state["entering"] = None


def dispatched(name: str, array) -> None:
    """Record that this worker's main thread just dispatched a cross-worker program.

    Args:
        name: the program's name (a step's function name, ``strategy.reduce``...).
        array: one of its outputs (all become ready together), or ``None``.
    """
    _state["count"] += 1
    if array is not None:
        _pending.append((_state["count"], name, array, time.monotonic()))


def dispatched_count() -> int:
    """How many cross-worker programs this worker has dispatched."""
    return _state["count"]


def set_timeout(seconds) -> None:
    """Bound every cross-worker program by ``seconds`` (``None``: no bound, TF's default).

    Args:
        seconds: a positive number or ``None``.
    """
    _state["timeout"] = seconds


def timeout():
    """The bound of ``set_timeout`` (``None`` when there is none)."""
    return _state["timeout"]


def start(layout) -> None:
    """Start the watch thread for this joined worker (once per process).

    Args:
        layout: the cluster's ``Layout``.
    """
    _state["layout"] = layout
    _state["leaving"] = False
    thread = _state["thread"]
    if thread is not None and thread.is_alive():
        return
    thread = threading.Thread(target=_run, name="jaxmirror-watch", daemon=True)
    _state["thread"] = thread
    thread.start()


def leaving() -> None:
    """The cluster is shutting down on purpose: the service may stop answering from now on."""
    _state["leaving"] = True


def stop() -> None:
    """Stop the watch thread (every worker has ended its program); waits for it."""
    _state["leaving"] = True
    thread = _state["thread"]
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=5.0)
    _state["thread"] = None


def peer_activity(client, process: int):
    """What worker ``process`` published it waits in: ``(seq, name)`` or ``None``.

    Args:
        client: the distributed client.
        process: the worker's process index.

    Returns:
        ``(seq, program name)`` of its oldest program running ``STALL_S`` or more, or ``None``.
    """
    try:
        record = json.loads(client.key_value_try_get(f"{ACTIVITY_PREFIX}{process}"))
    except Exception:  # noqa: BLE001 - NOT_FOUND: nothing published
        return None
    if record.get("seq") is None:
        return None
    return record["seq"], record["name"]


def _run() -> None:
    _watch()
    found = failures.ending()
    if found is not None and not _state["leaving"]:
        # One of jaxmirror's waits in the main thread raised it: the program has this long to
        # end (its own error handling exits at once) before the process is ended.
        time.sleep(_UNWIND_S)
        failures.exit_with(*found)


def _watch() -> None:
    layout = _state["layout"]
    client = _compat.distributed_client()
    while failures.ending() is None and not _state["leaving"]:
        try:
            found = failures.reported(client, _POLL_MS)
            if found is not None:
                failures.end_for(errors.UnavailableError, failures.error_text(found, layout.me))
                return
            gone = set(range(layout.num_processes)) - _compat.live_processes(
                client, layout.num_processes)
            if gone:
                _dead(layout, sorted(gone))
                return
            _check_programs(layout, client)
        except Exception as error:  # noqa: BLE001 - the service did not answer
            if _state["leaving"] or _compat.distributed_client() is not client:
                return  # shut down on purpose
            time.sleep(1.0)  # one failed request is not yet a lost service
            try:
                _compat.live_processes(client, layout.num_processes)
            except Exception:  # noqa: BLE001 - it is gone
                if _state["leaving"]:
                    return
                text = (f"the cluster's coordination service at {layout.coordinator.address} "
                        f"no longer answers ({str(error).splitlines()[0][:200]}): the chief, "
                        f"{layout.coordinator}, or its machine is gone")
                failures.report(text)
                failures.end_for(errors.UnavailableError, failures.error_text(text, layout.me))
                return


def _dead(layout, gone: list) -> None:
    names = ", ".join(str(layout.tasks[i]) for i in gone)
    text = (f"{names} stopped: the coordination service got no heartbeat from it for "
            f"{failures.heartbeat():g} s (killed, crashed, or its machine is gone)")
    failures.report(text)
    failures.end_for(errors.UnavailableError, failures.error_text(text, layout.me))


def _check_programs(layout, client) -> None:
    now = time.monotonic()
    while _pending:
        seq, name, array, at = _pending[0]
        try:
            finished = array.is_deleted() or array.is_ready()
        except Exception:  # noqa: BLE001 - a failed program is finished too
            finished = True
        if not finished:
            break
        _pending.popleft()
        _state["done_at"] = now
    if _pending:
        seq, name, _, at = _pending[0]
        at = max(at, _state["done_at"])
    elif _state["entering"] is not None:  # a call not dispatched yet: it runs inside
        (name, at), seq = _state["entering"], _state["count"] + 1
    else:
        _publish(client, layout, None)
        return
    running = now - at
    if running < STALL_S:
        return
    _publish(client, layout, (seq, name))
    limit = _state["timeout"]
    call = f"`{name}` (this worker's cross-worker call {seq})"
    if limit is not None and running > limit:
        text = (f"{layout.me}: {call} did not finish within {limit:g} s "
                f"(CommunicationOptions(timeout_seconds={limit:g})); a worker is slow, stuck, "
                f"or does not make the same call")
        failures.report(text)
        failures.end_for(errors.DeadlineExceededError, text + ".")
        return
    done = [t for i, t in enumerate(layout.tasks)
            if i != layout.process_id and failures.has_ended(client, i)]
    if done:
        text = (f"{layout.me} waits in {call}, but {', '.join(map(str, done))} ended its "
                f"program: every worker must make the same calls that communicate between "
                f"workers (steps, strategy.reduce/gather, metric results, checkpoint.save/"
                f"restore, iterating a distributed dataset), in the same order")
        failures.report(text)
        failures.end_for(errors.CollectiveMismatchError, text + ".")


def _publish(client, layout, what) -> None:
    """Tell the others what this worker waits in (only when it changes)."""
    if what == _state["published"]:
        return
    _state["published"] = what
    record = {"seq": None} if what is None else {"seq": what[0], "name": what[1]}
    client.key_value_set(f"{ACTIVITY_PREFIX}{layout.process_id}", json.dumps(record),
                         allow_overwrite=True)
