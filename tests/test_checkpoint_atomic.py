"""``checkpoint.save`` replaces a checkpoint atomically: a save killed (SIGKILL) at any point, or
one that raises, leaves a checkpoint whose leaves all come from one version, and the next save
removes what the killed one left beside the checkpoint (and nothing else)."""

import contextlib
import errno
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxmirror import checkpoint
from jaxmirror.variables import checkpoint_files, checkpoint_workers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIG = 2 ** 19  # float32 elements: a 2 MB leaf, so that writing a checkpoint takes a while
CHILD_TIMEOUT_S = 60
# What saves leave beside the destination `ck`: a complete sibling, orbax's unfinished write.
SIBLING = re.compile(r"\.ck\.jaxmirror-(new|old)-\d+-[0-9a-f]{8}")
ORBAX_TMP = re.compile(r"\.ck\.jaxmirror-new-\d+-[0-9a-f]{8}\.orbax-checkpoint-tmp.*")

# A child process that saves versions `first`, `first + 1`, ... at `path` (every leaf of version
# k holds k), printing "saved k" after each completed save. With a kill `hook` it saves `first`,
# installs the hook and saves `first + 1` with force=True, which the hook kills; with the hook
# "loop" it saves until the parent kills it. `mode` "fallback" makes renameat2 unavailable.
CHILD = f"""
import os, signal, sys, time
import numpy as np
import orbax.checkpoint as ocp
import jaxmirror as jm
from jaxmirror import checkpoint
from jaxmirror.variables import checkpoint_files as files

hook, path, first, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
s = jm.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
with s.scope():
    big = jm.Variable(np.zeros({BIG}, np.float32))
    small = jm.Variable(np.zeros((2, 3), np.float32))

def save(version):
    big.assign(np.full({BIG}, version, np.float32))
    small.assign(np.full((2, 3), version, np.float32))
    checkpoint.save(path, {{"big": big, "small": small, "version": version}}, force=True)
    print("saved", version, flush=True)

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

if mode == "fallback":
    files.exchange = lambda a, b: False
if hook == "loop":
    start = time.monotonic()
    version = first
    while time.monotonic() - start < {CHILD_TIMEOUT_S}:
        save(version)
        version += 1
    sys.exit(3)
save(first)
if hook == "orbax-save":          # orbax made its temporary directory, wrote no array yet
    ocp.PyTreeCheckpointHandler.save = die
elif hook == "orbax-finalize":    # arrays and tree metadata written; not merged, not renamed
    ocp.PyTreeCheckpointHandler.finalize = die
elif hook == "before-swap":       # the new checkpoint is complete beside the old one
    files.replace = die
elif hook == "between-renames":   # fallback: old one moved aside, new one not yet in place
    rename = os.rename
    def rename_then_die(src, dst):
        rename(src, dst)
        if src == path:
            die()
    os.rename = rename_then_die
elif hook == "after-swap":        # new one in place, old one not yet deleted
    exchange = files.exchange
    def exchange_and_say(a, b):
        swapped = exchange(a, b)
        print("exchanged", swapped, flush=True)
        return swapped
    files.exchange = exchange_and_say
    files.discard = die
save(first + 1)
"""


class Child:
    """A running CHILD; its stdout lines are collected by a thread, its stderr goes to a file."""

    def __init__(self, proc, stderr_path):
        self.proc, self.stderr_path, self.lines = proc, stderr_path, []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def saved(self):
        return [int(line.split()[1]) for line in list(self.lines) if line.startswith("saved ")]

    def wait_for_first_save(self):
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while not self.saved():
            assert self.proc.poll() is None, f"child exited early:\n{self.stderr()}"
            assert time.monotonic() < deadline, f"child saved nothing:\n{self.stderr()}"
            time.sleep(0.02)

    def stderr(self):
        with open(self.stderr_path) as f:
            return f.read()[-4000:]


