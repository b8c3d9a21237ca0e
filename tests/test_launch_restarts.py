"""jaxmirror.launch's restarts: ``--max-restarts N`` (torchrun's) and ``run(max_restarts=N)``.

The workers are plain Python scripts (no JAX) that read ``JAXMIRROR_LAUNCH_RESTART`` and
``JAXMIRROR_LAUNCH_WORKER_INDEX`` and exit with chosen codes. Every test is bounded by
timeouts, runs on loopback, and checks afterwards that no process it started is left.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import process_marks

LAUNCH = [sys.executable, "-m", "jaxmirror.launch"]
MARK = "JAXMIRROR_TEST_LAUNCH_RESTARTS_MARK"


@pytest.fixture
def launch():
    # Imported here: workers of `run` import this module to find its functions.
    import jaxmirror.launch

    return jaxmirror.launch


_alive, _wait_until = process_marks.alive, process_marks.wait_until


@pytest.fixture(autouse=True)
def nothing_left_running(monkeypatch):
    """Every process a test starts inherits a mark; none may still run once the test is over."""
    yield from process_marks.nothing_left_running(monkeypatch, MARK)


def _script(folder, body: str) -> str:
    """A worker script; it appends ``"<restart> <index>"`` to ``attempts`` first."""
    path = folder / "worker.py"
    path.write_text("import json, os, signal, sys, time\n"
                    "i = int(os.environ['JAXMIRROR_LAUNCH_WORKER_INDEX'])\n"
                    "restart = int(os.environ['JAXMIRROR_LAUNCH_RESTART'])\n"
                    "with open('attempts', 'a') as f:\n"
                    "    f.write(f'{restart} {i}\\n')\n"
                    + textwrap.dedent(body))
    return str(path)


def _launch(folder, *args, timeout: float = 60):
    return subprocess.run(LAUNCH + [str(a) for a in args], cwd=folder, capture_output=True,
                          text=True, timeout=timeout)


def _attempts(folder) -> list[tuple[int, int]]:
    path = folder / "attempts"
    lines = path.read_text().split() if path.exists() else []
    return sorted(zip(map(int, lines[::2]), map(int, lines[1::2])))


def _restart_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "restarting the group" in line]


# The command line.

@pytest.mark.parametrize("restarts,code", [(1, 0), (0, 42)])
def test_a_preempted_worker_restarts_the_whole_group(tmp_path, restarts, code):
    script = _script(tmp_path, "sys.exit(42 if i == 1 and restart == 0 else 0)\n")
    result = _launch(tmp_path, "--workers", 2, "--grace", 5, "--max-restarts", restarts, script)
    assert result.returncode == code, result.stderr
    # The attempt's own summary, as without restarts.
    assert "jaxmirror.launch: worker 1 exited with code 42" in result.stderr
    if restarts:
        assert _restart_lines(result.stderr) == [
            "jaxmirror.launch: restarting the group (restart 1 of 1): worker 1 exited with 42 "
            "(preempted)"]
        assert _attempts(tmp_path)[-2:] == [(1, 0), (1, 1)]  # both workers, once more
    else:
        assert _restart_lines(result.stderr) == []
        assert {a for a, _ in _attempts(tmp_path)} == {0}


@pytest.mark.parametrize("restarts,code,attempts", [(1, 128 + 9, 2), (2, 0, 3)])
def test_a_worker_killed_by_a_signal_restarts_until_the_restarts_are_used(
        tmp_path, restarts, code, attempts):
    # Worker 1 dies once worker 0 has started (else, in the last attempt, the launcher could
    # stop worker 0 before it wrote its line).
    script = _script(tmp_path, """
        if i == 1 and restart < 2:
            deadline = time.monotonic() + 30
            while f"{restart} 0" not in open("attempts").read().splitlines():
                assert time.monotonic() < deadline, "worker 0 did not start"
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        """)
    result = _launch(tmp_path, "--workers", 2, "--grace", 5, "--max-restarts", restarts, script)
    assert result.returncode == code, result.stderr
    assert sorted({a for a, _ in _attempts(tmp_path)}) == list(range(attempts))
    assert [w for a, w in _attempts(tmp_path) if a == attempts - 1] == [0, 1]
    assert _restart_lines(result.stderr) == [
        f"jaxmirror.launch: restarting the group (restart {k} of {restarts}): worker 1 was "
        f"killed by SIGKILL" for k in range(1, attempts)]


def test_each_attempt_gets_fresh_ports_after_the_last_ones_workers_are_gone(tmp_path):
    script = _script(tmp_path, """
        with open(f"pid-{restart}-{i}", "w") as f:
            f.write(str(os.getpid()))
        with open(f"cluster-{restart}-{i}", "w") as f:
            f.write(json.dumps(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]))
        if restart > 0:  # no worker of the attempt before may be alive
            alive = []
            for w in range(2):
                pid = int(open(f"pid-{restart - 1}-{w}").read())
                try:
                    os.kill(pid, 0)
                    alive.append(pid)
                except ProcessLookupError:
                    pass
            with open(f"alive-{restart}-{i}", "w") as f:
                f.write(json.dumps(alive))
        if restart < 2 and i == 0:
            time.sleep(60)  # stopped by the launcher (SIGINT) when worker 1 fails
        if restart < 2 and i == 1:
            while not os.path.exists(f"pid-{restart}-0"):
                time.sleep(0.02)
            sys.exit(3)
    """)
    start = time.monotonic()
    result = _launch(tmp_path, "--workers", 2, "--grace", 5, "--max-restarts", 2, script)
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - start < 40
    assert len(_restart_lines(result.stderr)) == 2
    assert "worker 1 exited with 3" in _restart_lines(result.stderr)[0]
    clusters = []
    for attempt in range(3):
        both = [json.loads((tmp_path / f"cluster-{attempt}-{w}").read_text()) for w in range(2)]
        assert both[0] == both[1]  # one cluster per attempt
        clusters.append(both[0])
    ports = [{int(a.rsplit(":", 1)[1]) for a in c} for c in clusters]
    assert all(len(p) == 2 for p in ports)
    assert not (ports[0] & ports[1]) and not (ports[1] & ports[2]) and not (ports[0] & ports[2])
    for attempt in (1, 2):
        for w in range(2):
            assert json.loads((tmp_path / f"alive-{attempt}-{w}").read_text()) == []


def test_timeout_bounds_a_launch_that_would_restart_for_ever(tmp_path):
    script = _script(tmp_path, "time.sleep(0.1)\nsys.exit(42)\n")
    start = time.monotonic()
    result = _launch(tmp_path, "--workers", 2, "--grace", 1, "--timeout", 3,
                     "--max-restarts", 1000000, script)
    assert result.returncode == 124, result.stderr
    assert time.monotonic() - start < 30
    assert "timed out after 3 s (--timeout)" in result.stderr
    assert len(_restart_lines(result.stderr)) >= 1


def test_ctrl_c_to_the_launcher_does_not_restart(tmp_path):
    script = _script(tmp_path, "open(f'pid{i}', 'w').write(str(os.getpid()))\ntime.sleep(60)\n")
    launcher = subprocess.Popen(LAUNCH + ["--workers", "2", "--grace", "5", "--max-restarts",
                                          "5", script],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    try:
        assert _wait_until(lambda: all((tmp_path / f"pid{i}").exists() for i in range(2)), 30)
        launcher.send_signal(signal.SIGINT)
        _, stderr = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 130, stderr
    assert _restart_lines(stderr) == []
    assert _attempts(tmp_path) == [(0, 0), (0, 1)]


@pytest.mark.parametrize("value", ["-1", "x", "1.5"])
def test_a_bad_max_restarts_exits_2_before_starting_anything(tmp_path, value):
    script = _script(tmp_path, "")
    result = _launch(tmp_path, "--workers", 1, "--max-restarts", value, script)
    assert result.returncode == 2
    assert f"--max-restarts: expected a whole number >= 0, got '{value}'" in result.stderr
    assert _attempts(tmp_path) == []


# jaxmirror.launch.run

def _preempted_in_worker_1_at_first():
    restart = int(os.environ["JAXMIRROR_LAUNCH_RESTART"])
    index = int(os.environ["JAXMIRROR_LAUNCH_WORKER_INDEX"])
    if index == 1 and restart == 0:
        os._exit(42)
    return restart, index


def test_run_restarts_and_returns_the_successful_attempts_values(launch, capsys):
    assert launch.run(_preempted_in_worker_1_at_first, workers=2, max_restarts=1,
                      timeout=60) == [(1, 0), (1, 1)]
    assert _restart_lines(capsys.readouterr().err) == [
        "jaxmirror.launch: restarting the group (restart 1 of 1): worker 1 exited with 42 "
        "(preempted)"]


def test_run_without_restarts_raises_the_preempted_workers_error(launch):
    with pytest.raises(launch.WorkerError) as caught:
        launch.run(_preempted_in_worker_1_at_first, workers=2, timeout=60)
    assert (caught.value.worker_index, caught.value.exit_code) == (1, 42)


@pytest.mark.parametrize("value,error", [(-1, ValueError), (True, TypeError), (1.0, TypeError)])
def test_run_checks_max_restarts(launch, value, error):
    with pytest.raises(error, match="`max_restarts` must be an int >= 0"):
        launch.run(len, workers=1, args=("ab",), max_restarts=value)
