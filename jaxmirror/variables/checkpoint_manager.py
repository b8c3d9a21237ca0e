"""``jaxmirror.checkpoint.CheckpointManager``: TF's ``tf.train.CheckpointManager`` on the atomic
checkpoints of ``jaxmirror.checkpoint.save``.

Checkpoints are the directories ``<directory>/<checkpoint_name>-<N>``. The manager's state (the
active checkpoints, oldest first, with the times they were saved) is the JSON file
``<directory>/checkpoint_state.json``, replaced atomically. A new manager reads it and
reconciles it with the directory, so a save killed at any point loses at most that save. With
several workers the chief alone reads and writes the state and deletes old checkpoints; the
others learn its decisions through the ledger (``runtime/ledger.py``).
"""

from __future__ import annotations

import copy
import os
import re

import jax
import numpy as np
from flax import nnx

from jaxmirror.core import _compat, context
from jaxmirror.core.checkpointable import Checkpointable
from jaxmirror.runtime import ledger
from jaxmirror.variables import checkpoint as ckpt
from jaxmirror.variables import checkpoint_leaves as leaves
from jaxmirror.variables import checkpoint_manager_files as mfiles
from jaxmirror.variables import checkpoint_workers as workers
from jaxmirror.variables.handle import VariableHandle
from jaxmirror.variables.variable import Variable

_API = mfiles.API
_RESERVED = ("checkpoint", "save_counter")
# A step: a number, an array, a jaxmirror variable, or a flax NNX variable (an optimizer's
# `step`, TF's `optimizer.iterations`), read each time it is needed.
_NUMBERS = (int, float, np.integer, np.floating, jax.Array, np.ndarray, Variable, VariableHandle,
            nnx.Variable)


def _evaluate(x, what: str, api: str) -> int:
    """``x`` (a number, or a scalar variable or array) as an int."""
    if isinstance(x, nnx.Variable):
        value = x.get_value()
    else:
        value = x.read_value() if isinstance(x, (Variable, VariableHandle)) else x
    value = np.asarray(value) if isinstance(value, _NUMBERS) else None
    if (isinstance(x, bool) or value is None or value.shape != ()
            or value.dtype.kind not in "iuf"):
        raise TypeError(f"{api}: `{what}` must be an int or a scalar variable or array holding "
                        f"one, got {type(x).__name__} {x!r}; give an int or an integer "
                        f"jaxmirror.Variable.")
    return int(value)


def _shape_of(x) -> tuple:
    x = x.get_value() if isinstance(x, nnx.Variable) else x
    return tuple(getattr(x, "shape", ()))


def _check_args(directory, max_to_keep, hours, name, step_counter, interval, init_fn) -> None:
    def positive(x, kinds=(int, np.integer)):
        return not isinstance(x, bool) and isinstance(x, kinds) and x > 0
    checks = [
        (isinstance(directory, (str, os.PathLike)), TypeError, f"`directory` must be a str or "
         f"os.PathLike, got {directory!r}", "give the directory to keep checkpoints in"),
        (max_to_keep is None or positive(max_to_keep), ValueError, f"`max_to_keep` must be a "
         f"positive int or None, got {max_to_keep!r}", "give how many checkpoints to keep, or "
         "None to keep them all"),
        (hours is None or positive(hours, (int, float)), ValueError, f"`keep_checkpoint_every_"
         f"n_hours` must be a positive number or None, got {hours!r}", "give the hours between "
         "checkpoints kept for good, or None"),
        (isinstance(name, str) and re.fullmatch(r"\w[\w.-]*", name, re.ASCII) is not None,
         ValueError, f"`checkpoint_name` must be a file name of letters, digits, '_', '-' and "
         f"'.', not starting with '.', got {name!r}", "give a name such as 'ckpt'"),
        (interval is None or positive(interval), ValueError, f"`checkpoint_interval` must be a "
         f"positive int or None, got {interval!r}", "give the steps between checkpoints"),
        (interval is None or step_counter is not None, ValueError, "`checkpoint_interval` was "
         "given without `step_counter` (TF's rule too)", "pass the step variable as "
         "`step_counter`"),
        (step_counter is None or (not isinstance(step_counter, bool) and isinstance(
            step_counter, _NUMBERS) and _shape_of(step_counter) == ()), TypeError,
         f"`step_counter` must be an int or a scalar variable or array, got "
         f"{type(step_counter).__name__} {step_counter!r}", "give the step variable"),
        (init_fn is None or callable(init_fn), TypeError, f"`init_fn` must be callable or None, "
         f"got {type(init_fn).__name__}", "give a function that initializes the tree, or None"),
    ]
    for ok, kind, what, todo in checks:
        if not ok:
            raise kind(f"{_API}: {what}; {todo}.")


