"""The failure watch: a thread in every joined worker that notices when the cluster breaks.

About twice a second it looks at

- the cluster's failure record (``failures``): another worker's program raised, or another
  worker found the cluster broken;
- the other workers' lives: each watch writes a tick to the coordination service every loop; a
  worker whose ticks stop for ``heartbeat + 5`` seconds (15 s by default) is dead, and a worker
  other than the chief whose address (its presence socket) stops accepting connections is dead
  at once. (JAX's own heartbeats cannot be asked about without waiting for every worker: its
  ``get_live_nodes`` is a barrier.) The coordination service runs in a helper process of the
  chief (``runtime/service.py``), so this holds for the chief too;
- this worker's own cross-worker calls (``entering``/``dispatched``: a record per call): the
  oldest one not finished is published once it has run ``STALL_S`` seconds (``activity``), so a
  worker waiting for this one in a call that every worker must make (``runtime/ledger.py``)
  can see that this one waits in a program it never called; and it ends the worker with
  ``errors.DeadlineExceededError`` past ``CommunicationOptions(timeout_seconds)`` (a call that
  traced and compiled its program is not bounded: compiling may take long), or with
  ``errors.CollectiveMismatchError`` when a worker it waits for has ended its program.

Any of these ends this worker (``failures.end_for``) with a message naming the worker and the
call. The cost per step is a ``deque.append`` and two attribute writes in the worker's main
thread; the watch's own requests go to the service from its thread.
"""

from __future__ import annotations

import collections
import json
import socket
import threading
import time

from jaxmirror.core import _compat, errors
from jaxmirror.runtime import failures

STALL_S = 2.0  # a program running this long is published as what this worker waits in
ACTIVITY_PREFIX = "jaxmirror/activity/"
ALIVE_PREFIX = "jaxmirror/alive/"
PRESENCE_PREFIX = "jaxmirror/presence/"  # a worker's presence socket listens (runtime/connect)
_POLL_MS = 500
_UNWIND_S = 30.0
_pending: collections.deque = collections.deque()  # (seq, name, array, dispatched at)
_state = {"count": 0, "layout": None, "thread": None, "timeout": None, "leaving": False,
          "published": None, "done_at": 0.0, "entering": None, "tracing": None}


def silent_limit(heartbeat: float) -> float:
    """How long a worker's ticks may stop before it counts as dead (seconds): the heartbeat
    timeout and 5 s (a worker's Python may be held up that long by a long call into C).

    Args:
        heartbeat: the heartbeat timeout.

    Returns:
        Seconds.
    """
    return heartbeat + 5.0


def entering(name: str) -> None:
    """This worker's main thread starts a call of a cross-worker program (it may run inside
    the call: with one device per process the CPU runtime does).

    Args:
        name: the program's name.
    """
    _state["entering"] = (name, time.monotonic(), False)


def tracing(name) -> None:
    """The call ``entering`` announced traces (and will compile) its program now (``name``), or
    has finished tracing (``None``): a worker tracing is not waiting for the others, and the
    call is not bounded by ``timeout_seconds`` (compiling may take long).

    Args:
        name: the program's name, or ``None``.
    """
    _state["tracing"] = name
    current = _state["entering"]
    if name is None and current is not None:
        _state["entering"] = (current[0], time.monotonic(), True)


def left() -> None:
    """The call ``entering`` announced returned (dispatched, or raised)."""
    _state["entering"] = None
    _state["tracing"] = None


def dispatched(name: str, array) -> None:
    """Record that this worker's main thread just dispatched a cross-worker program.

    Args:
        name: the program's name (a step's function name).
        array: one of its outputs (all become ready together), or ``None``.
    """
    _state["count"] += 1
    if array is not None:
        _pending.append((_state["count"], name, array, time.monotonic()))


def dispatched_count() -> int:
    """How many cross-worker programs this worker has dispatched."""
    return _state["count"]


