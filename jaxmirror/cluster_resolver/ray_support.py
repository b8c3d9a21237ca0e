"""Ray is an optional dependency (``pip install 'jaxmirror[ray]'``): import it on first use."""

from __future__ import annotations

import os
import signal
import subprocess
import time


def ray_module():
    """The ``ray`` module, imported now.

    Returns:
        The module.

    Raises:
        ImportError: when Ray is not installed, saying how to install it.

    Example:
        >>> ray_module().__name__
        'ray'
    """
    try:
        import ray
    except ImportError as e:
        raise ImportError("jaxmirror's parameter-server training runs on Ray, which is not "
                          "installed; install it with: pip install 'jaxmirror[ray]'") from e
    return ray


def actor_died_errors() -> tuple:
    """The exception types Ray raises for a call on an actor whose process died.

    Returns:
        A tuple of exception classes.

    Example:
        >>> all(issubclass(t, Exception) for t in actor_died_errors())
        True
    """
    exceptions = ray_module().exceptions
    return (exceptions.RayActorError, exceptions.ActorUnavailableError)


def is_startup_timeout(error: BaseException) -> bool:
    """Whether ``ray.init`` failed because a process of the new node started too slowly.

    Ray 2.x raises a plain ``Exception`` for it: "The current node timed out during startup"
    (the raylet did not register within 30 s) or "Timed out waiting for file ..." (the GCS's
    port file).

    Args:
        error: what ``ray.init`` raised.

    Returns:
        A bool.

    Example:
        >>> is_startup_timeout(Exception("The current node timed out during startup."))
        True
        >>> is_startup_timeout(ValueError("bad resources"))
        False
    """
    return "timed out" in str(error).lower()


def _descendants() -> dict:
    """This process's live descendants (``ps``), pid -> command line; empty without ``ps``."""
    try:
        rows = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,stat=,args="],
                              capture_output=True, text=True, timeout=60).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return {}
    children: dict = {}
    for row in rows:
        parts = row.split(None, 3) + [""]
        if parts[0].isdigit() and parts[1].isdigit() and "pid=,ppid=" not in parts[3]:
            children.setdefault(int(parts[1]), []).append((int(parts[0]), parts[2], parts[3]))
    out, todo = {}, [os.getpid()]
    while todo:
        for pid, state, command in children.get(todo.pop(), []):
            todo.append(pid)
            if not state.startswith("Z"):
                out[pid] = command
    return out


def child_pids() -> set:
    """The ids of this process's live descendant processes.

    Returns:
        A set of ints.

    Example:
        >>> os.getpid() in child_pids()
        False
    """
    return set(_descendants())


def _alive(pid: int) -> bool:
    try:
        if os.waitpid(pid, os.WNOHANG)[0]:  # our own child, exited: reaped now
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _signal(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:  # gone meanwhile
            pass


def stop_new_ray_processes(before: set, grace: float = 5.0) -> list:
    """Stop the Ray processes this process started since ``before`` (a failed ``ray.init``
    leaves its GCS, raylet and helpers running: ``ray.shutdown()`` does not know them).

    Only descendants of this process that are not in ``before`` and run Ray's programs (their
    command line names Ray's package directory, or is a Ray worker's ``ray::...``) are stopped.

    Args:
        before: ``child_pids()`` taken before ``ray.init``.
        grace: seconds between SIGTERM and SIGKILL.

    Returns:
        The ids of the processes stopped.

    Example:
        >>> stop_new_ray_processes(child_pids())
        []
    """
    ray_dir = os.path.dirname(ray_module().__file__)
    found = [pid for pid, command in _descendants().items() if pid not in before
             and (ray_dir in command or command.startswith("ray::"))]
    _signal(found, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while (alive := [pid for pid in found if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    _signal(alive, signal.SIGKILL)
    for pid in alive:
        _alive(pid)  # reap
    return found