def _check_leaves(tree, api: str, what: str, in_place: bool = False) -> None:
    """Raise ``TypeError`` for a leaf a checkpoint cannot hold (or, ``in_place``, one that a
    restore cannot update in place)."""
    def opaque(x):
        return leaves.is_leaf(x) or isinstance(x, Checkpointable) or _compat.is_graph_node(x)
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=opaque)[0]:
        if in_place and not (isinstance(leaf, (Variable, VariableHandle, Checkpointable,
                                                nnx.Variable)) or _compat.is_graph_node(leaf)):
            raise TypeError(f"{api}: {what} holds a {type(leaf).__name__} at "
                            f"{leaves.where(path)}, which a restore cannot update in place; "
                            f"track a jaxmirror.Variable, a flax NNX object or a "
                            f"Checkpointable.")
        if _compat.is_graph_node(leaf) or isinstance(leaf, (Checkpointable, nnx.Variable)):
            continue
        try:
            leaves.target_shape_dtype(path, leaf)
        except TypeError:
            raise TypeError(f"{api}: {what} holds a {type(leaf).__name__} at "
                            f"{leaves.where(path)}, which a checkpoint cannot hold; give "
                            f"variables, flax NNX objects, arrays and numbers.") from None
        except ValueError as error:
            raise ValueError(f"{api}: {what} cannot be saved: {error}") from None


def _top_metadata(path: str, api: str) -> dict:
    """The checkpoint's tree of array metadata, by top-level key."""
    import orbax.checkpoint as ocp  # on first use, as jaxmirror.checkpoint does

    with ocp.PyTreeCheckpointer() as checkpointer:
        item = checkpointer.metadata(path).item_metadata
    tree = getattr(item, "tree", item)
    if not isinstance(tree, dict) or "checkpoint" not in tree:
        raise ValueError(f"{api}: {path!r} is not a checkpoint a CheckpointManager saved (it has "
                         f"no 'checkpoint' item); restore it with jaxmirror.checkpoint.restore.")
    return tree


