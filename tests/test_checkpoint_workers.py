"""Checkpoints saved by several workers (issue 27): with one device per worker, of variables
never assigned and of arrays from ``experimental_replicate``; atomic when any worker is killed
at any point of a save (the previous checkpoint restores, as a single process's save
guarantees, ``tests/test_checkpoint_atomic.py``).

Two workers x 1 CPU device through ``python -m jaxmirror.launch`` on loopback, each run bounded
by the launcher's timeout; the checkpoints are restored in this process.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import jaxmirror as jm
from conftest import strategy as one_process

SAVING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multi_worker_saving.py")
BIG = 2 ** 18


def _launch(hook, path):
    command = [sys.executable, "-m", "jaxmirror.launch", "--workers", "2",
               "--devices-per-worker", "1", "--timeout", "150", SAVING, hook, str(path)]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=240)
    return done.returncode, done.stdout


def _restored(path):
    s = one_process(2)
    with s.scope():
        target = {"big": jm.Variable(np.zeros(BIG, np.float32)),
                  "unassigned": jm.Variable(np.zeros((2, 3), np.float32)),
                  "total": jm.Variable(0.0, synchronization="on_read", aggregation="sum"),
                  "replicated": np.zeros(4, np.float32), "version": 0}
    out = jm.checkpoint.restore(path, target)
    return {"big": np.asarray(out["big"].read_value()),
            "unassigned": np.asarray(out["unassigned"].read_value()),
            "total": float(out["total"].read_value()), "replicated": out["replicated"],
            "version": out["version"]}


def _one_version(got):
    version = got["version"]
    assert version in (1, 2)
    np.testing.assert_array_equal(got["big"], np.full(BIG, version, np.float32))
    np.testing.assert_array_equal(got["replicated"], np.full(4, version, np.float32))
    assert got["total"] == version
    np.testing.assert_array_equal(got["unassigned"], np.ones((2, 3)))  # never assigned
    return version


def test_two_workers_with_one_device_each_save_every_kind_of_leaf(tmp_path):
    code, out = _launch("none", tmp_path / "ck")
    assert code == 0, out[-5000:]
    assert out.count("saved 2") == 2
    assert _one_version(_restored(tmp_path / "ck")) == 2
    assert os.listdir(tmp_path) == ["ck"]  # nothing left beside it


# Where a worker dies in the second save, and which versions may then be found.
KILLS = [("1:before-write", {1}), ("0:before-write", {1}), ("0:finalize", {1}),
         ("0:before-swap", {1}), ("0:between-renames", {1, 2}), ("0:after-swap", {2})]


@pytest.mark.parametrize("hook,versions", KILLS)
def test_a_worker_killed_in_a_save_leaves_a_checkpoint_that_restores(tmp_path, hook, versions):
    code, out = _launch(hook, tmp_path / "ck")
    assert out.count("saved 1") == 2, out[-5000:]
    assert f"dying at {hook}" in out and "saved 2" not in out
    victim = int(hook[0])
    assert f"worker {victim} was killed by SIGKILL" in out
    survivor = 1 - victim
    # The other worker ended itself, naming the dead one: no hang, no abort.
    assert f"worker {survivor} exited with code 1" in out, out[-5000:]
    assert re.search(rf"\[worker {survivor}\] jaxmirror\.errors\.UnavailableError: worker "
                     rf"{victim} \(127\.0\.0\.1:\d+\) stopped", out), out[-5000:]
    assert "SIGABRT" not in out
    assert _one_version(_restored(tmp_path / "ck")) in versions
    # The next save cleans up what the killed one left beside the checkpoint.
    s = one_process(2)
    jm.checkpoint.save(tmp_path / "ck", {"version": 3}, force=True)
    assert os.listdir(tmp_path) == ["ck"]
    assert jm.checkpoint.restore(tmp_path / "ck", {"version": 0})["version"] == 3
    del s
