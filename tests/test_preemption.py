"""Preemption through the launcher (issue 28): a SIGTERM to one worker at a random step makes
every worker save at the same step and exit 42; the relaunch (``--max-restarts``) resumes from
that checkpoint, iterator position included, and ends with the params of an uninterrupted run,
bit for bit, every example seen once. A SIGKILL resumes from the last periodic checkpoint; a
restart onto another number of workers continues with every example seen once.

Each run is ``python -m jaxmirror.launch`` on loopback running ``preemption_training.py``,
bounded by the launcher's ``--timeout`` and ``subprocess``'s.
"""

import os
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

TRAINING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "preemption_training.py")
STEPS = 16
GLOBAL = 8


def _launch(tmp_path, name, workers, devices, *, restarts=0, save_every=0, kill=None,
            env=None, earliest=2):
    """Run the training; ``kill=(signal, worker)`` is sent to that worker of the first attempt
    once the chief has made a random number of calls (``earliest`` at least). Returns (exit
    code, output, out dir, calls made when the signal was sent)."""
    out = tmp_path / name
    out.mkdir()
    command = [sys.executable, "-m", "jaxmirror.launch", "--workers", str(workers),
               "--devices-per-worker", str(devices), "--timeout", "200",
               "--max-restarts", str(restarts), TRAINING, str(tmp_path / "ckpt"), str(out),
               str(STEPS), str(save_every)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    at = None
    try:
        if kill is not None:
            at = random.Random(os.getpid()).randint(earliest, STEPS - 8)
            sig, victim = kill  # victim: a worker's index, or ("group", index)
            progress, deadline = out / "progress-0", time.monotonic() + 150
            while time.monotonic() < deadline and proc.poll() is None:
                text = progress.read_text().strip() if progress.exists() else ""
                if text.isdigit() and int(text) >= at:  # a read mid-write is empty: not yet
                    if isinstance(victim, tuple):  # the whole process group, as platforms do
                        pid = int((out / f"pid-{victim[1]}-0").read_text())
                        os.killpg(os.getpgid(pid), sig)
                    else:
                        os.kill(int((out / f"pid-{victim}-0").read_text()), sig)
                    break
                time.sleep(0.02)
        text, _ = proc.communicate(timeout=260)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, text, out, at


def _seen(out, workers, attempt):
    """Per worker, the example ids of each step of ``attempt`` (a list of lists)."""
    seen = []
    for w in range(workers):
        path = out / f"seen-{w}-{attempt}"
        lines = path.read_text().splitlines() if path.exists() else []
        seen.append([[int(i) for i in line.split()] for line in lines])
    return seen


def _ids(seen):
    return sorted(i for per_worker in seen for step in per_worker for i in step)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final params of an uninterrupted run, per layout."""
    runs = {}

    def get(workers, devices):
        if (workers, devices) not in runs:
            tmp = tmp_path_factory.mktemp(f"plain{workers}x{devices}")
            code, text, out, _ = _launch(tmp, "run", workers, devices, save_every=3,
                                         env={"PREEMPTION_TEST_SLEEP": "0"})
            assert code == 0, text[-4000:]
            runs[workers, devices] = np.load(out / "final-0.npy")
        return runs[workers, devices]
    return get


# 2 x 2: SIGTERM to the chief's whole process group (its coordination service's helper too);
# 4 x 1: to the last worker, and again in the next attempt before its first step.
CASES = [(2, 2, ("group", 0), None), (4, 1, 3, "1")]


@pytest.mark.parametrize("workers,devices,victim,early", CASES)
def test_sigterm_saves_everywhere_at_one_step_and_the_restart_resumes_exactly(
        tmp_path, uninterrupted, workers, devices, victim, early):
    attempts = 3 if early else 2
    env = {"PREEMPTION_TEST_EARLY_SIGTERM": early} if early else None
    code, text, out, at = _launch(tmp_path, "run", workers, devices, restarts=attempts - 1,
                                  kill=(signal.SIGTERM, victim), env=env)
    assert code == 0, text[-4000:]
    assert "exited with 42 (preempted)" in text, text[-4000:]
    ids, start = [], 0
    for attempt in range(attempts):
        assert {int((out / f"start-{w}-{attempt}").read_text())
                for w in range(workers)} == {start}, attempt
        if attempt < attempts - 1:
            # Every worker saved at the same call and exited through exit_fn.
            exits = {int((out / f"exit-{w}-{attempt}").read_text()) for w in range(workers)}
            assert len(exits) == 1, (attempt, exits)
            (saved,) = exits
            assert (at if attempt == 0 else start) <= saved < STEPS
        else:
            saved = STEPS
        seen = _seen(out, workers, attempt)
        assert all(len(s) == saved - start for s in seen), (attempt, start, saved)
        assert min(_ids(seen), default=start * GLOBAL) == start * GLOBAL
        ids += _ids(seen)
        start = saved
    # Every example once over the interruptions, and the params of an uninterrupted run.
    assert sorted(ids) == list(range(STEPS * GLOBAL))
    final = np.load(out / f"final-{attempts - 1}.npy")
    np.testing.assert_array_equal(final, uninterrupted(workers, devices))  # bit for bit


def test_sigkill_resumes_from_the_last_periodic_checkpoint(tmp_path, uninterrupted):
    code, text, out, at = _launch(tmp_path, "run", 2, 2, restarts=1, save_every=3,
                                  kill=(signal.SIGKILL, 1), earliest=4)  # after a save
    assert code == 0, text[-4000:]
    assert "restarting the group" in text and "SIGKILL" in text, text[-4000:]
    start = {int((out / f"start-{w}-1").read_text()) for w in range(2)}
    assert len(start) == 1
    (start,) = start
    assert start % 3 == 0 and start >= 3  # the last periodic save before the kill
    second = _seen(out, 2, 1)
    assert sorted(_ids(second)) == list(range(start * GLOBAL, STEPS * GLOBAL))
    np.testing.assert_array_equal(np.load(out / "final-1.npy"), uninterrupted(2, 2))


def test_a_restart_onto_another_number_of_workers_continues_every_example_once(
        tmp_path, uninterrupted):
    code, text, out, _ = _launch(tmp_path, "first", 2, 2, kill=(signal.SIGTERM, 0))
    assert code == 42, text[-4000:]
    saved = int((out / "exit-0-0").read_text())
    code, text, out2, _ = _launch(tmp_path, "second", 4, 1, env={"PREEMPTION_TEST_SLEEP": "0"})
    assert code == 0, text[-4000:]
    assert {int((out2 / f"start-{w}-0").read_text()) for w in range(4)} == {saved}
    ids = _ids(_seen(out, 2, 0)) + _ids(_seen(out2, 4, 0))
    assert sorted(ids) == list(range(STEPS * GLOBAL))
    # Four replicas either way: the same split; the sums may be ordered differently.
    np.testing.assert_allclose(np.load(out2 / "final-0.npy"), uninterrupted(2, 2), rtol=1e-6)


def test_an_error_in_a_step_on_one_worker_is_reported_on_every_worker(tmp_path):
    start = time.monotonic()
    code, text, out, _ = _launch(tmp_path, "run", 2, 1, env={"PREEMPTION_TEST_RAISE_AT": "3"})
    assert code == 1, text[-4000:]
    assert "[worker 1] RuntimeError: worker 1 lost its disk at call 3" in text, text[-4000:]
    assert re.search(r"\[worker 0\] jaxmirror\.errors\.UnavailableError: worker 1 "
                     r"\(127\.0\.0\.1:\d+\) raised RuntimeError: worker 1 lost its disk", text), \
        text[-4000:]
    assert "worker 0 exited with code 1" in text
    assert time.monotonic() - start < 60
