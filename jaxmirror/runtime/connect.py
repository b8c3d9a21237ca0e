"""Joining this process to a multi-worker cluster with ``jax.distributed``, within a timeout.

``jax.distributed.initialize`` waits for every process to register; when one never comes it
ends the whole process with a C++ ``abort()`` whose message names no task (measured, jax 0.10).
So the registration runs on a helper thread (with a far deadline of its own) while this thread
waits for the configured timeout: on time-out it raises a ``TimeoutError`` naming the tasks that
never joined. Each non-coordinator task holds a listening socket at its own cluster address
while it lives (as TF's servers listen at theirs), so a task that never started can be told
apart from one that started and did not join.
"""

from __future__ import annotations

import socket
import threading
import time

import jax

from jaxmirror.cluster_resolver.cluster_spec import parse_address
from jaxmirror.core import _compat
from jaxmirror.runtime import failures

DEFAULT_TIMEOUT = 300  # seconds, as jax.distributed's initialization_timeout
_FAR_DEADLINE = 24 * 3600  # the registration thread's own: ours decides first
_state = {"layout": None, "presence": None}


def joined():
    """The ``Layout`` this process joined with ``join``, or ``None``."""
    return _state["layout"]


def join(layout, timeout: float, api: str) -> None:
    """Join the cluster ``layout`` describes, as its process ``layout.process_id``.

    Reuses a ``jax.distributed`` runtime that is already up when it matches ``layout``.

    Args:
        layout: the cluster's ``Layout``.
        timeout: seconds the whole cluster may take to assemble (also the heartbeat timeout:
            a worker silent that long is declared dead).
        api: the caller, for error messages.

    Raises:
        RuntimeError: when ``jax.distributed`` is up for another cluster, or JAX's backend has
            already started in this process (the device set is fixed then).
        TimeoutError: when the coordinator cannot be reached, or some tasks do not join,
            within ``timeout`` (the message names them).
    """
    if jax.distributed.is_initialized():
        _check_matches(layout, api)
        _state["layout"] = layout
        failures.install(layout)
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
    if not layout.is_chief:
        _hold_presence(layout.me.address)
        _wait_for_coordinator(layout, deadline, timeout, api)
    outcome = {}
    thread = threading.Thread(target=_register, args=(layout, timeout, outcome),
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
    _state["layout"] = layout
    failures.install(layout)


def leave() -> None:
    """Shut the runtime down cleanly (every worker calls it) and close the presence socket."""
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()
    presence, _state["presence"] = _state["presence"], None
    if presence is not None:
        presence.close()
    _state["layout"] = None


def _register(layout, timeout: float, outcome: dict) -> None:
    try:
        jax.distributed.initialize(
            coordinator_address=layout.coordinator.address,
            num_processes=layout.num_processes, process_id=layout.process_id,
            cluster_detection_method="deactivate",
            initialization_timeout=_FAR_DEADLINE,
            heartbeat_timeout_seconds=max(1, int(timeout)))
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
    """Listen at this task's own address; best effort (a busy port only loses the hint)."""
    if _state["presence"] is not None:
        return
    host, port = parse_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("::" if family == socket.AF_INET6 else "", port))
        sock.listen(64)
    except OSError:
        sock.close()
        return
    _state["presence"] = sock


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
