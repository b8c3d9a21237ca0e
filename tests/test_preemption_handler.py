"""``PreemptionCheckpointHandler`` and ``TerminationConfig`` in one process (issue 28): TF's
local mode, where the handler catches SIGTERM itself. Across workers (JAX's preemption
service) in ``tests/test_preemption.py``.
"""

import signal
import os
import time

import numpy as np
import pytest

import jaxmirror as jm
from conftest import strategy

pytestmark = pytest.mark.filterwarnings("ignore::jaxmirror.experimental.PaddedRowsWarning")
PHandler = jm.experimental.PreemptionCheckpointHandler
Config = jm.experimental.TerminationConfig
STEPS = 8


@pytest.fixture(autouse=True)
def sigterm_restored():
    old = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, old)


def _setup(s, directory, steps=STEPS, **config):
    return _setup_with_manager(s, directory, steps, **config)[:4]


def _setup_with_manager(s, directory, steps=STEPS, **config):
    """``_setup``'s variable, iterator, handler and step, and the manager given to the handler."""
    data = [np.full((4, 1), i, np.float32) for i in range(steps)]
    with s.scope():
        w = jm.Variable(0.0)
    iterator = iter(s.experimental_distribute_dataset(data))
    manager = jm.checkpoint.CheckpointManager({"w": w, "iterator": iterator}, directory,
                                              max_to_keep=2)
    handler = PHandler(None, manager, termination_config=Config(**config) if config else None)

    def replica_step(x):
        # w <- 0.5 w + mean(batch): the order of the batches shows in the result
        return w.assign(0.5 * w + jm.get_replica_context().all_reduce("sum", x.sum()) / 4.0)

    def step(batch):
        return s.run(replica_step, args=(batch,))

    return w, iterator, handler, step, manager


def _uninterrupted(steps=STEPS):
    w = 0.0
    for i in range(steps):
        w = np.float32(0.5) * np.float32(w) + np.float32(i)
    return w


def test_sigterm_in_one_process_saves_before_the_next_step_and_exits_42(tmp_path):
    s = strategy(2)
    w, iterator, handler, step = _setup(s, tmp_path / "ck")
    assert handler.total_run_calls == 0
    for _ in range(3):
        handler.run(step, next(iterator))
    os.kill(os.getpid(), signal.SIGTERM)
    pending = next(iterator)
    with pytest.raises(SystemExit) as exit_info:
        handler.run(step, pending)  # saved before this step, which does not run
    assert exit_info.value.code == 42
    assert handler.total_run_calls == 3
    saved_w = float(w.numpy())
    # A new run: the handler restores the variable, the iterator (at the batch that was
    # pending) and the count of calls, and finishes with the uninterrupted result.
    w2, iterator2, handler2, step2 = _setup(s, tmp_path / "ck")
    assert handler2.total_run_calls == 3 and float(w2.numpy()) == saved_w
    while handler2.total_run_calls < STEPS:
        handler2.run(step2, next(iterator2))
    assert float(w2.numpy()) == _uninterrupted()
    with pytest.raises(StopIteration):
        next(iterator2)


def test_a_termination_watcher_and_an_exit_fn_that_returns(tmp_path):
    s = strategy(2)
    notice, exits = [], []
    steps = 200
    w, iterator, handler, step = _setup(
        s, tmp_path / "ck", steps, termination_watcher_fn=lambda: bool(notice),
        exit_fn=lambda: exits.append(handler.total_run_calls))
    handler.run(step, next(iterator))
    notice.append(True)
    deadline = time.monotonic() + 60
    while not exits and time.monotonic() < deadline and handler.total_run_calls < steps:
        handler.run(step, next(iterator))
        time.sleep(0.05)
    (at,) = exits  # polled every second; then saved at the next call, once
    assert 1 <= at < steps
    while handler.total_run_calls < steps:
        handler.run(step, next(iterator))
    assert exits == [at] and float(w.numpy()) == _uninterrupted(steps)
    restored = _setup(s, tmp_path / "ck", steps)
    assert restored[2].total_run_calls == at


def test_save_fn_replaces_the_managers_save_and_save_checkpoint_if_preempted_counts(tmp_path):
    s = strategy(2)
    saved = []
    w, iterator, handler, step, manager = _setup_with_manager(
        s, tmp_path / "ck", save_fn=lambda: saved.append(1), exit_fn=lambda: None)
    for _ in range(2):
        step(next(iterator))
        handler.save_checkpoint_if_preempted()
    assert handler.total_run_calls == 2
    os.kill(os.getpid(), signal.SIGTERM)
    step(next(iterator))
    handler.save_checkpoint_if_preempted()
    assert saved == [1] and handler.total_run_calls == 3
    assert manager.latest_checkpoint is None  # save_fn saved instead


