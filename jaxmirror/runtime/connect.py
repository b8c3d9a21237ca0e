"""Joining this process to a multi-worker cluster with ``jax.distributed``, within a timeout.

``jax.distributed.initialize`` waits for every process to register; when one never comes it
ends the whole process with a C++ ``abort()`` whose message names no task (measured, jax 0.10).
So the registration runs on a helper thread (with a far deadline of its own) while this thread
waits for the configured timeout: on time-out it raises a ``TimeoutError`` naming the tasks that
never joined. Each non-coordinator task holds a listening socket at its own cluster address
while it lives (as TF's servers listen at theirs), so a task that never started can be told
apart from one that started and did not join.

The chief starts the coordination service in a helper process first (``runtime/service.py``),
so that a dead chief is named like any other worker; once joined, every worker watches the
cluster (``runtime/watch.py``) and reports its own failure (``runtime/failures.py``).
"""

from __future__ import annotations

import atexit
import socket
import sys
import threading
import time

import jax

from jaxmirror.cluster_resolver.cluster_spec import parse_address
from jaxmirror.core import _compat, across_processes
from jaxmirror.runtime import failures, ledger, service, watch

DEFAULT_TIMEOUT = 300  # seconds, as jax.distributed's initialization_timeout
# A worker silent this long is dead: failures are named within about this long, and a live
# worker's heartbeats come from a C++ thread of its own, so a busy worker is never mistaken.
DEFAULT_HEARTBEAT = 10
SHUTDOWN_TIMEOUT = 300  # how long a worker that ended waits for the others at exit
_state = {"layout": None, "presence": None, "exit_registered": False}


def joined():
    """The ``Layout`` this process joined with ``join``, or ``None``."""
    return _state["layout"]


def heartbeat_for(timeout_seconds) -> int:
    """The heartbeat timeout for a collective bound of ``timeout_seconds``.

    Args:
        timeout_seconds: ``CommunicationOptions.timeout_seconds`` (``None``: no bound).

    Returns:
        ``DEFAULT_HEARTBEAT``, or the bound when it is shorter (2 s at least).

    Example:
        >>> heartbeat_for(None), heartbeat_for(4.5), heartbeat_for(1)
        (10, 5, 2)
    """
    if timeout_seconds is None:
        return DEFAULT_HEARTBEAT
    return max(2, min(DEFAULT_HEARTBEAT, int(timeout_seconds + 0.999)))


