"""What the parameter-server test modules share: a bounded ``join()`` and a Ray cluster."""

import os
import subprocess
import threading
import time

import jaxmirror as jm

TIMEOUT = 120


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


def descendants() -> list:
    """This process's descendant processes (Ray's raylet, GCS and actors among them)."""
    rows = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True,
                          text=True).stdout.splitlines()
    children: dict = {}
    for row in rows:
        pid, ppid, args = row.strip().split(None, 2) + [""] * (3 - len(row.strip().split(None, 2)))
        children.setdefault(int(ppid), []).append((int(pid), args))
    out, todo = [], [os.getpid()]
    while todo:
        for pid, args in children.get(todo.pop(), []):
            if "pid=,ppid=" not in args:
                out.append(f"{pid} {args}")
                todo.append(pid)
    return out


def local_cluster():
    """A resolver of 2 workers and 2 parameter servers on a local Ray runtime, shut down after
    (use as a module fixture: ``yield from local_cluster()``); no process may be left after."""
    r = jm.cluster_resolver.RayClusterResolver(num_workers=2, num_ps=2)
    try:
        yield r
    finally:
        r.shutdown()
    deadline = time.monotonic() + 30
    while descendants() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not descendants(), "Ray processes left after shutdown()"