@contextlib.contextmanager
def child(log_dir, hook, path, first, mode="exchange"):
    """Run CHILD; on leaving, it is killed if still running, waited for and its output read."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    stderr_path = log_dir / f"child-{hook}-{first}.stderr"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, hook, os.fspath(path), str(first),
                                 mode], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=stderr, text=True)
    c = Child(proc, stderr_path)
    try:
        yield c
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=CHILD_TIMEOUT_S)
        c.reader.join(timeout=CHILD_TIMEOUT_S)
        proc.stdout.close()


def tree(version):
    return {"big": np.full(BIG, version, np.float32),
            "small": np.full((2, 3), version, np.float32), "version": version}


def restored_version(path):
    """The version restored from ``path``, after checking that every leaf holds it."""
    out = checkpoint.restore(path, {"big": np.zeros(BIG, np.float32),
                                    "small": np.zeros((2, 3), np.float32), "version": 0})
    version = out["version"]
    np.testing.assert_array_equal(out["big"], np.full(BIG, version, np.float32))
    np.testing.assert_array_equal(out["small"], np.full((2, 3), version, np.float32))
    return version


def left_beside(run_dir):
    """What saves left beside ``ck``: {role: version restored from it}, orbax's unfinished
    writes, and anything else."""
    names = [n for n in sorted(os.listdir(run_dir)) if n != "ck"]
    complete = {m[1]: restored_version(run_dir / n) for n in names if (m := SIBLING.fullmatch(n))}
    unfinished = [n for n in names if ORBAX_TMP.fullmatch(n)]
    other = [n for n in names if not SIBLING.fullmatch(n) and not ORBAX_TMP.fullmatch(n)]
    return complete, unfinished, other


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait(timeout=CHILD_TIMEOUT_S)
    return proc.pid


# -- a save killed at chosen points ---------------------------------------------------------------
# hook, mode: (versions `restore` may give, {role: version} of the complete siblings the kill
# left, whether orbax's unfinished write is left, whether `ck` exists before `restore`).
KILL_POINTS = {
    ("orbax-save", "exchange"): ((1,), {}, True, True),
    ("orbax-finalize", "exchange"): ((1,), {}, True, True),
    ("before-swap", "exchange"): ((1,), {"new": 2}, False, True),
    ("between-renames", "fallback"): ((1, 2), {"old": 1, "new": 2}, False, False),
    ("after-swap", "exchange"): ((2,), {"new": 1}, False, True),
    ("after-swap", "fallback"): ((2,), {"old": 1}, False, True),
}


@pytest.mark.parametrize("hook,mode", list(KILL_POINTS), ids=[f"{h}-{m}" for h, m in KILL_POINTS])
def test_a_save_killed_at_each_step_leaves_one_whole_version_and_the_next_save_cleans_up(
        tmp_path, hook, mode):
    versions, siblings, unfinished, ck_exists = KILL_POINTS[hook, mode]
    run_dir = tmp_path / "run"
    path = run_dir / "ck"
    with child(tmp_path, hook, path, 1, mode) as c:
        rc = c.proc.wait(timeout=CHILD_TIMEOUT_S)
    assert rc == -signal.SIGKILL, f"the hook did not kill the save (rc {rc}):\n{c.stderr()}"
    assert c.saved() == [1]
    if hook == "after-swap" and mode == "exchange" and sys.platform.startswith("linux"):
        assert "exchanged True" in c.lines  # the one-step swap, not the fallback

    # The kill happened where it should: what it left says so.
    assert os.path.exists(path) == ck_exists
    complete, tmp, other = left_beside(run_dir)
    assert complete == siblings and bool(tmp) == unfinished and other == []

    assert restored_version(path) in versions
    checkpoint.save(path, tree(3), force=True)
    assert restored_version(path) == 3
    assert os.listdir(run_dir) == ["ck"]


# -- a save loop killed at random moments ---------------------------------------------------------
KILL_AFTER_S = (0.3, 0.8, 1.4, 2.2, 3.0)


def test_a_save_loop_killed_at_random_moments_always_leaves_the_last_or_the_next_version(
        tmp_path):
    run_dir = tmp_path / "run"
    path = run_dir / "ck"
    for run, delay in enumerate(KILL_AFTER_S):
        first = 1000 * (run + 1)  # each run starts over the debris of the run before it
        mode = "fallback" if run % 2 else "exchange"
        with child(tmp_path, "loop", path, first, mode) as c:
            c.wait_for_first_save()
            time.sleep(delay)
            assert c.proc.poll() is None, f"child stopped saving:\n{c.stderr()}"
            c.proc.kill()
            assert c.proc.wait(timeout=CHILD_TIMEOUT_S) == -signal.SIGKILL
        last = c.saved()[-1]
        assert c.saved() == list(range(first, last + 1))
        # Every reported save is in place; the one in flight may have been swapped in too.
        assert last <= restored_version(path) <= last + 1, (run, delay, c.saved()[-3:])
    checkpoint.save(path, tree(3), force=True)
    assert restored_version(path) == 3
    assert os.listdir(run_dir) == ["ck"]


# -- in-process -----------------------------------------------------------------------------------
@pytest.mark.parametrize("step", ["save", "finalize"])
def test_a_save_that_raises_inside_orbax_keeps_the_old_checkpoint_and_leaves_nothing(
        tmp_path, monkeypatch, step):
    path = tmp_path / "ck"
    checkpoint.save(path, tree(1))

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (simulated)")

    monkeypatch.setattr(ocp.PyTreeCheckpointHandler, step, no_space)
    with pytest.raises(OSError, match="simulated"):
        checkpoint.save(path, tree(2), force=True)
    assert os.listdir(tmp_path) == ["ck"]
    assert restored_version(path) == 1


def test_recover_puts_back_the_newest_complete_sibling_only_where_ck_is_missing(tmp_path):
    run_dir = tmp_path / "run"
    pid = dead_pid()
    for version, role, written_at in [(1, "old", 2_000), (2, "new", 1_000), (3, "new", 3_000)]:
        checkpoint.save(tmp_path / "made", tree(version))
        for marker in checkpoint_files.MARKERS:  # when orbax last wrote it, in seconds
            os.utime(tmp_path / "made" / marker, ns=(written_at * 10**9,) * 2)
        os.makedirs(run_dir, exist_ok=True)
        os.rename(tmp_path / "made", run_dir / f".ck.jaxmirror-{role}-{pid}-{version:08x}")
    # Orbax's unfinished write: it has the step marker from the start, and is newest.
    unfinished = run_dir / f".ck.jaxmirror-new-{pid}-0000000a.orbax-checkpoint-tmp"
    os.mkdir(unfinished)
    (unfinished / "_CHECKPOINT_METADATA").write_text("{}")
    os.utime(unfinished / "_CHECKPOINT_METADATA", ns=(4_000 * 10**9,) * 2)
    (run_dir / "ck.notes").write_text("not a sibling")

    checkpoint_files.recover(os.fspath(run_dir / "ck"))  # by the markers' times, not the role
    assert restored_version(run_dir / "ck") == 3
    checkpoint_files.recover(os.fspath(run_dir / "ck"))  # ck exists: nothing to do
    assert restored_version(run_dir / "ck") == 3
    assert sorted(os.listdir(run_dir)) == sorted([
        "ck", "ck.notes", f".ck.jaxmirror-old-{pid}-00000001",
        f".ck.jaxmirror-new-{pid}-00000002",
        f".ck.jaxmirror-new-{pid}-0000000a.orbax-checkpoint-tmp"])

    # A live process's sibling (this one's) is waited for a while, then recovered all the same.
    os.rename(run_dir / "ck", run_dir / f".ck.jaxmirror-old-{os.getpid()}-0000000b")
    start = time.monotonic()
    assert restored_version(run_dir / "ck") == 3
    assert time.monotonic() - start >= 0.9


def test_save_removes_the_leftovers_of_dead_saves_of_this_destination_only(tmp_path):
    pid, me = dead_pid(), os.getpid()
    mine = [f".ck.jaxmirror-new-{pid}-0123abcd", f".ck.jaxmirror-old-{pid}-0123abce",
            f".ck.jaxmirror-del-{pid}-0123abcf",
            f".ck.jaxmirror-new-{pid}-01234567.orbax-checkpoint-tmp",
            f".ck.jaxmirror-new-{pid}-01234568.orbax-checkpoint-tmp-1712345678"]
    kept = [f".ck.jaxmirror-new-{me}-89abcdef.orbax-checkpoint-tmp",  # a live save's
            f".ckpt.jaxmirror-new-{pid}-0123abcd",  # another destination's
            f".ck.jaxmirror-new-{pid}-0123abcd.jaxmirror-old-{pid}-0123abcd",
            f".ck.jaxmirror-new-{pid}-xyz", "ck.orbax-checkpoint-tmp", "notes.txt"]
    checkpoint.save(tmp_path / "ck", tree(1))
    for name in mine + kept:
        os.mkdir(tmp_path / name)
        (tmp_path / name / "file").write_text(name)
    checkpoint.save(tmp_path / "ck", tree(2), force=True)
    assert sorted(os.listdir(tmp_path)) == sorted(["ck"] + kept)
    assert all((tmp_path / name / "file").read_text() == name for name in kept)
    assert restored_version(tmp_path / "ck") == 2


def test_exchange_swaps_two_directories_in_one_step_on_linux(tmp_path):
    for name in ("a", "b"):
        os.mkdir(tmp_path / name)
        (tmp_path / name / "which").write_text(name)
    swapped = checkpoint_files.exchange(os.fspath(tmp_path / "a"), os.fspath(tmp_path / "b"))
    assert swapped == sys.platform.startswith("linux")
    expected = {"a": "b", "b": "a"} if swapped else {"a": "a", "b": "b"}
    assert {n: (tmp_path / n / "which").read_text() for n in "ab"} == expected


def test_the_multi_process_save_path_replaces_atomically_too(tmp_path, monkeypatch):
    # The path every worker of a multi-process run takes (here as the chief of one), called as
    # checkpoint.save calls it there: the chief decides, orbax writes a sibling, the chief swaps
    # it in (tests/test_multi_worker_failures.py kills workers at every point of it).
    checkpoint.save(tmp_path / "ck", tree(1))
    path = os.fspath(tmp_path / "ck")
    swapped = []
    replace = checkpoint_files.replace
    monkeypatch.setattr(checkpoint_files, "replace",
                        lambda new, path: (swapped.append(new), replace(new, path)))
    with pytest.raises(FileExistsError, match="already exists.*force=True"):
        checkpoint_workers.save(ocp, path, checkpoint.to_saveable(tree(2)), False)
    checkpoint_workers.save(ocp, path, checkpoint.to_saveable(tree(2)), True)
    assert restored_version(tmp_path / "ck") == 2
    assert os.listdir(tmp_path) == ["ck"]
    assert len(swapped) == 1 and SIBLING.fullmatch(os.path.basename(swapped[0]))
