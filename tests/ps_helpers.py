"""What the parameter-server test modules share: a bounded ``join()`` and a Ray cluster."""

import os
import threading
import time

import ray
import psutil  # Ray's own copy, on the path once Ray is imported

import jaxmirror as jm

RAYLET = os.path.join(os.path.dirname(ray.__file__), "core", "src", "ray", "raylet", "raylet")

TIMEOUT = 120
STARTUP_TIMEOUT = 600  # a loaded CI machine (load 15-30 on 2 cores) may take minutes
OWN: dict = {}  # id(resolver) -> (the pids before it, its raylets)


def joined(coordinator, timeout=TIMEOUT):
    """coordinator.join(), bounded; re-raises its error."""
    out = {}

    def run():
        try:
            coordinator.join()
        except BaseException as e:  # noqa: BLE001
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "join() did not return in time"
    if "error" in out:
        raise out["error"]


def _rows(processes) -> list:
    out = []
    for p in processes:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.cmdline())}")
        except psutil.Error:  # gone meanwhile
            pass
    return out


def snapshot() -> set:
    """The ids of this process's descendants now: what a fixture does not own."""
    return {p.pid for p in psutil.Process().children(recursive=True)}


def own_processes(before: set, raylet_pids: set) -> list:
    """The live processes a test started since ``snapshot()`` gave ``before``: this process's
    descendants that are new, and any process (an orphaned actor) whose raylet is one of
    ``raylet_pids`` (Ray gives its workers ``RAY_RAYLET_PID``). Other tests' processes, and
    other users of Ray on the machine, are not counted. Returns ``"pid command"`` rows."""
    mine = {p.pid: p for p in psutil.Process().children(recursive=True) if p.pid not in before}
    wanted = {str(pid) for pid in raylet_pids}
    for p in psutil.process_iter():
        if p.pid in mine or p.pid == os.getpid():
            continue
        try:
            if p.environ().get("RAY_RAYLET_PID") in wanted:
                mine[p.pid] = p
        except psutil.Error:  # another user's process, or gone
            pass
    return _rows(mine.values())


def new_raylets(before: set) -> set:
    """The raylets this process started since ``before``."""
    return {int(row.split()[0]) for row in own_processes(before, set())
            if row.split(None, 1)[1].startswith(RAYLET)}


def local_cluster():
    """A resolver of 2 workers and 2 parameter servers on a local Ray runtime, shut down after
    (use as a module fixture: ``yield from local_cluster()``); none of its processes may be left
    after. Ray may take long to start on a busy machine: ``STARTUP_TIMEOUT`` bounds it."""
    before = snapshot()
    r = jm.cluster_resolver.RayClusterResolver(num_workers=2, num_ps=2,
                                                startup_timeout_seconds=STARTUP_TIMEOUT)
    raylets = new_raylets(before)
    assert raylets, "the check for left processes cannot see this test's raylet"
    OWN[id(r)] = before, raylets
    try:
        yield r
    finally:
        r.shutdown()
    left = left_after_shutdown(r)
    assert not left, f"Ray processes of this test left after shutdown(): {left}"


def left_after_shutdown(resolver, timeout=30) -> list:
    """The processes of ``local_cluster()``'s resolver still alive after ``timeout`` seconds."""
    before, raylets = OWN[id(resolver)]
    deadline = time.monotonic() + timeout
    while (left := own_processes(before, raylets)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