def join(layout, timeout: float, api: str, heartbeat: int = DEFAULT_HEARTBEAT) -> None:
    """Join the cluster ``layout`` describes, as its process ``layout.process_id``.

    Reuses a ``jax.distributed`` runtime that is already up when it matches ``layout``.

    Args:
        layout: the cluster's ``Layout``.
        timeout: seconds the whole cluster may take to assemble.
        api: the caller, for error messages.
        heartbeat: seconds without heartbeats after which a worker is declared dead.

    Raises:
        RuntimeError: when ``jax.distributed`` is up for another cluster, or JAX's backend has
            already started in this process (the device set is fixed then).
        TimeoutError: when the coordinator cannot be reached, or some tasks do not join,
            within ``timeout`` (the message names them).
    """
    if jax.distributed.is_initialized():
        _check_matches(layout, api)
        _joined(layout, heartbeat)
        return
    if _compat.backend_started():
        raise RuntimeError(
            f"{api}: JAX has already started in this process, so it can no longer join a "
            f"cluster of {layout.num_processes} workers (jax.distributed must start before "
            f"any JAX computation). Create the strategy first thing in the program, before "
            f"other JAX work (in a notebook: restart the kernel; in a function given to "
            f"jaxmirror.launch.run: a jax.Array or flax object it captures starts JAX when the "
            f"worker unpickles it, so capture NumPy arrays or build such objects inside).")
    if jax.config.jax_cpu_collectives_implementation is None:
        # Without an implementation CPU collectives cannot cross processes at all.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    deadline = time.monotonic() + timeout
    if layout.is_chief:
        service.start(layout.coordinator.address, layout.num_processes, heartbeat,
                      SHUTDOWN_TIMEOUT, linger_s=watch.silent_limit(heartbeat) + 15.0)
    else:
        _hold_presence(layout.me.address)
        _wait_for_coordinator(layout, deadline, timeout, api)
    outcome = {}
    thread = threading.Thread(target=_register, args=(layout, heartbeat, outcome),
                              name="jaxmirror-join", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive():
        failures.mark_failed()  # the registration thread cannot be stopped: exit promptly
        raise TimeoutError(_missing_message(layout, timeout, api))
    if "error" in outcome:
        failures.mark_failed()
        raise RuntimeError(f"{api}: joining the cluster as {layout.me} failed: "
                           f"{outcome['error']}") from outcome["error"]
    _joined(layout, heartbeat)


def _joined(layout, heartbeat: int) -> None:
    _state["layout"] = layout
    failures.set_heartbeat(heartbeat)
    failures.install(layout)
    # Values placed on every worker's devices are agreed first (core/across_processes.py).
    across_processes.agree_with(_agree_on_value)
    if _state["presence"] is not None:  # the others may probe it (runtime/watch.py)
        _compat.kv_set(_compat.distributed_client(), f"{watch.PRESENCE_PREFIX}"
                       f"{layout.process_id}", "1", overwrite=True)
    watch.start(layout)
    if not _state["exit_registered"]:
        atexit.register(_at_exit)
        _state["exit_registered"] = True


def _agree_on_value(description: str, digest: str) -> list:
    return ledger.agree(description, payload=digest)


def _at_exit() -> None:
    if failures.failed():
        failures.exit_failed()  # the others know, and stop too
    if _state["layout"] is not None:
        leave()  # before the interpreter's teardown, which would disconnect in any order


def _finish(layout) -> None:
    """This worker's program ended: once its last programs have run, say so, wait (watching)
    until every worker's has ended too, then stop the watch: everyone may disconnect now, and
    the service go. A worker not ended ``SHUTDOWN_TIMEOUT`` seconds later is left behind (it
    sees this one as ended, not dead)."""
    watch.wait_for_dispatched()  # the others may still need this worker in them
    failures.ended(layout.process_id)
    client = _compat.distributed_client()
    deadline = time.monotonic() + SHUTDOWN_TIMEOUT
    with failures.waiting():
        for process, task in enumerate(layout.tasks):
            while (process != layout.process_id and time.monotonic() < deadline
                   and _compat.kv_get(client, f"{failures.ENDED_PREFIX}{process}", 500) is None):
                found = failures.ending()
                if found is not None:
                    failures.exit_with(*found)
            if process != layout.process_id and time.monotonic() >= deadline:
                print(f"jaxmirror: {task} has not ended its program {SHUTDOWN_TIMEOUT} s after "
                      f"this worker, {layout.me}, ended its own; leaving without waiting more.",
                      file=sys.stderr, flush=True)
                break
    watch.stop()


def leave() -> None:
    """Shut the runtime down cleanly (every worker calls it, ``experimental_finalize`` and at
    exit): wait until every worker's program has ended, disconnect, stop the chief's service
    helper, close the presence socket."""
    layout = _state["layout"]
    if layout is not None:
        _finish(layout)
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()
    service.stop()
    presence, _state["presence"] = _state["presence"], None
    if presence is not None:
        presence.close()
    failures.left()
    across_processes.agree_with(None)
    _state["layout"] = None


def _register(layout, heartbeat: int, outcome: dict) -> None:
    try:
        _compat.initialize_distributed(
            layout.coordinator.address, layout.num_processes, layout.process_id,
            heartbeat_s=heartbeat, shutdown_s=SHUTDOWN_TIMEOUT, start_service=False)
    except Exception as error:  # noqa: BLE001 - handed to the waiting thread, which raises
        outcome["error"] = error


def _check_matches(layout, api: str) -> None:
    have = (jax.process_index(), jax.process_count())
    want = (layout.process_id, layout.num_processes)
    if have != want:
        raise RuntimeError(
            f"{api}: jax.distributed is already initialized as process {have[0]} of {have[1]}, "
            f"but the cluster resolver makes this task ({layout.me}) process {want[0]} of "
            f"{want[1]}; make TF_CONFIG (or the resolver) match, or do not call "
            f"jax.distributed.initialize yourself.")
    address = _compat.distributed_coordinator_address()
    if address is not None and address != layout.coordinator.address:
        raise RuntimeError(
            f"{api}: jax.distributed is already initialized with coordinator {address!r}, but "
            f"the cluster's coordinator is {layout.coordinator} ; make them match.")


def _hold_presence(address: str) -> None:
    """Listen at this task's own address; best effort (a busy port only loses the hint). A
    thread accepts and closes the other workers' probes (``runtime/watch.py``), so that they
    never fill the queue of connections waiting."""
    if _state["presence"] is not None:
        return
    host, port = parse_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("::" if family == socket.AF_INET6 else "", port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        return
    _state["presence"] = sock
    threading.Thread(target=_answer_probes, args=(sock,), name="jaxmirror-presence",
                     daemon=True).start()


def _answer_probes(sock) -> None:
    while True:
        try:
            connection, _ = sock.accept()
        except OSError:
            return  # closed (leave)
        connection.close()


def _wait_for_coordinator(layout, deadline: float, timeout: float, api: str) -> None:
    while not failures.address_answers(layout.coordinator.address):
        if time.monotonic() >= deadline:
            failures.mark_failed()
            raise TimeoutError(
                f"{api}: could not reach the coordinator, {layout.coordinator} (process 0 of "
                f"{layout.num_processes}), within {timeout:g} s: nothing listens at its "
                f"address. Start that task, check the address in TF_CONFIG, or raise "
                f"CommunicationOptions(timeout_seconds=...).")
        time.sleep(0.2)


def _missing_message(layout, timeout: float, api: str) -> str:
    others = layout.others
    silent = [t for t in others if not failures.address_answers(t.address)]
    lines = [f"{api}: the cluster of {layout.num_processes} workers did not assemble within "
             f"{timeout:g} s (this task: {layout.me})."]
    if silent:
        lines.append("Never started, or not reachable (nothing listens at the address): "
                     + ", ".join(str(t) for t in silent) + ".")
    waiting = [t for t in others if t not in silent]
    if waiting and not silent:
        lines.append("Every task's address answers, so some started but did not join in "
                     "time: " + ", ".join(str(t) for t in waiting) + ".")
    lines.append("Start every task of TF_CONFIG's cluster with this program, or raise "
                 "CommunicationOptions(timeout_seconds=...).")
    return " ".join(lines)
