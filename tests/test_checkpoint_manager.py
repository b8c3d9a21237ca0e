"""``jaxmirror.checkpoint.CheckpointManager``: TF's ``tf.train.CheckpointManager`` rules (the
max_to_keep sweep, keep_checkpoint_every_n_hours, checkpoint_interval, numbering, recovery from
the directory), tracked items, NNX objects in place, bad arguments; and, through
``python -m jaxmirror.launch`` on loopback, several workers agreeing on every decision and a
worker killed at points inside ``save`` (the relaunched manager restores the newest complete
checkpoint and the next save cleans up).
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmirror as jm
from conftest import strategy
from jaxmirror.checkpoint import CheckpointManager
from jaxmirror.core.checkpointable import Checkpointable

STATE = "checkpoint_state.json"


def _listing(directory):
    return sorted(os.listdir(directory))


def _names(paths):
    return [os.path.basename(p) for p in paths]


def _variables(s, value=0.0):
    with s.scope():
        return jm.Variable(np.full(3, value, np.float32))


def test_round_trip_is_bit_for_bit_with_four_mirrored_replicas(tmp_path):
    s = strategy(4)
    rng = np.random.default_rng(0)
    w0, b0 = rng.standard_normal((3, 4)).astype(np.float32), np.float32(rng.standard_normal(4))
    with s.scope():
        w = jm.Variable(w0)
        total = jm.Variable(0.0, synchronization="on_read", aggregation="sum")
        step = jm.Variable(np.int64(7))
    s.run(lambda: total.assign(jm.get_replica_context().replica_id_in_sync_group + 0.25))
    bias = jax.device_put(b0, s.extended.replicated_sharding)
    tree = {"w": w, "total": total, "step": step, "bias": bias, "n": 3}
    manager = CheckpointManager(tree, tmp_path, max_to_keep=3)
    assert manager.save() == str(tmp_path / "ckpt-1")
    w.assign(np.zeros((3, 4), np.float32))
    s.run(lambda: total.assign(0.0))
    step.assign(0)
    out = manager.restore()
    assert out["w"] is w and out["total"] is total and out["step"] is step
    np.testing.assert_array_equal(w.numpy(), w0)
    assert [np.asarray(c).tobytes() for c in w.values] == [w0.tobytes()] * 4
    assert float(total.numpy()) == 0.25 + 1.25 + 2.25 + 3.25
    assert int(step.numpy()) == 7 and out["n"] == 3
    assert np.asarray(out["bias"]).tobytes() == b0.tobytes()
    assert out["bias"].sharding == bias.sharding
    assert manager.save_counter == 1


def test_max_to_keep_deletes_the_oldest_and_records_the_state(tmp_path):
    w = _variables(strategy(2))
    manager = CheckpointManager({"w": w}, tmp_path / "run", max_to_keep=2)
    assert manager.latest_checkpoint is None and manager.checkpoints == []
    assert not os.path.exists(tmp_path / "run")  # nothing written before the first save
    listings = []
    for i in range(1, 5):
        w.assign(np.full(3, i, np.float32))
        assert manager.save() == str(tmp_path / "run" / f"ckpt-{i}")
        listings.append(_listing(tmp_path / "run"))
    assert listings == [[STATE, "ckpt-1"], [STATE, "ckpt-1", "ckpt-2"],
                        [STATE, "ckpt-2", "ckpt-3"], [STATE, "ckpt-3", "ckpt-4"]]
    assert _names(manager.checkpoints) == ["ckpt-3", "ckpt-4"]
    assert manager.latest_checkpoint == str(tmp_path / "run" / "ckpt-4")
    state = json.loads((tmp_path / "run" / STATE).read_text())
    assert state["latest"] == "ckpt-4" and state["preserved"] == []
    assert [e["path"] for e in state["checkpoints"]] == ["ckpt-3", "ckpt-4"]
    record = manager.state_record  # what the manager holds: the file's entries, a copy
    assert record["checkpoints"] == state["checkpoints"] and record["preserved"] == []
    record["checkpoints"].clear()
    assert _names(manager.checkpoints) == ["ckpt-3", "ckpt-4"]
    manager.restore(manager.checkpoints[0])  # an older one, by path
    assert w.numpy().tolist() == [3.0] * 3 and manager.save_counter == 3
    keep_all = CheckpointManager({"w": w}, tmp_path / "all", max_to_keep=None)
    for _ in range(4):
        keep_all.save()
    assert _listing(tmp_path / "all") == [STATE] + [f"ckpt-{i}" for i in range(1, 5)]


def test_keep_checkpoint_every_n_hours_keeps_one_per_period_for_good(tmp_path, monkeypatch):
    clock = [10000.0]
    monkeypatch.setattr("time.time", lambda: clock[0])
    w = _variables(strategy(2))
    manager = CheckpointManager({"w": w}, tmp_path, max_to_keep=2,
                                keep_checkpoint_every_n_hours=1)
    for i in range(7):  # every half hour
        clock[0] = 10000.0 + 1800 * i
        manager.save()
    # ckpt-1 and ckpt-2 fall within the first hour after the start (TF's clock starts then).
    assert _listing(tmp_path) == [STATE, "ckpt-3", "ckpt-5", "ckpt-6", "ckpt-7"]
    assert _names(manager.checkpoints) == ["ckpt-6", "ckpt-7"]
    state = json.loads((tmp_path / STATE).read_text())
    assert [e["path"] for e in state["preserved"]] == ["ckpt-3", "ckpt-5"]
    assert state["last_preserved_timestamp"] == 10000.0 + 1800 * 4
    clock[0] += 60
    again = CheckpointManager({"w": w}, tmp_path, max_to_keep=2, keep_checkpoint_every_n_hours=1)
    assert _names(again.checkpoints) == ["ckpt-6", "ckpt-7"]  # kept for good: not taken back
    again.restore_or_initialize()
    again.save()
    assert _listing(tmp_path) == [STATE, "ckpt-3", "ckpt-5", "ckpt-7", "ckpt-8"]


def test_checkpoint_interval_follows_tfs_rules(tmp_path):
    s = strategy(2)
    with s.scope():
        step = jm.Variable(0)
    manager = CheckpointManager({"step": step}, tmp_path, max_to_keep=None, step_counter=step,
                                checkpoint_interval=5)
    assert manager.checkpoint_interval == 5
    saved = []
    for n, check in [(0, True), (3, True), (5, True), (5, False), (7, True), (7, False),
                     (9, True), (12, True)]:
        step.assign(n)
        saved.append(manager.save(check_interval=check) is not None)
    assert saved == [True, False, True, False, False, True, False, True]
    assert manager.save_counter == 4
    assert _names(manager.checkpoints) == ["ckpt-1", "ckpt-2", "ckpt-3", "ckpt-4"]
    # A restored manager knows the restored step (TF's restore_or_initialize does the same).
    again = CheckpointManager({"step": step}, tmp_path, max_to_keep=None, step_counter=12,
                              checkpoint_interval=5)
    assert again.restore_or_initialize() == str(tmp_path / "ckpt-4")
    assert again.save() is None and again.save(check_interval=False) is None  # same step
    array_step = CheckpointManager({"step": step}, tmp_path / "b", max_to_keep=1,
                                   step_counter=np.int64(3), checkpoint_interval=1)
    assert array_step.save() is not None and array_step.save() is None


def test_checkpoint_number_names_the_checkpoint_and_a_resave_becomes_the_newest(tmp_path):
    s = strategy(2)
    with s.scope():
        global_step = jm.Variable(np.int64(40))
    manager = CheckpointManager({"g": global_step}, tmp_path, max_to_keep=3)
    assert manager.save(checkpoint_number=10).endswith("ckpt-10")
    assert manager.save(checkpoint_number=global_step).endswith("ckpt-40")
    assert manager.save(checkpoint_number=np.array(7)).endswith("ckpt-7")
    assert manager.save(checkpoint_number=10).endswith("ckpt-10")
    assert _names(manager.checkpoints) == ["ckpt-40", "ckpt-7", "ckpt-10"]
    assert manager.save_counter == 4
    manager.save()  # the save counter: 5
    assert _listing(tmp_path) == [STATE, "ckpt-10", "ckpt-5", "ckpt-7"]


def test_restore_or_initialize_restores_the_latest_or_calls_init_fn(tmp_path):
    w = _variables(strategy(2))
    calls = []
    manager = CheckpointManager({"w": w}, tmp_path, max_to_keep=1,
                                init_fn=lambda: calls.append(w.assign(np.ones(3, np.float32))))
    assert manager.restore_or_initialize() is None and len(calls) == 1
    assert w.numpy().tolist() == [1.0] * 3
    plain = CheckpointManager({"w": w}, tmp_path / "plain", max_to_keep=1)
    assert plain.restore_or_initialize() is None  # nothing to restore, nothing to call
    with pytest.raises(FileNotFoundError, match=r"CheckpointManager\.restore: there is no "
                                                r"checkpoint in .*save one first"):
        plain.restore()
    w.assign(np.full(3, 5.0, np.float32))
    path = manager.save()
    w.assign(np.zeros(3, np.float32))
    again = CheckpointManager({"w": w}, tmp_path, max_to_keep=1, init_fn=lambda: calls.append(1))
    assert again.restore_or_initialize() == path and len(calls) == 1
    assert w.numpy().tolist() == [5.0] * 3 and again.save_counter == 1


def test_a_new_manager_takes_back_the_directorys_checkpoints(tmp_path):
    w = _variables(strategy(2))
    manager = CheckpointManager({"w": w}, tmp_path, max_to_keep=2)
    for i in range(1, 4):
        w.assign(np.full(3, i, np.float32))
        manager.save()
    again = CheckpointManager({"w": w}, str(tmp_path), max_to_keep=2)
    assert again.checkpoints == manager.checkpoints
    assert again.latest_checkpoint == manager.latest_checkpoint
    assert again.save_counter == 0  # as TF: the counter comes back with a restore
    w.assign(np.zeros(3, np.float32))
    again.restore_or_initialize()
    assert again.save_counter == 3 and w.numpy().tolist() == [3.0] * 3
    again.save()
    assert _listing(tmp_path) == [STATE, "ckpt-3", "ckpt-4"]


def test_a_missing_stale_or_broken_state_file_is_reconciled_with_the_directory(tmp_path):
    w = _variables(strategy(2))
    manager = CheckpointManager({"w": w}, tmp_path, max_to_keep=None)
    for _ in range(3):
        manager.save()
    os.makedirs(tmp_path / "ckpt-9")  # not a checkpoint: ignored
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / STATE).unlink()
    missing = CheckpointManager({"w": w}, tmp_path, max_to_keep=None)
    assert _names(missing.checkpoints) == ["ckpt-1", "ckpt-2", "ckpt-3"]
    # A state file listing a deleted checkpoint, and missing one saved after it was written.
    stale = {"latest": "ckpt-5", "last_preserved_timestamp": 0.0, "preserved": [],
             "checkpoints": [{"path": "ckpt-2", "timestamp": 1.0},
                             {"path": "ckpt-5", "timestamp": 2.0}]}
    (tmp_path / STATE).write_text(json.dumps(stale))
    reconciled = CheckpointManager({"w": w}, tmp_path, max_to_keep=None)
    assert _names(reconciled.checkpoints) == ["ckpt-2", "ckpt-1", "ckpt-3"]
    assert reconciled.latest_checkpoint == str(tmp_path / "ckpt-3")
    (tmp_path / STATE).write_text("{not json")
    with pytest.warns(UserWarning, match="is not a state file"):
        broken = CheckpointManager({"w": w}, tmp_path, max_to_keep=2)
    assert _names(broken.checkpoints) == ["ckpt-1", "ckpt-2", "ckpt-3"]
    broken.save(checkpoint_number=4)
    assert _listing(tmp_path) == [STATE, "ckpt-3", "ckpt-4", "ckpt-9", "notes.txt"]


def test_a_checkpoint_saved_again_after_the_state_was_written_is_the_newest(tmp_path):
    w = _variables(strategy(2))
    manager = CheckpointManager({"w": w}, tmp_path, max_to_keep=None)
    for i in (1, 2):
        w.assign(np.full(3, i, np.float32))
        manager.save()
    state = (tmp_path / STATE).read_text()
    w.assign(np.full(3, 7.0, np.float32))
    manager.save(checkpoint_number=1)
    (tmp_path / STATE).write_text(state)  # as if killed before the state was recorded
    again = CheckpointManager({"w": w}, tmp_path, max_to_keep=None)
    assert _names(again.checkpoints) == ["ckpt-2", "ckpt-1"]
    w.assign(np.zeros(3, np.float32))
    again.restore_or_initialize()
    assert w.numpy().tolist() == [7.0] * 3


def test_a_save_killed_between_its_two_renames_is_repaired_by_a_new_manager(tmp_path):
    w = _variables(strategy(2))
    manager = CheckpointManager({"w": w}, tmp_path, max_to_keep=2)
    for i in (1, 2):
        w.assign(np.full(3, i, np.float32))
        manager.save()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a process that no longer runs: the killed save's
    # Where the two-rename fallback of a save replacing ckpt-2 leaves it when killed.
    os.rename(tmp_path / "ckpt-2", tmp_path / f".ckpt-2.jaxmirror-old-{gone.pid}-0123abcd")
    again = CheckpointManager({"w": w}, tmp_path, max_to_keep=2)
    assert _names(again.checkpoints) == ["ckpt-1", "ckpt-2"]
    assert _listing(tmp_path) == [STATE, "ckpt-1", "ckpt-2"]
    w.assign(np.zeros(3, np.float32))
    again.restore_or_initialize()
    assert w.numpy().tolist() == [2.0] * 3
    # A state file write killed before its rename: deleted by the next save.
    (tmp_path / f".{STATE}.jaxmirror-new-{gone.pid}-89abcdef").write_text("{")
    again.save()
    assert _listing(tmp_path) == [STATE, "ckpt-2", "ckpt-3"]


class Counter(Checkpointable):
    def __init__(self):
        self.n = 0

    def checkpoint_state(self):
        return np.array([self.n], np.int64)

    def restore_checkpoint_state(self, state):
        self.n = int(state[0])


def test_tracked_items_are_saved_and_restored_beside_the_tree(tmp_path):
    s = strategy(2)
    with s.scope():
        w, steps = jm.Variable(np.ones(2, np.float32)), jm.Variable(3)
    counter = Counter()
    counter.n = 11
    manager = CheckpointManager({"w": w}, tmp_path, max_to_keep=1)
    manager.track("steps", steps)
    manager.track("run-calls_2", counter)
    manager.save()
    w.assign(np.zeros(2, np.float32))
    steps.assign(0)
    counter.n = 0
    assert manager.restore()["w"] is w
    assert (w.numpy().tolist(), int(steps.numpy()), counter.n) == ([1.0, 1.0], 3, 11)
    # Items this manager does not track are ignored; tracked items the file lacks keep values.
    other_steps, fresh = jm.Variable(5), Counter()
    fresh.n = 4
    untracked = CheckpointManager({"w": w}, tmp_path, max_to_keep=1)
    untracked.track("steps", other_steps)
    untracked.track("never_saved", fresh)
    w.assign(np.zeros(2, np.float32))
    untracked.restore_or_initialize()
    assert (w.numpy().tolist(), int(other_steps.numpy()), fresh.n) == ([1.0, 1.0], 3, 4)


def test_nnx_model_and_optimizer_are_restored_in_place(tmp_path):
    s = strategy(2)

    def build(seed):
        model = s.init(lambda: nnx.Linear(3, 2, rngs=nnx.Rngs(seed)))
        return model, s.init(lambda: nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param))

    model, opt = build(0)

    @s.run
    def train(model, opt, x):
        grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
        opt.update(model, jm.get_replica_context().all_reduce("mean", grads))

    train(model, opt, np.ones((4, 3), np.float32))
    manager = CheckpointManager({"model": model, "opt": opt}, tmp_path, max_to_keep=2)
    manager.save()
    saved = jax.tree.map(np.asarray, (nnx.state(model), nnx.state(opt)))
    other, other_opt = build(1)
    again = CheckpointManager({"model": other, "opt": other_opt}, tmp_path, max_to_keep=2)
    again.restore_or_initialize()
    restored = jax.tree.map(np.asarray, (nnx.state(other), nnx.state(other_opt)))
    assert jax.tree.structure(restored) == jax.tree.structure(saved)
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(restored)):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    assert again.checkpoint["model"] is other and other.kernel[...].sharding.is_fully_replicated


BAD = [
    (dict(directory=3), TypeError, "`directory` must be a str or os.PathLike"),
    (dict(max_to_keep=0), ValueError, "`max_to_keep` must be a positive int or None, got 0"),
    (dict(max_to_keep=-1), ValueError, "`max_to_keep` must be a positive int"),
    (dict(max_to_keep=True), ValueError, "`max_to_keep` must be a positive int"),
    (dict(keep_checkpoint_every_n_hours=0), ValueError, "keep_checkpoint_every_n_hours"),
    (dict(checkpoint_name="a/b"), ValueError, "`checkpoint_name` must be a file name"),
    (dict(checkpoint_name=".hidden"), ValueError, "`checkpoint_name` must be a file name"),
    (dict(checkpoint_interval=5), ValueError, "given without `step_counter` \\(TF's rule"),
    (dict(checkpoint_interval=0, step_counter=1), ValueError, "`checkpoint_interval` must be"),
    (dict(step_counter="0"), TypeError, "`step_counter` must be an int or a scalar"),
    (dict(step_counter=np.zeros(2)), TypeError, "`step_counter` must be an int or a scalar"),
    (dict(init_fn=3), TypeError, "`init_fn` must be callable"),
    (dict(checkpoint={"n": "text"}), TypeError, r"`checkpoint` holds a str at tree\['n'\], "
     "which a checkpoint cannot hold"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD)
def test_bad_arguments_are_refused_before_the_disk_is_touched(tmp_path, kwargs, error, message):
    args = {"checkpoint": {"w": 1.0}, "directory": tmp_path / "d", "max_to_keep": 2, **kwargs}
    with pytest.raises(error, match=f"^jaxmirror.checkpoint.CheckpointManager: .*{message}.*; "):
        CheckpointManager(**args)
    assert not os.path.exists(tmp_path / "d")


def test_bad_arguments_to_the_methods(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        CheckpointManager({"w": 1.0}, tmp_path / "file", max_to_keep=1)
    manager = CheckpointManager({"w": 1.0}, tmp_path / "d", max_to_keep=1)
    api = "jaxmirror.checkpoint.CheckpointManager"
    with pytest.raises(TypeError, match=f"{api}.save: `options` must be None.*no "
                                        f"CheckpointOptions"):
        manager.save(options=object())
    with pytest.raises(TypeError, match=f"{api}.save: `check_interval` must be a bool"):
        manager.save(check_interval="no")
    with pytest.raises(TypeError, match=f"{api}.save: `checkpoint_number` must be an int"):
        manager.save(checkpoint_number="3")
    with pytest.raises(ValueError, match=f"{api}.track: 'checkpoint' is the manager's own"):
        manager.track("checkpoint", jm.Variable(1))
    with pytest.raises(ValueError, match=f"{api}.track: `name` must be a str of letters"):
        manager.track("a.b", jm.Variable(1))
    manager.track("n", jm.Variable(1))
    with pytest.raises(ValueError, match="'n' is tracked already; give another name"):
        manager.track("n", jm.Variable(2))
    with pytest.raises(TypeError, match=r"holds a ndarray at tree, which a restore cannot "
                                        r"update in place"):
        manager.track("array", np.zeros(2))
    assert not os.path.exists(tmp_path / "d")
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        manager.restore(tmp_path / "nowhere")
    jm.checkpoint.save(tmp_path / "foreign", {"w": 1.0})
    with pytest.raises(ValueError, match=f"{api}.restore: .* is not a checkpoint a "
                                         f"CheckpointManager saved"):
        manager.restore(tmp_path / "foreign")


# -- killed saves, and several workers -------------------------------------------------------
WORKER = textwrap.dedent("""
    import json, os, signal, sys
    import numpy as np
    import orbax.checkpoint as ocp
    import jaxmirror as jm
    from jaxmirror.variables import checkpoint as ckpt, checkpoint_files as files
    from jaxmirror.variables import checkpoint_manager_files as mfiles

    directory, hook, saves = sys.argv[1], sys.argv[2], int(sys.argv[3])
    me = int(os.environ.get("JAXMIRROR_LAUNCH_WORKER_INDEX", "0"))
    restart = int(os.environ.get("JAXMIRROR_LAUNCH_RESTART", "0"))
    if "JAXMIRROR_LAUNCH_WORKER_INDEX" in os.environ:
        strategy = jm.MultiWorkerMirroredStrategy()
    else:
        strategy = jm.MirroredStrategy(["CPU:0"])
    with strategy.scope():
        w = jm.Variable(np.zeros(5, np.float32))
        total = jm.Variable(0.0, synchronization="on_read", aggregation="sum")
        runs = jm.Variable(0)

    def manager():
        made = jm.checkpoint.CheckpointManager({"w": w, "total": total}, directory, 2)
        made.track("runs", runs)
        return made

    def show(what, m, **more):
        print(what, json.dumps({"checkpoints": [os.path.basename(p) for p in m.checkpoints],
                                "counter": m.save_counter, **more}), flush=True)

    def die(*args, **kwargs):
        print("dying at", hook, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def arm():
        if hook == "before-save":
            ckpt.save = die
        elif hook == "mid-write":
            ocp.PyTreeCheckpointHandler.finalize = die
        elif hook == "before-state":
            mfiles.write_state = die
        elif hook == "while-deleting":
            def discard(path, p):  # the first old checkpoint renamed aside, then killed
                if p == path:
                    os.rename(p, files.sibling(path, "del"))
                    die()
            files.discard = discard

    m = manager()
    m.restore_or_initialize()
    show("start", m)
    first = m.save_counter + 1
    for i in range(first, first + (saves if restart == 0 else 1)):
        if restart == 0 and i == first + saves - 1 and me == 0:
            arm()
        strategy.run(lambda: w.assign(np.arange(5, dtype=np.float32) * i + 0.125))
        strategy.run(lambda: total.assign(i / strategy.num_replicas_in_sync))
        runs.assign(10 * i)
        m.save()
        # The state includes the chief's timestamps: the same everywhere only if agreed.
        show("saved", m, latest=os.path.basename(m.latest_checkpoint), state=m.state_record)
    w.assign(np.zeros(5, np.float32))
    again = manager()
    again.restore_or_initialize()
    show("restored", again, w=w.numpy().tolist(), total=float(total.numpy()),
         runs=int(runs.numpy()))
""")


def _values(i):
    return {"w": (np.arange(5, dtype=np.float32) * i + 0.125).tolist(), "total": float(i),
            "runs": 10 * i}


def _lines(out, what):
    """The JSON each worker printed after ``what``, by worker (``0`` in one process)."""
    found = {}
    for line in out.splitlines():
        worker = 0
        if line.startswith("[worker "):
            prefix, _, line = line.partition("] ")
            worker = int(prefix[len("[worker "):])
        if line.startswith(what + " {"):
            found.setdefault(worker, []).append(json.loads(line[len(what) + 1:]))
    return found


def _run(tmp_path, hook, saves, workers=0, devices=1, restarts=0):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    args = [str(script), str(tmp_path / "ckpts"), hook, str(saves)]
    if workers:
        args = ["-m", "jaxmirror.launch", "--workers", str(workers), "--devices-per-worker",
                str(devices), "--timeout", "100", "--max-restarts", str(restarts)] + args
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable] + args, stdout=subprocess.PIPE, env=env, text=True,
                          stderr=subprocess.STDOUT, timeout=150)
    return done.returncode, done.stdout


def _restored_here(directory):
    """A manager made in this process on ``directory``: its checkpoints and restored values."""
    s = strategy(2)
    with s.scope():
        w = jm.Variable(np.zeros(5, np.float32))
        total = jm.Variable(0.0, synchronization="on_read", aggregation="sum")
        runs = jm.Variable(0)
    manager = CheckpointManager({"w": w, "total": total}, directory, max_to_keep=2)
    manager.track("runs", runs)
    manager.restore_or_initialize()
    got = {"w": w.numpy().tolist(), "total": float(total.numpy()), "runs": int(runs.numpy())}
    return manager, got


# Where the third save of one process is killed, which checkpoints a new manager then finds,
# and what the killed save left beside them.
KILLS = [("before-save", ["ckpt-1", "ckpt-2"], None),
         ("mid-write", ["ckpt-1", "ckpt-2"], ".ckpt-3.jaxmirror-new-"),  # orbax's tmp directory
         ("before-state", ["ckpt-1", "ckpt-2", "ckpt-3"], None),
         ("while-deleting", ["ckpt-2", "ckpt-3"], ".ckpt-1.jaxmirror-del-")]


@pytest.mark.parametrize("hook,found,left", KILLS)
def test_a_save_killed_at_any_point_leaves_the_newest_complete_checkpoint(tmp_path, hook, found,
                                                                          left):
    code, out = _run(tmp_path, hook, saves=3)
    assert code == -9 and f"dying at {hook}" in out, out[-3000:]
    assert len(_lines(out, "saved")[0]) == 2
    hidden = [e for e in _listing(tmp_path / "ckpts") if e.startswith(".")]
    assert [e.startswith(left) for e in hidden] == ([True] if left else [])
    manager, got = _restored_here(tmp_path / "ckpts")
    assert _names(manager.checkpoints) == found
    assert got == _values(int(found[-1][-1]))
    assert manager.save_counter == int(found[-1][-1])
    manager.save()  # the next save deletes the old ones and what the killed save left
    n = manager.save_counter
    assert _listing(tmp_path / "ckpts") == [STATE, f"ckpt-{n - 1}", f"ckpt-{n}"]


@pytest.mark.parametrize("devices", [1, 2])
def test_workers_agree_on_every_decision_of_the_manager(tmp_path, devices):
    code, out = _run(tmp_path, "none", saves=4, workers=2, devices=devices)
    assert code == 0, out[-5000:]
    saved, restored = _lines(out, "saved"), _lines(out, "restored")
    assert saved[0] == saved[1] and len(saved[0]) == 4
    assert [s["checkpoints"] for s in saved[0]] == [
        ["ckpt-1"], ["ckpt-1", "ckpt-2"], ["ckpt-2", "ckpt-3"], ["ckpt-3", "ckpt-4"]]
    assert [[e["path"] for e in s["state"]["checkpoints"]] for s in saved[0]] == [
        s["checkpoints"] for s in saved[0]]
    assert restored[0] == restored[1] == [{"checkpoints": ["ckpt-3", "ckpt-4"], "counter": 4,
                                           **_values(4)}]
    assert _listing(tmp_path / "ckpts") == [STATE, "ckpt-3", "ckpt-4"]
    manager, got = _restored_here(tmp_path / "ckpts")
    assert got == _values(4) and _names(manager.checkpoints) == ["ckpt-3", "ckpt-4"]


def test_a_chief_killed_while_saving_is_relaunched_and_restores_the_newest(tmp_path):
    code, out = _run(tmp_path, "before-state", saves=3, workers=2, restarts=1)
    assert code == 0, out[-5000:]
    assert "dying at before-state" in out and "worker 0 was killed by SIGKILL" in out
    start = _lines(out, "start")
    # First launch: nothing; relaunch: the third checkpoint, written before the chief died.
    assert start[0] == start[1] == [{"checkpoints": [], "counter": 0},
                                    {"checkpoints": ["ckpt-1", "ckpt-2", "ckpt-3"],
                                     "counter": 3}]
    restored = _lines(out, "restored")
    assert restored[0] == restored[1] == [{"checkpoints": ["ckpt-3", "ckpt-4"], "counter": 4,
                                           **_values(4)}]
    assert _listing(tmp_path / "ckpts") == [STATE, "ckpt-3", "ckpt-4"]


def test_an_nnx_optimizers_step_is_a_step_counter(tmp_path):
    # TF's `step_counter=optimizer.iterations`: read at each save, not a snapshot.
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    manager = jm.checkpoint.CheckpointManager(
        {"model": model, "optimizer": optimizer}, tmp_path, max_to_keep=None,
        step_counter=optimizer.step, checkpoint_interval=2)
    saved = []
    for _ in range(6):
        grads = nnx.grad(lambda m: (m(jnp.ones((1, 2))) ** 2).sum())(model)
        optimizer.update(model, grads)
        saved.append(manager.save() is not None)
    assert saved == [True, False, True, False, True, False]
    assert int(optimizer.step.get_value()) == 6