def test_save_checkpoint_if_preempted_saves_the_step_just_made(tmp_path):
    s = strategy(2)
    w, iterator, handler, step = _setup(s, tmp_path / "ck")
    for k in range(3):
        step(next(iterator))
        if k == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        try:
            handler.save_checkpoint_if_preempted()
        except SystemExit:
            break
    w2, iterator2, handler2, step2 = _setup(s, tmp_path / "ck")
    # Three steps in the checkpoint, and three counted: the restart does not train one twice.
    assert handler2.total_run_calls == 3 and float(w2.numpy()) == float(w.numpy())
    while handler2.total_run_calls < STEPS:
        step2(next(iterator2))
        handler2.save_checkpoint_if_preempted()
    assert float(w2.numpy()) == _uninterrupted()


def test_a_grace_period_saves_at_once_trains_on_and_saves_again_before_it_ends(tmp_path):
    s = strategy(2)
    exits, steps = [], 120
    w, iterator, handler, step, manager = _setup_with_manager(
        s, tmp_path / "ck", steps, grace_period=3.0,
        exit_fn=lambda: exits.append((handler.total_run_calls, time.monotonic())))
    for _ in range(2):
        handler.run(step, next(iterator))
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGTERM)
    noticed = time.monotonic()
    while not exits and handler.total_run_calls < steps:
        handler.run(step, next(iterator))
        if handler.total_run_calls == 3:  # saved at once, before the call after the notice
            assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-1"]
        time.sleep(0.05)
    ((at, when),) = exits
    # Trained on, then saved again and exited before the grace period ended.
    assert at > 3 and when - noticed < 3.0
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-1", "ckpt-2"]
    assert _setup(s, tmp_path / "ck", steps)[2].total_run_calls == at


def test_a_step_error_is_raised_as_it_was(tmp_path):
    s = strategy(2)
    w, iterator, handler, step = _setup(s, tmp_path / "ck")

    def failing(batch):
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        handler.run(failing, next(iterator))
    assert handler.total_run_calls == 0
    with pytest.raises(KeyError):
        with handler.watch_preemption_scope():
            raise KeyError("x")


def test_stop_iteration_passes_through_and_an_exit_fn_that_returns_plans_no_exit(tmp_path):
    from jaxmirror.runtime import failures

    s = strategy(2)
    w, iterator, handler, step, manager = _setup_with_manager(s, tmp_path / "ck",
                                                              exit_fn=lambda: None)
    with pytest.raises(StopIteration):
        handler.run(lambda: next(iter([])))
    os.kill(os.getpid(), signal.SIGTERM)
    handler.run(step, next(iterator))
    assert manager.latest_checkpoint is not None
    assert not failures.planned_exit()  # the exit function returned: training goes on


def test_an_optional_passed_to_run_is_not_lost(tmp_path):
    s = strategy(2)
    w, iterator, handler, step = _setup(s, tmp_path / "ck")
    handler.run(step, next(iterator))
    os.kill(os.getpid(), signal.SIGTERM)
    optional = iterator.get_next_as_optional()
    with pytest.raises(SystemExit):
        handler.run(lambda o: step(o.get_value()), optional)
    w2, iterator2, handler2, step2 = _setup(s, tmp_path / "ck")
    assert handler2.total_run_calls == 1
    first = next(iterator2)
    assert float(s.experimental_local_results(first)[0][0, 0]) == 1.0


def test_bad_arguments(tmp_path):
    manager = jm.checkpoint.CheckpointManager({"n": jm.Variable(0)}, tmp_path / "m",
                                              max_to_keep=1)
    with pytest.raises(ValueError, match="give `checkpoint_dir` with a tree"):
        PHandler(None, {"n": jm.Variable(0)})
    with pytest.raises(ValueError, match="leave checkpoint_dir None"):
        PHandler(None, manager, checkpoint_dir=str(tmp_path / "other"))
    with pytest.raises(TypeError, match="`cluster_resolver` must be a jaxmirror ClusterResolver"):
        PHandler("worker", manager)
    with pytest.raises(TypeError, match="`termination_config` must be"):
        PHandler(None, manager, termination_config={"exit_fn": None})
    with pytest.raises(TypeError, match="`exit_fn` must be a function"):
        Config(exit_fn=42)
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="`grace_period` must be a finite number"):
            Config(grace_period=bad)
    PHandler(None, manager)
    with pytest.raises(ValueError, match="another PreemptionCheckpointHandler already uses"):
        PHandler(None, manager)
    with pytest.raises(TypeError, match="`grace_period` must be a number"):
        Config(grace_period="1h")