def wait_for_dispatched() -> None:
    """Wait until this worker's dispatched programs have finished (a failed one counts as
    finished: its error is its caller's)."""
    for _, _, array, _ in list(_pending):
        try:
            if not array.is_deleted():
                array.block_until_ready()
        except Exception:  # noqa: BLE001 - see the docstring
            pass


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
        ``(seq, program name)`` of its oldest call running ``STALL_S`` or more (not tracing),
        or ``None``.
    """
    text = _compat.kv_try_get(client, f"{ACTIVITY_PREFIX}{process}")
    if text is None:
        return None
    record = json.loads(text)
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


class _Lives:
    """The other workers' ticks, and when each last changed (this worker's clock)."""

    def __init__(self, layout):
        self.layout = layout
        now = time.monotonic()
        self.seen = {p: (None, now) for p in range(layout.num_processes)
                     if p != layout.process_id}
        self.tick = 0
        self.unreachable = {}  # process -> consecutive probes that timed out
        self.listens = {}  # process -> whether it holds a presence socket

    def beat(self, client) -> None:
        self.tick += 1
        _compat.kv_set(client, f"{ALIVE_PREFIX}{self.layout.process_id}", str(self.tick),
                       overwrite=True)

    def dead(self, client) -> list:
        """The other workers that are gone (those that ended their program never are)."""
        now, limit, gone = time.monotonic(), silent_limit(failures.heartbeat()), []
        for process, (last, since) in self.seen.items():
            if failures.has_ended(client, process):
                continue
            tick = _compat.kv_try_get(client, f"{ALIVE_PREFIX}{process}")
            if tick != last:
                self.seen[process] = (tick, now)
            elif now - since > limit:
                gone.append((process, f"sent no sign of life for {limit:g} s"))
                continue
            if process != 0 and not self._answers(client, process):
                gone.append((process, "its address no longer answers"))
        return gone

    def _answers(self, client, process: int) -> bool:
        # A process that died refuses at once; a machine that is gone times out (3 in a row).
        # Only a worker that said it listens there (its port may have been taken) is asked.
        if not self.listens.get(process):
            self.listens[process] = (
                _compat.kv_try_get(client, f"{PRESENCE_PREFIX}{process}") is not None)
        if not self.listens[process]:
            return True
        host, port = self.layout.tasks[process].address.rsplit(":", 1)
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2.0):
                self.unreachable.pop(process, None)
                return True
        except ConnectionRefusedError:
            return False
        except OSError:
            self.unreachable[process] = self.unreachable.get(process, 0) + 1
            return self.unreachable[process] < 3


def _watch() -> None:
    layout = _state["layout"]
    client = _compat.distributed_client()
    lives = _Lives(layout)
    failures_in_a_row = 0
    while failures.ending() is None and not _state["leaving"]:
        try:
            lives.beat(client)
            failures_in_a_row = 0
        except Exception as error:  # noqa: BLE001 - the service did not answer
            if _state["leaving"] or _compat.distributed_client() is not client:
                return  # shut down on purpose
            failures_in_a_row += 1
            if failures_in_a_row < 3:
                time.sleep(0.5)
                continue
            text = (f"the cluster's coordination service at {layout.coordinator.address} no "
                    f"longer answers ({str(error).splitlines()[0][:200]}): the chief, "
                    f"{layout.coordinator}, or its machine is gone")
            failures.end_for(errors.UnavailableError, failures.error_text(text, layout.me))
            return
        found = failures.reported(client, _POLL_MS)
        if found is not None:
            failures.end_for(*found)
            return
        gone = lives.dead(client)
        if gone and not _state["leaving"]:
            found = failures.reported(client)  # a worker that raised, then exited
            if found is not None:
                failures.end_for(*found)
                return
            _dead(layout, gone)
            return
        _check_programs(layout, client)


def _dead(layout, gone: list) -> None:
    names = "; ".join(f"{layout.tasks[p]} stopped ({why}: killed, crashed, or its machine is "
                      f"gone)" for p, why in gone)
    failures.report(names)
    failures.end_for(errors.UnavailableError, failures.error_text(names, layout.me))


def _check_programs(layout, client) -> None:
    now = time.monotonic()
    while _pending:
        _, _, array, _ = _pending[0]
        try:
            finished = array.is_deleted() or array.is_ready()
        except Exception:  # noqa: BLE001 - a failed program is finished too
            finished = True
        if not finished:
            break
        _pending.popleft()
        _state["done_at"] = now
    bounded = True
    if _pending:
        seq, name, _, at = _pending[0]
        at = max(at, _state["done_at"])
    elif _state["entering"] is not None and _state["tracing"] is None:
        # A call not dispatched yet: it runs inside (one device per process), or compiles.
        (name, at, compiled), seq = _state["entering"], _state["count"] + 1
        bounded = not compiled
    else:
        _publish(client, layout, None)
        return
    running = now - at
    if running < STALL_S:
        return
    _publish(client, layout, (seq, name))
    limit = _state["timeout"]
    call = f"`{name}` (this worker's cross-worker call {seq})"
    if bounded and limit is not None and running > limit:
        elsewhere = [str(t) for i, t in enumerate(layout.tasks) if i != layout.process_id
                     and (peer_activity(client, i) or (None,))[0] != seq]
        who = (f"{', '.join(elsewhere)} {'is' if len(elsewhere) == 1 else 'are'} not in it "
               f"(busy, slow, or making another call)" if elsewhere
               else "every worker waits in it")
        text = (f"MultiWorkerMirroredStrategy: {call} on {layout.me} did not finish within "
                f"{limit:g} s (CommunicationOptions(timeout_seconds={limit:g})): {who}; make "
                f"every call on every worker, or raise timeout_seconds")
        failures.report(text, errors.DeadlineExceededError)
        failures.end_for(errors.DeadlineExceededError, text + ".")
        return
    done = [t for i, t in enumerate(layout.tasks)
            if i != layout.process_id and failures.has_ended(client, i)]
    if done:
        text = (f"MultiWorkerMirroredStrategy: {layout.me} waits in {call}, but "
                f"{', '.join(map(str, done))} ended its program without making that call; every "
                f"worker must make the same calls that communicate between workers (steps, "
                f"strategy.reduce/gather, metric results, checkpoint.save/restore, iterating a "
                f"distributed dataset), in the same order")
        failures.report(text, errors.CollectiveMismatchError)
        failures.end_for(errors.CollectiveMismatchError, text + ".")


def _publish(client, layout, what) -> None:
    """Tell the others what this worker waits in (only when it changes)."""
    if what == _state["published"]:
        return
    _state["published"] = what
    record = {"seq": None} if what is None else {"seq": what[0], "name": what[1]}
    _compat.kv_set(client, f"{ACTIVITY_PREFIX}{layout.process_id}", json.dumps(record),
                   overwrite=True)
