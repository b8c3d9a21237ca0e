"""The cluster's coordination service, in a helper process of the chief.

``jax.distributed`` runs its coordination service (the key-value store, heartbeats, barriers)
inside process 0; when that process dies, every other process's client fails its error poll at
once and JAX ends it with a C++ ``abort()`` that names nobody (measured, jax 0.10). So the
chief starts the same service, JAX's own, in a small helper process of its own, with failed
tasks recoverable: a dead worker, the chief included, is then seen by every survivor as no
longer live (``runtime/watch.py`` names it) instead of aborting them.

The helper lives as long as the chief: its stdin is a pipe from the chief. When the chief
stops the runtime (``stop``, after every worker ended its program) it exits a few seconds
later; when the chief dies (the pipe closes without a word) it serves the survivors
``linger_s`` seconds more, long enough for their heartbeat timeout to name the chief, then
exits. It ignores SIGINT (a launcher's Ctrl-C reaches the
whole process group): the survivors need it until they have stopped.

Run as ``python -m jaxmirror.runtime.service_main BIND_ADDRESS NUM_PROCESSES HEARTBEAT_S
SHUTDOWN_S LINGER_S``; it prints ``ready`` once it serves.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

from jaxmirror.cluster_resolver.cluster_spec import parse_address
from jaxmirror.core import _compat

READY = "ready"
STOP = b"stop\n"
_START_TIMEOUT_S = 120.0  # importing jaxlib on a loaded machine
_STOP_LINGER_S = 3.0
_state = {"helper": None}


def bind_address(address: str) -> str:
    """Where the service listens for a coordinator ``address``: every interface, its port
    (``jax.distributed``'s own default).

    Args:
        address: the coordinator's ``host:port``.

    Returns:
        ``[::]:port``.

    Example:
        >>> bind_address("127.0.0.1:2222")
        '[::]:2222'
    """
    return f"[::]:{parse_address(address)[1]}"


def start(address: str, num_processes: int, heartbeat_s: int, shutdown_s: int,
          linger_s: float) -> None:
    """Start the helper serving the coordination service at ``address``'s port; returns once it
    serves.

    Args:
        address: the coordinator's ``host:port`` (this process's own task address).
        num_processes: how many processes join.
        heartbeat_s: seconds without heartbeats after which a process counts as dead.
        shutdown_s: how long the service waits for every process at shutdown.
        linger_s: how long the helper keeps serving after this process died.

    Raises:
        RuntimeError: when the helper could not start (the port is taken, say); its output
            is in the message.
    """
    if _state["helper"] is not None:
        return
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    env["PYTHONUNBUFFERED"] = "1"
    env["JAX_PLATFORMS"] = "cpu"  # it runs no computation: no GPU memory for it
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"  # its warnings (recoverable tasks) are ours, not users'

    command = [sys.executable, "-m", "jaxmirror.runtime.service_main", bind_address(address),
               str(num_processes), str(heartbeat_s), str(shutdown_s), str(linger_s)]
    # Its log goes where this process's does; stdout carries only READY.
    helper = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        readable, _, _ = select.select([helper.stdout], [], [], deadline - time.monotonic())
        line = helper.stdout.readline().decode("utf-8", "replace") if readable else ""
        if not line:
            break  # it exited, or never said it serves
        if line.strip() == READY:
            _state["helper"] = helper
            return
    helper.kill()
    helper.wait()
    raise RuntimeError(f"MultiWorkerMirroredStrategy: the coordination service for "
                       f"{num_processes} processes could not start at {address} within "
                       f"{_START_TIMEOUT_S:g} s (its error is above, in this worker's output); "
                       f"free that port, or give the chief another address in TF_CONFIG.")


def stop() -> None:
    """Tell the helper that the cluster shut down cleanly: it exits a few seconds later (the
    other workers' last requests may still be on their way); nothing when none runs."""
    helper, _state["helper"] = _state["helper"], None
    if helper is None:
        return
    try:
        helper.stdin.write(STOP)
        helper.stdin.close()
    except OSError:
        pass  # it is gone already


def main(argv: list) -> None:
    """The helper's body (see the module's docstring).

    Args:
        argv: ``[bind address, processes, heartbeat s, shutdown s, linger s]``.
    """
    # A Ctrl-C, or a preemption notice a platform sends to every process of the chief's group,
    # must not end the service before the chief: the workers still save (PreemptionCheckpoint-
    # Handler). It ends when the chief's stdin closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    bind, num, heartbeat, shutdown, linger = argv
    # Held until the process exits: the object is the service.
    _state["service"] = _compat.start_coordination_service(bind, int(num), int(heartbeat),
                                                           int(shutdown))
    print(READY, flush=True)
    words = sys.stdin.buffer.read()  # until the chief writes STOP, or dies (end of file)
    # Stopped: every worker had ended its program; their last requests (disconnecting) may
    # still be on their way. Died: the survivors need it until they have named the chief.
    time.sleep(_STOP_LINGER_S if words == STOP else float(linger))
    os._exit(0)  # the service's own shutdown would wait for clients that may be gone

