"""TF's failure handling: ``PreemptionCheckpointHandler`` and ``TerminationConfig``.

When a machine is taken away (a spot instance, maintenance), its worker gets SIGTERM. The
handler makes every worker save a checkpoint at the same step and exit with a code a launcher
restarts on (42, TF's default; ``python -m jaxmirror.launch --max-restarts N``); the restarted
run restores it and continues from that step. Across workers the step is agreed by JAX's
preemption service (``jax.distributed`` starts it; it catches SIGTERM): every ``run`` asks it
whether this step is the one where all save. In one process the handler catches SIGTERM
itself. A step that raises on one worker is reported to the others at once (TF's error
propagation), before it is raised here.

Example:
    >>> import os, tempfile, numpy as np, jaxmirror
    >>> from jaxmirror import checkpoint
    >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
    >>> with s.scope():
    ...     w = jaxmirror.Variable(0.0)
    >>> folder = tempfile.mkdtemp()
    >>> handler = jaxmirror.experimental.PreemptionCheckpointHandler(
    ...     None, {"w": w}, checkpoint_dir=folder)
    >>> for _ in range(3):
    ...     _ = handler.run(s.run, lambda: w.assign_add(1.0))
    >>> handler.total_run_calls, float(w.numpy())
    (3, 3.0)
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import warnings

import numpy as np

from jaxmirror.cluster_resolver.base import ClusterResolver
from jaxmirror.core import _compat
from jaxmirror.core.checkpointable import Checkpointable
from jaxmirror.data import iterators
from jaxmirror.runtime import failures, ledger
from jaxmirror.variables.checkpoint_manager import CheckpointManager

RESTART_CODE = 42  # TF's exit code after a preemption save (its default exit_fn)
_POLL_S = 1.0  # how often a termination_watcher_fn is asked (TF's period)
_NOTICE_DELAY_S = 2.0  # from a SIGTERM to the step JAX's preemption service agrees on, at most
_RUN_CALLS = "preemption_checkpoint_handler_run_calls"  # its name in the checkpoint
_API = "PreemptionCheckpointHandler"


def _default_exit() -> None:
    sys.exit(RESTART_CODE)


class TerminationConfig:
    """How a ``PreemptionCheckpointHandler`` learns of a termination and ends the program
    (``tf.distribute.experimental.TerminationConfig``).

    Args:
        termination_watcher_fn: a function returning True once a termination notice is
            available (asked every second on a thread; it must not block). ``None``: SIGTERM
            is the notice.
        exit_fn: called after the preemption checkpoint is saved; ``None``: ``sys.exit(42)``.
        grace_period: seconds between the notice and the termination. As in TF, with a
            grace period the workers save at once, train on, and save again and exit six
            steps' time (and one save's) before it ends; ``None`` or 0: save and exit at the
            first step all workers can reach.
        save_fn: saves the preemption checkpoint instead of the checkpoint manager's
            ``save()``; called with no arguments (by default the manager saves with
            ``check_interval=False``: a preemption checkpoint ignores the interval).

    Raises:
        TypeError: for a non-callable function or a non-number ``grace_period``.
        ValueError: for a negative ``grace_period``.

    Example:
        >>> config = TerminationConfig(exit_fn=lambda: None, grace_period=30)
        >>> config.grace_period
        30
    """

    def __init__(self, termination_watcher_fn=None, exit_fn=None, grace_period=None,
                 save_fn=None):
        for name, fn in (("termination_watcher_fn", termination_watcher_fn),
                         ("exit_fn", exit_fn), ("save_fn", save_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"jaxmirror.experimental.TerminationConfig: `{name}` must be a "
                                f"function or None; got {type(fn).__name__} {fn!r}.")
        if grace_period is not None:
            if isinstance(grace_period, bool) or not isinstance(grace_period, (int, float)):
                raise TypeError(f"jaxmirror.experimental.TerminationConfig: `grace_period` must "
                                f"be a number of seconds or None; got "
                                f"{type(grace_period).__name__} {grace_period!r}.")
            if not 0 <= grace_period < float("inf"):
                raise ValueError(f"jaxmirror.experimental.TerminationConfig: `grace_period` must "
                                 f"be a finite number of seconds >= 0, got {grace_period!r}; "
                                 f"give the time between the notice and the end, or None.")
        self.termination_watcher_fn = termination_watcher_fn
        self.exit_fn = exit_fn
        self.grace_period = grace_period
        self.save_fn = save_fn


class _RunCalls(Checkpointable):
    """The handler's count of ``run`` calls, saved with the checkpoint (TF's
    ``checkpointed_runs``): a restarted run continues counting where the save was."""

    def __init__(self):
        self.count = 0

    def checkpoint_state(self) -> np.ndarray:
        return np.array(self.count, np.int64)

    def checkpoint_shape_dtype(self) -> tuple:
        return (), np.dtype(np.int64)

    def restore_checkpoint_state(self, state) -> None:
        self.count = int(np.asarray(state))


class PreemptionCheckpointHandler:
    """Save at the same step on every worker when one is about to be preempted, then exit;
    restore on restart (``tf.distribute.experimental.PreemptionCheckpointHandler``).

    Built, it restores the latest checkpoint (the model's variables, NNX objects, distributed
    iterators in the tree, and ``total_run_calls``). Then call each training step through
    ``run``. When any worker gets SIGTERM (or ``termination_watcher_fn`` says so), every worker
    saves at the same ``run`` call, before its step runs, and calls ``exit_fn`` (``sys.exit(42)``
    by default). An iterator in the checkpoint is saved before the element passed to that call,
    so ``handler.run(step, next(iterator))`` loses no batch (with TF's iterator per epoch, put
    the distributed dataset in the checkpoint instead). Build it on every worker, after the
    model and the iterator.

    Args:
        cluster_resolver: the strategy's ``cluster_resolver`` (or ``None`` in one process).
        checkpoint_or_checkpoint_manager: a ``jaxmirror.checkpoint.CheckpointManager``, or the
            tree to checkpoint (what ``jaxmirror.checkpoint.save`` takes), then managed in
            ``checkpoint_dir`` with ``max_to_keep=1``.
        checkpoint_dir: where to keep checkpoints of a tree; ``None`` with a manager.
        termination_config: a ``TerminationConfig``; ``None``: SIGTERM, exit 42, no grace.

    Raises:
        TypeError: for arguments of the wrong kinds.
        ValueError: for a tree without ``checkpoint_dir``, or a manager with one, or several
            workers without JAX's preemption service.

    Example:
        >>> import tempfile, jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with s.scope():
        ...     step = jaxmirror.Variable(0)
        >>> manager = jaxmirror.checkpoint.CheckpointManager(
        ...     {"step": step}, tempfile.mkdtemp(), max_to_keep=2)
        >>> handler = jaxmirror.experimental.PreemptionCheckpointHandler(None, manager)
        >>> _ = handler.run(s.run, lambda: step.assign_add(1))
        >>> handler.total_run_calls, int(step.numpy())
        (1, 1)
    """

    def __init__(self, cluster_resolver, checkpoint_or_checkpoint_manager, checkpoint_dir=None,
                 termination_config=None):
        if cluster_resolver is not None and not isinstance(cluster_resolver, ClusterResolver):
            raise TypeError(f"{_API}: `cluster_resolver` must be a jaxmirror ClusterResolver or "
                            f"None, got {type(cluster_resolver).__name__}; pass the strategy's "
                            f"`cluster_resolver`.")
        config = termination_config if termination_config is not None else TerminationConfig()
        if not isinstance(config, TerminationConfig):
            raise TypeError(f"{_API}: `termination_config` must be a jaxmirror.experimental."
                            f"TerminationConfig or None; got {type(config).__name__}.")
        self._manager = _manager_for(checkpoint_or_checkpoint_manager, checkpoint_dir)
        self._several = _several_workers()
        if self._several and not _compat.preemption_service_running():
            raise ValueError(f"{_API}: with several workers the handler needs JAX's preemption "
                             f"service, which is off; leave jax_enable_preemption_service on "
                             f"(its default) before the strategy is made.")
        self._exit_fn = config.exit_fn or _default_exit
        self._save_fn = config.save_fn
        self._grace = float(config.grace_period or 0)
        self._calls = _RunCalls()
        try:
            self._manager.track(_RUN_CALLS, self._calls)
        except ValueError:
            raise ValueError(f"{_API}: another PreemptionCheckpointHandler already uses this "
                             f"CheckpointManager; make one handler per manager.") from None
        self._manager.restore_or_initialize()
        self._notice = threading.Event()  # this process was told it will end (one process)
        self._checks = 0  # calls checked here, from 0 on every worker (JAX's counter)
        self._final = None  # the check to save at and exit, once agreed; -1 once done
        self._last_check = None  # when the last check was (the time between calls)
        self._interval = 0.0  # the average time from one call to the next
        self._stop = threading.Event()
        if config.termination_watcher_fn is not None:
            threading.Thread(target=self._poll, args=(config.termination_watcher_fn,),
                             name="jaxmirror-termination-watcher", daemon=True).start()
        elif not self._several:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, self._on_sigterm)
            else:
                warnings.warn(f"{_API}: made off the main thread, where Python cannot catch "
                              f"SIGTERM, so this handler will not see one; make it on the main "
                              f"thread, or give TerminationConfig(termination_watcher_fn=...).",
                              RuntimeWarning, stacklevel=2)

    @property
    def total_run_calls(self) -> int:
        """How many ``run`` (or ``save_checkpoint_if_preempted``) calls this training has
        made, restored calls included: the step to continue from."""
        return self._calls.count

    def run(self, distributed_train_function, *args, **kwargs):
        """Run one training step, saving and exiting first if this is the agreed step.

        An iterator in the checkpoint that gave one of the arguments (``next(iterator)``,
        ``get_next_as_optional()``) as its last element is saved without it, so the batch of a
        step that a preemption stops is trained after the restart; one element per iterator
        and call.

        Args:
            distributed_train_function: one step (typically calling ``strategy.run``).
            *args: its arguments (e.g. ``next(iterator)``).
            **kwargs: its keyword arguments.

        Returns:
            What ``distributed_train_function`` returns.

        Raises:
            Whatever the step raises, after telling the other workers.
        """
        self._check(args + tuple(kwargs.values()), ())
        with self.watch_preemption_scope():
            result = distributed_train_function(*args, **kwargs)
        self._calls.count += 1
        return result

    def save_checkpoint_if_preempted(self, *args, **kwargs) -> None:
        """For loops that do not call ``run``: call once per step, after it; saves and exits
        at the agreed step. Counts as a call of ``run`` (counted before the save: the step
        before it is in the checkpoint).

        Args:
            *args: passed to the checkpoint manager's ``save``.
            **kwargs: passed to the checkpoint manager's ``save``.
        """
        self._calls.count += 1
        self._check((), (args, kwargs))

    @contextlib.contextmanager
    def watch_preemption_scope(self):
        """Inside, an error is reported to every worker before it is raised here (TF's error
        propagation), so the others end at once, naming this worker. ``StopIteration`` (the
        end of the data, agreed by every worker) passes through as it is.

        Example:
            >>> import tempfile, jaxmirror
            >>> handler = jaxmirror.experimental.PreemptionCheckpointHandler(
            ...     None, {"n": 0}, checkpoint_dir=tempfile.mkdtemp())
            >>> with handler.watch_preemption_scope():
            ...     pass
        """
        try:
            yield
        except (StopIteration, GeneratorExit):
            raise
        except Exception as error:  # noqa: BLE001 - reported, then raised as it was
            shown = failures.note_and_report(error)
            if shown is not error:
                raise shown from error
            raise

    # -- the agreed step --------------------------------------------------------------------------
    def _on_sigterm(self, signum, frame) -> None:
        if self._notice.is_set():  # a second SIGTERM: end now, as without a handler
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        self._notice.set()

    def _poll(self, watcher_fn) -> None:
        while not self._stop.wait(_POLL_S):
            if watcher_fn():
                self._notice.set()
                if self._several:  # the notice goes to JAX's preemption service
                    os.kill(os.getpid(), signal.SIGTERM)
                return

    def _check(self, unused_args, save_args) -> None:
        """At each call: has a preemption been agreed on? Save (and exit) where it says."""
        now = time.monotonic()
        if self._last_check is not None:
            n = min(self._checks, 100)
            self._interval += (now - self._last_check - self._interval) / n
        self._last_check = now
        check, self._checks = self._checks, self._checks + 1
        if self._final is None:
            if self._several:
                reached = _compat.reached_preemption_sync_point(check)
            else:
                reached = self._notice.is_set()
            if not reached:
                return
            then = "training on in the grace period" if self._grace > 0 else "then exiting"
            print(f"jaxmirror: preemption: saving a checkpoint at run call "
                  f"{self._calls.count}, {then}", file=sys.stderr, flush=True)
            self._final = check
            if self._grace > 0:  # TF's way: save now, train on, save again before the end
                self._save(unused_args, save_args)
                self._final = check + self._calls_of_grace(now)
                if self._final > check:
                    return
                self._finish()
                return
        if check == self._final:
            self._save(unused_args, save_args)
            self._finish()

    def _save(self, unused_args, save_args) -> None:
        with iterators.elements_not_used(unused_args):
            if self._save_fn is not None:
                self._save_fn()
                return
            args, kwargs = save_args or ((), {})
            # The preemption checkpoint is saved whatever the manager's interval says.
            kwargs = {"check_interval": False, **kwargs} if len(args) < 2 else kwargs
            self._manager.save(*args, **kwargs)

    def _finish(self) -> None:
        self._final = -1  # once: an exit_fn that returns lets training go on
        self._stop.set()
        failures.plan_exit()  # every worker exits here: an end, not a failure to report
        self._exit_fn()
        failures.plan_exit(False)

    def _calls_of_grace(self, noticed: float) -> int:
        """How many more calls every worker can make before the grace period ends, keeping
        the time of six calls and of one more save: agreed as the fewest across workers."""
        spent = time.monotonic() - noticed + (_NOTICE_DELAY_S if self._several else 0.0)
        left = self._grace - 2 * spent - 6 * self._interval  # spent: the first save's time too
        mine = int(left // self._interval) if self._interval > 0 and left > 0 else 0
        if self._several:
            return min(ledger.agree(f"{_API}: the step to save at", "", mine))
        return mine


def _several_workers() -> bool:
    return failures.joined() is not None


def _manager_for(checkpoint_or_manager, checkpoint_dir) -> CheckpointManager:
    if isinstance(checkpoint_or_manager, CheckpointManager):
        if checkpoint_dir is not None:
            raise ValueError(f"{_API}: `checkpoint_dir` ({checkpoint_dir!r}) is for a tree; "
                             f"a CheckpointManager already has its directory "
                             f"({checkpoint_or_manager.directory!r}): leave checkpoint_dir None.")
        return checkpoint_or_manager
    if checkpoint_dir is None:
        raise ValueError(f"{_API}: give `checkpoint_dir` with a tree to checkpoint (got "
                         f"{type(checkpoint_or_manager).__name__}), or pass a "
                         f"jaxmirror.checkpoint.CheckpointManager.")
    return CheckpointManager(checkpoint_or_manager, checkpoint_dir, max_to_keep=1)


__all__ = ["PreemptionCheckpointHandler", "RESTART_CODE", "TerminationConfig"]