class CheckpointManager:
    """Keeps the last ``max_to_keep`` checkpoints of a tree: TF's ``tf.train.CheckpointManager``.

    Each ``save`` writes ``<directory>/<checkpoint_name>-<N>`` with ``jaxmirror.checkpoint.save``
    (atomic, on every worker), records it in ``<directory>/checkpoint_state.json``, then deletes
    the oldest beyond ``max_to_keep``, keeping one every ``keep_checkpoint_every_n_hours`` for
    good. A checkpoint holds ``{"checkpoint": tree, "save_counter": N}`` and the items given to
    ``track``. A manager made on an existing directory takes its checkpoints back, even if a
    save was killed at any point (the newest complete checkpoint is the latest). Restore the
    latest with ``restore_or_initialize`` (TF's way) or ``restore``. With several workers every
    worker makes the manager and calls it in the same order, as in TF. As in TF, use one
    manager per directory (the state file is the directory's).

    Args:
        checkpoint: the tree to save, as ``jaxmirror.checkpoint.save`` takes it (variables,
            flax NNX objects, arrays, numbers). A restore updates its variables and NNX
            objects in place; arrays and numbers come back in ``restore``'s result.
        directory: where checkpoints go, a str or ``os.PathLike`` (made absolute).
        max_to_keep: how many checkpoints to keep, a positive int, or None for all.
        keep_checkpoint_every_n_hours: keep one checkpoint per this many hours for good
            (beside ``max_to_keep``), or None.
        checkpoint_name: the checkpoints' name before ``-<N>``.
        step_counter: the step (an integer variable or array, or an int), for
            ``checkpoint_interval``.
        checkpoint_interval: ``save`` skips saves less than this many steps after the last.
        init_fn: what ``restore_or_initialize`` calls when there is no checkpoint.

    Raises:
        ValueError, TypeError: for a bad argument (before anything touches the disk).

    Example:
        >>> import os, tempfile, jaxmirror
        >>> from jaxmirror import checkpoint
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with s.scope():
        ...     w = jaxmirror.Variable([0.0, 0.0])
        >>> directory = tempfile.mkdtemp()
        >>> manager = checkpoint.CheckpointManager({"w": w}, directory, max_to_keep=2)
        >>> for step in range(3):
        ...     _ = w.assign([step, step])
        ...     path = manager.save()
        >>> sorted(os.listdir(directory)), manager.save_counter
        (['checkpoint_state.json', 'ckpt-2', 'ckpt-3'], 3)
        >>> again = checkpoint.CheckpointManager({"w": w}, directory, max_to_keep=2)
        >>> _ = w.assign([9.0, 9.0])
        >>> again.restore_or_initialize() == path, w.numpy().tolist()
        (True, [2.0, 2.0])
    """

    def __init__(self, checkpoint, directory, max_to_keep, keep_checkpoint_every_n_hours=None,
                 checkpoint_name="ckpt", step_counter=None, checkpoint_interval=None,
                 init_fn=None):
        _check_args(directory, max_to_keep, keep_checkpoint_every_n_hours, checkpoint_name,
                    step_counter, checkpoint_interval, init_fn)
        _check_leaves(checkpoint, _API, "`checkpoint`")
        self._tree = checkpoint
        self._directory = os.path.abspath(os.fspath(directory))
        self._max_to_keep = max_to_keep
        self._hours = keep_checkpoint_every_n_hours
        self._name = checkpoint_name
        self._step_counter = step_counter
        self._interval = checkpoint_interval
        self._init_fn = init_fn
        self._last_checkpoint_step = None
        self._save_counter = 0
        self._tracked = {}
        call = f"{_API}.__init__"
        with ledger.named(call):
            self._state = workers.chief_decides(call, f"{self._directory} {checkpoint_name}",
                                         lambda: mfiles.recovered(self._directory, checkpoint_name))

    @property
    def directory(self) -> str:
        """The directory of the checkpoints (absolute)."""
        return self._directory

    @property
    def checkpoint(self):
        """The tree that ``save`` saves and ``restore`` restores into."""
        return self._tree

    @property
    def checkpoint_interval(self):
        """The fewest steps between two saves (``None``: no limit)."""
        return self._interval

    @property
    def checkpoints(self) -> list:
        """The paths of the checkpoints kept (not those kept for good), oldest first."""
        return [os.path.join(self._directory, e["path"]) for e in self._state["checkpoints"]]

    @property
    def latest_checkpoint(self):
        """The path of the newest checkpoint, or ``None``."""
        return (self.checkpoints or [None])[-1]

    @property
    def state_record(self) -> dict:
        """A copy of the state this manager keeps, as ``checkpoint_state.json`` records it: the
        active and preserved checkpoints with their times (for tests and diagnostics; every
        worker holds the chief's).

        Example:
            >>> import tempfile, jaxmirror
            >>> m = jaxmirror.checkpoint.CheckpointManager({"n": 1}, tempfile.mkdtemp(), 1)
            >>> m.state_record["checkpoints"], m.state_record["preserved"]
            ([], [])
        """
        return copy.deepcopy(self._state)

    @property
    def save_counter(self) -> int:
        """How many saves the tree has had (restored with it): the next ``<N>`` is one more."""
        return self._save_counter

    def track(self, name, leaf) -> None:
        """Save and restore ``leaf`` beside the tree, as the item ``name`` of each checkpoint.

        A jaxmirror addition (TF's ``Checkpoint`` takes such items as keyword arguments). The
        preemption handler tracks its count of ``run`` calls this way. A restore updates
        ``leaf`` in place if the checkpoint holds ``name``, and leaves it alone otherwise.

        Args:
            name: the item's name: letters, digits, ``_`` and ``-``, not ``"checkpoint"`` or
                ``"save_counter"``, not tracked before.
            leaf: a jaxmirror Variable, a flax NNX object, a ``Checkpointable``, or a tree of
                them: what a restore updates in place.

        Returns:
            None.

        Example:
            >>> import tempfile, jaxmirror
            >>> from jaxmirror import checkpoint
            >>> steps, w = jaxmirror.Variable(0), jaxmirror.Variable(1.0)
            >>> manager = checkpoint.CheckpointManager(w, tempfile.mkdtemp(), max_to_keep=1)
            >>> manager.track("steps", steps)
            >>> _ = steps.assign(5); path = manager.save(); _ = steps.assign(0)
            >>> manager.restore() is w, int(steps.numpy())
            (True, 5)
        """
        api = f"{_API}.track"
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", name):
            raise ValueError(f"{api}: `name` must be a str of letters, digits, '_' and '-', got "
                             f"{name!r}; give the item a plain name.")
        if name in _RESERVED or name in self._tracked:
            raise ValueError(f"{api}: {name!r} is " + ("the manager's own item" if name in
                             _RESERVED else "tracked already") + "; give another name.")
        _check_leaves(leaf, api, f"`leaf` {name!r}", in_place=True)
        self._tracked[name] = leaf

    def save(self, checkpoint_number=None, check_interval=True, options=None):
        """Save a checkpoint of the tree, then delete the oldest beyond ``max_to_keep``.

        As TF's: with ``checkpoint_interval``, returns None (saving nothing) when
        ``step_counter`` is the step of the last save, or (with ``check_interval``) less than
        ``checkpoint_interval`` steps after it. Otherwise the save counter goes up by one and
        the checkpoint ``<checkpoint_name>-<N>`` is written, ``N`` being ``checkpoint_number``
        or the save counter (an existing one of that name is replaced and becomes the newest).
        The state file is written before and after old checkpoints are deleted, and a killed
        save leaves the previous checkpoints restorable (see the class docstring).

        Args:
            checkpoint_number: the ``N`` of the path (an int, or an integer variable or
                array), or None for the save counter.
            check_interval: whether to honour ``checkpoint_interval``.
            options: None; jaxmirror has no ``tf.train.CheckpointOptions``.

        Returns:
            The new checkpoint's path, or None when the interval skipped the save.

        Raises:
            TypeError: for a bad argument; as ``jaxmirror.checkpoint.save``.

        Example:
            >>> import tempfile, jaxmirror
            >>> from jaxmirror import checkpoint
            >>> step = jaxmirror.Variable(0)
            >>> manager = checkpoint.CheckpointManager(
            ...     {"step": step}, tempfile.mkdtemp(), max_to_keep=None, step_counter=step,
            ...     checkpoint_interval=10)
            >>> paths = []
            >>> for n in (0, 5, 10, 10, 12):
            ...     _ = step.assign(n)
            ...     paths.append(manager.save() is not None)
            >>> paths, manager.save(checkpoint_number=99, check_interval=False)[-8:]
            ([True, False, True, False, False], '/ckpt-99')
        """
        api = f"{_API}.save"
        if options is not None:
            raise TypeError(f"{api}: `options` must be None, got {type(options).__name__}; "
                            f"jaxmirror has no CheckpointOptions (saves are synchronous).")
        if not isinstance(check_interval, bool):
            raise TypeError(f"{api}: `check_interval` must be a bool, got {check_interval!r}; "
                            f"pass True or False.")
        number = (None if checkpoint_number is None
                  else _evaluate(checkpoint_number, "checkpoint_number", api))
        step = None
        if self._interval is not None:
            step = _evaluate(self._step_counter, "step_counter", api)
            last = self._last_checkpoint_step
            if last is not None and (step == last or (check_interval
                                                      and step < last + self._interval)):
                return None
        counter = self._save_counter + 1
        rel = f"{self._name}-{counter if number is None else number}"
        path = os.path.join(self._directory, rel)
        tree = {**self._tracked, "checkpoint": self._tree, "save_counter": np.int64(counter)}
        with ledger.named(api):
            ckpt.save(path, tree, force=True)
            self._state = workers.chief_decides(api, rel, lambda: mfiles.recorded_and_swept(
                self._directory, self._name, self._state, rel, self._max_to_keep, self._hours))
        self._save_counter = counter
        if step is not None:
            self._last_checkpoint_step = step
        return path

    def restore_or_initialize(self):
        """Restore the latest checkpoint if there is one, else call ``init_fn`` (TF's).

        Args:
            None.

        Returns:
            The restored checkpoint's path, or None (no checkpoint: ``init_fn`` was called).

        Example:
            >>> import tempfile, jaxmirror
            >>> from jaxmirror import checkpoint
            >>> w = jaxmirror.Variable(0.0)
            >>> manager = checkpoint.CheckpointManager(
            ...     w, tempfile.mkdtemp(), max_to_keep=1, init_fn=lambda: w.assign(3.0))
            >>> manager.restore_or_initialize(), float(w.numpy())
            (None, 3.0)
        """
        latest = self.latest_checkpoint
        if latest is None:
            if self._init_fn is not None:
                self._init_fn()
            return None
        self.restore(latest)
        if self._interval is not None:
            self._last_checkpoint_step = _evaluate(self._step_counter, "step_counter",
                                                   f"{_API}.restore_or_initialize")
        return latest

    def restore(self, checkpoint_path=None):
        """Restore a checkpoint (the latest by default) into the tree and tracked items.

        A jaxmirror addition: TF restores with ``checkpoint.restore(manager.latest_checkpoint)``.
        Variables and NNX objects are updated in place (as ``jaxmirror.checkpoint.restore``
        does), as are the save counter and the tracked items the checkpoint holds; items in the
        checkpoint that this manager does not track are ignored.

        Args:
            checkpoint_path: a checkpoint's path (one of ``checkpoints``, or any this kind of
                manager saved), or None for ``latest_checkpoint``.

        Returns:
            The tree, as ``jaxmirror.checkpoint.restore`` returns it: its variables and NNX
            objects (updated), new arrays and numbers for its other leaves.

        Raises:
            FileNotFoundError: no checkpoint there (or none saved yet).
            ValueError: not a checkpoint a manager saved, or one of another structure.

        Example:
            >>> import tempfile, numpy as np
            >>> from jaxmirror import checkpoint
            >>> manager = checkpoint.CheckpointManager(
            ...     {"bias": np.arange(2.0)}, tempfile.mkdtemp(), max_to_keep=1)
            >>> _ = manager.save()
            >>> manager.restore()["bias"]
            array([0., 1.])
        """
        api = f"{_API}.restore"
        if checkpoint_path is None:
            checkpoint_path = self.latest_checkpoint
            if checkpoint_path is None:
                raise FileNotFoundError(f"{api}: there is no checkpoint in {self._directory!r} "
                                        f"yet; save one first, or call restore_or_initialize.")
        elif not isinstance(checkpoint_path, (str, os.PathLike)):
            raise TypeError(f"{api}: `checkpoint_path` must be a str or os.PathLike, got "
                            f"{type(checkpoint_path).__name__}; give one of `checkpoints`.")
        if context.current().in_run:
            raise RuntimeError(f"{api} was called inside `run`; restore outside the step.")
        path = os.path.abspath(os.fspath(checkpoint_path))
        with ledger.named(api):
            if ledger.active():
                workers.agree_restore(path)
            else:
                workers.prepare_restore(path)
            saved = _top_metadata(path, api)
            target = {"checkpoint": self._tree}
            for key, meta in saved.items():
                if key == "save_counter":
                    target[key] = np.int64(0)
                elif key in self._tracked:
                    target[key] = self._tracked[key]
                elif key != "checkpoint":  # not tracked here: read into placeholders, dropped
                    target[key] = jax.tree.map(
                        lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype)
                        if hasattr(m, "shape") else m, meta)
            out = ckpt.restore(path, target)
        if "save_counter" in out:
            self._save_counter = int(out["save_counter"])
        return out["checkpoint"]


__all__ = ["CheckpointManager"]
