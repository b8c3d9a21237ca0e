"""The launcher tests' bookkeeping of the processes they start (``test_launch.py``,
``test_launch_restarts.py``): every process a test starts inherits a mark in its environment,
and none may still run once the test is over."""

import os
import time
import uuid


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has stopped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def marked(variable: str, mark: str) -> list[int]:
    """Live processes (not this one) whose environment sets ``variable`` to ``mark``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if f"{variable}={mark}".encode() in f.read().split(b"\0") and alive(int(name)):
                    found.append(int(name))
        except OSError:
            pass
    return found


def wait_until(condition, timeout: float = 10.0) -> bool:
    """Whether ``condition()`` became true within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def nothing_left_running(monkeypatch, variable: str):
    """A fixture's body: mark the test's processes; after it, none may be left running."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv(variable, mark)
    yield
    if not os.path.isdir("/proc"):
        return
    assert wait_until(lambda: not marked(variable, mark), 5.0), \
        f"left running: {marked(variable, mark)}"
