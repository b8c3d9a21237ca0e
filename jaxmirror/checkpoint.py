"""Checkpoints of pytrees of variables and arrays, with orbax (SEMANTICS.md "Variables").

A checkpoint holds one array per leaf: what a cross-replica read gives. A ``MirroredVariable``
saves its value (component 0), a ``SyncOnReadVariable`` its aggregate (the SUM or MEAN of its
components, component 0 for ONLY_FIRST_REPLICA), a plain variable or array its value, a
``jax.Array`` replicated over a strategy's devices (a Mirrored ``run`` result) its one value. So a
checkpoint does not depend on the number of replicas that wrote it: restore it into variables of
any strategy, into plain variables, or into arrays placed anywhere. A restored variable is
assigned as a cross-replica ``assign`` does it: every component of a mirrored variable gets the
value, a SUM sync-on-read variable gets ``value / N`` in each of its ``N`` components (so its read
gives the value back), other sync-on-read variables get the value in each component.

``save`` and ``restore`` read and write a directory. With your own
``orbax.checkpoint.CheckpointManager``, hand it ``to_saveable(tree)`` and apply what it restores
with ``restore_into(target, restored)``.

Example:
    >>> import os, tempfile, jaxmirror
    >>> from jaxmirror import checkpoint
    >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
    >>> with s.scope():
    ...     total = jaxmirror.Variable(0.0, synchronization="on_read", aggregation="sum")
    >>> def count():   # replica i holds i + 1
    ...     total.assign(jaxmirror.get_replica_context().replica_id_in_sync_group + 1.0)
    >>> s.run(count)
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> checkpoint.save(path, {"total": total})
    >>> plain = {"total": jaxmirror.Variable(0.0)}   # no strategy: one component
    >>> float(checkpoint.restore(path, plain)["total"].numpy())
    3.0
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from jaxmirror import _compat, context
from jaxmirror.values import DistributedValues, Mirrored
from jaxmirror.variables import Variable

_SCALARS = (bool, int, float, complex)
# Files an orbax checkpoint directory always has (tree metadata, step metadata).
_CHECKPOINT_MARKERS = ("_METADATA", "_CHECKPOINT_METADATA")


def _ocp():
    # Imported on first use so that importing jaxmirror does not pay for orbax.
    import orbax.checkpoint as ocp

    return ocp


# -- trees ----------------------------------------------------------------------------------------
def _is_leaf(x) -> bool:
    # Variables are leaves already; distributed values are pytrees, but a checkpoint sees one
    # value per PerReplica or Mirrored, not their stacked or inner arrays.
    return isinstance(x, (Variable, DistributedValues))


def _where(path) -> str:
    return "tree" + jax.tree_util.keystr(path)


def _key_name(key) -> str:
    # Orbax stores tuples as lists and namedtuples and dataclasses as dicts; compare by name.
    if isinstance(key, DictKey):
        return str(key.key)
    if isinstance(key, SequenceKey):
        return str(key.idx)
    if isinstance(key, GetAttrKey):
        return key.name
    if isinstance(key, FlattenedIndexKey):
        return str(key.key)
    return str(key)


def _by_name(pairs) -> dict:
    named = {}
    for path, leaf in pairs:
        name = tuple(_key_name(k) for k in path)
        if name in named:
            raise ValueError(f"{_where(named[name][0])} and {_where(path)} have the same name in a "
                             f"checkpoint; give them distinct keys.")
        named[name] = (path, leaf)
    return named


def _check_same_structure(target_pairs, saved_pairs, what: str) -> dict:
    """The saved leaves by target path; raises unless both trees have the same leaves."""
    saved = _by_name(saved_pairs)
    target = _by_name(target_pairs)
    missing = [_where(target[k][0]) for k in target if k not in saved]
    extra = [_where(saved[k][0]) for k in saved if k not in target]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"in target but not in {what}: {', '.join(missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        if extra:
            parts.append(f"in {what} but not in target: {', '.join(extra[:5])}"
                         + (f" and {len(extra) - 5} more" if len(extra) > 5 else ""))
        raise ValueError(f"The target's structure does not match the {what}'s "
                         f"({'; '.join(parts)}). Restore into a tree shaped like the one saved.")
    return {k: saved[k][1] for k in target}


def _check_not_in_run(fn: str) -> None:
    if context.current().in_run:
        raise RuntimeError(f"jaxmirror.checkpoint.{fn} was called inside `run`; save and restore "
                           f"outside the step, where variables are read and assigned across "
                           f"replicas.")


def _as_directory(directory, fn: str) -> str:
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"jaxmirror.checkpoint.{fn}: `directory` must be a str or os.PathLike, "
                        f"got {type(directory).__name__} {directory!r}.")
    # Orbax writes through tensorstore, which needs absolute paths.
    return os.path.abspath(os.fspath(directory))


def _is_checkpoint(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, m)) for m in _CHECKPOINT_MARKERS)


# -- saving ---------------------------------------------------------------------------------------
def _saveable_leaf(path, x):
    if isinstance(x, Variable):
        try:
            x = x.read_value()
        except ValueError as e:  # a sync-on-read variable with aggregation NONE
            raise ValueError(f"Cannot save {_where(path)}: {e}") from e
    elif isinstance(x, Mirrored):
        x = x.value
    elif isinstance(x, DistributedValues):
        raise ValueError(
            f"Cannot save {_where(path)}: it is a {type(x).__name__} value, whose replicas hold "
            f"different values, and a checkpoint holds one value per leaf. Reduce it "
            f"(strategy.reduce) or gather it (strategy.gather) first."
        )
    if _compat.is_tracer(x):
        raise ValueError(f"Cannot save {_where(path)}: it is a traced value. Save outside jax.jit, "
                         f"jax.grad and `run`, from the arrays they return.")
    if isinstance(x, (jax.Array, np.ndarray)):
        return x
    if isinstance(x, (np.generic,) + _SCALARS):
        return np.asarray(x)
    raise TypeError(f"Cannot save {_where(path)}: got a {type(x).__name__}; expected a jaxmirror "
                    f"Variable, a jax.Array, a NumPy array or a Python number.")


def to_saveable(tree):
    """``tree`` as orbax can save it: every leaf an array holding its cross-replica value.

    Variables become their cross-replica ``read_value()`` (a mirrored variable's value, a
    sync-on-read variable's aggregate), ``Mirrored`` wrappers their value, Python and NumPy
    scalars 0-d NumPy arrays; arrays stay as they are (a replicated ``jax.Array`` is saved once).
    Hand the result to your own orbax ``Checkpointer`` or ``CheckpointManager``.

    Args:
        tree: a pytree of variables, ``jax.Array``s, NumPy arrays, numbers and ``Mirrored``
            values.

    Returns:
        A pytree of the same structure whose leaves are ``jax.Array``s and NumPy arrays.

    Raises:
        ValueError: for a ``PerReplica`` leaf (reduce or gather it first), a sync-on-read
            variable with aggregation NONE (no cross-replica value), or a traced value.
        TypeError: for a leaf of another type.
        RuntimeError: when called inside ``run``.

    Example:
        >>> import jaxmirror
        >>> from jaxmirror import checkpoint
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with s.scope():
        ...     mean = jaxmirror.Variable(0.0, synchronization="on_read", aggregation="mean")
        >>> def measure():   # replica i holds i
        ...     mean.assign(jaxmirror.get_replica_context().replica_id_in_sync_group * 1.0)
        >>> s.run(measure)
        >>> saveable = checkpoint.to_saveable({"mean": mean, "step": 7})
        >>> float(saveable["mean"]), saveable["step"].item()
        (0.5, 7)
    """
    _check_not_in_run("to_saveable")
    return jax.tree_util.tree_map_with_path(_saveable_leaf, tree, is_leaf=_is_leaf)


def save(directory, tree, *, force=False):
    """Save ``tree`` (variables and arrays) as an orbax checkpoint in ``directory``.

    Each leaf is saved as its cross-replica value (see ``to_saveable``), so the checkpoint can be
    restored with any number of replicas. Returns once the checkpoint is completely written.

    Args:
        directory: where to write, a str or ``os.PathLike`` (made absolute); it must not exist,
            be an empty directory, or (with ``force``) hold a checkpoint to replace. Missing
            parent directories are created.
        tree: a pytree of variables, ``jax.Array``s, NumPy arrays, numbers and ``Mirrored``
            values, with at least one leaf.
        force: replace a checkpoint already in ``directory``. A non-empty directory that does not
            hold an orbax checkpoint is never replaced, so that ``force`` cannot delete other
            files.

    Returns:
        None.

    Raises:
        FileExistsError: ``directory`` exists (and is not empty) and ``force`` is False, or it is
            a file or a non-empty directory that holds no checkpoint.
        ValueError: as ``to_saveable``, or for a tree without leaves.
        TypeError: for a bad ``directory`` or ``force``, or a leaf of an unsupported type.

    Example:
        >>> import os, tempfile, jaxmirror
        >>> from jaxmirror import checkpoint
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with s.scope():
        ...     w = jaxmirror.Variable([1.0, 2.0])
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> checkpoint.save(path, {"w": w})
        >>> checkpoint.save(path, {"w": w}, force=True)   # replace it
        >>> sorted(os.listdir(path))[:2]
        ['_CHECKPOINT_METADATA', '_METADATA']
    """
    _check_not_in_run("save")
    path = _as_directory(directory, "save")
    if not isinstance(force, bool):
        raise TypeError(f"jaxmirror.checkpoint.save: `force` must be a bool, got "
                        f"{type(force).__name__} {force!r}.")
    # Before touching the directory: a tree that cannot be saved must not cost the old checkpoint.
    saveable = to_saveable(tree)
    if not jax.tree.leaves(saveable):
        raise ValueError(f"jaxmirror.checkpoint.save: `tree` has no leaves to save (got {tree!r}).")
    replace = False
    if os.path.lexists(path):
        if not os.path.isdir(path):
            raise FileExistsError(f"jaxmirror.checkpoint.save: {path!r} exists and is not a "
                                  f"directory. Give a new directory.")
        if os.listdir(path):
            if not _is_checkpoint(path):
                raise FileExistsError(
                    f"jaxmirror.checkpoint.save: directory {path!r} is not empty and holds no "
                    f"orbax checkpoint; not replacing it, even with force=True. Give a new or "
                    f"empty directory.")
            if not force:
                raise FileExistsError(
                    f"jaxmirror.checkpoint.save: a checkpoint already exists in {path!r}. Pass "
                    f"force=True to replace it, or give a new directory.")
        # Orbax refuses any existing destination, an empty one included.
        replace = True
    ocp = _ocp()
    # PyTreeCheckpointer saves synchronously: the checkpoint is complete when `save` returns.
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(path, args=ocp.args.PyTreeSave(saveable), force=replace)


# -- restoring ------------------------------------------------------------------------------------
def _target_shape_dtype(path, leaf):
    """(shape, dtype) a target leaf takes; dtype None: keep the saved one. Raises for bad leaves."""
    if isinstance(leaf, Variable):
        return tuple(leaf.shape), None  # `assign` applies the variable's own dtype rules
    if isinstance(leaf, Mirrored):
        return _target_shape_dtype(path, leaf.value)
    if isinstance(leaf, DistributedValues):
        raise ValueError(
            f"Cannot restore into {_where(path)}: it is a {type(leaf).__name__} value, and a "
            f"checkpoint holds one value per leaf. Restore into a variable made in the strategy's "
            f"scope, or into an array (jax.device_put(x, strategy.extended.replicated_sharding)).")
    if _compat.is_tracer(leaf):
        raise ValueError(f"Cannot restore into {_where(path)}: it is a traced value. Restore "
                         f"outside jax.jit, jax.grad and `run`.")
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)):
        return tuple(leaf.shape), np.dtype(leaf.dtype)
    if isinstance(leaf, _SCALARS):
        return (), None
    raise TypeError(f"Cannot restore into {_where(path)}: got a {type(leaf).__name__}; expected a "
                    f"jaxmirror Variable, a jax.Array, a jax.ShapeDtypeStruct, a NumPy array or a "
                    f"Python number.")


def _check_shape(path, leaf, saved_shape) -> None:
    shape, _ = _target_shape_dtype(path, leaf)
    if tuple(saved_shape) != shape:
        raise ValueError(f"Cannot restore into {_where(path)}: the saved value has shape "
                         f"{tuple(saved_shape)}, the target has shape {shape}.")


def _sharding(leaf):
    if isinstance(leaf, Mirrored):
        return _sharding(leaf.value)
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        return leaf.sharding
    return None


def _placed_like(leaf, x):
    """The saved value ``x`` as the (non-variable) target ``leaf`` holds values."""
    if isinstance(leaf, Mirrored):
        # Rebuilt through its pytree structure, which carries the wrapper's replica count.
        return jax.tree.unflatten(jax.tree.structure(leaf), [_placed_like(leaf.value, x)])
    if isinstance(leaf, _SCALARS):
        return type(leaf)(np.asarray(x).item())
    dtype = np.dtype(leaf.dtype)
    sharding = _sharding(leaf)
    if sharding is None:  # a NumPy target, or an abstract one with no placement: on the host
        out = np.asarray(x, dtype=dtype)
        return out[()] if isinstance(leaf, np.generic) else out
    x = x if isinstance(x, jax.Array) else np.asarray(x)
    if x.dtype != dtype:
        x = x.astype(dtype)
    return jax.device_put(x, sharding)


def restore_into(target, saved):
    """Apply saved values to ``target``: assign its variables, place its arrays like it does.

    Every variable of ``target`` is assigned its saved value in place, as a cross-replica
    ``assign`` does (a SUM sync-on-read variable of ``N`` replicas gets ``value / N`` per
    component; a mirrored variable gets the value in every component). Every other leaf is
    replaced by the saved value, cast to its dtype and placed like it: with its sharding for a
    ``jax.Array`` (or a ``jax.ShapeDtypeStruct`` that has one), on the host as NumPy for a NumPy
    array or an abstract leaf without sharding, as a Python number for a number. Leaves are
    matched by their path (tuples and lists, namedtuples and dicts with the same keys match, as
    orbax stores them). If an assignment fails, every variable keeps its old value.

    Args:
        target: a pytree of variables, ``jax.Array``s, ``jax.ShapeDtypeStruct``s, NumPy arrays,
            numbers and ``Mirrored`` values.
        saved: a pytree with the same leaves, as orbax restored it (or as ``to_saveable`` made
            it; variables are read).

    Returns:
        A pytree with ``target``'s structure: its variables (assigned), new arrays elsewhere.

    Raises:
        ValueError: for a structure or shape mismatch, a ``PerReplica`` leaf in either tree, or
            a value a variable's ``assign`` refuses.
        TypeError: for a leaf of an unsupported type, or a dtype a variable cannot take.
        RuntimeError: when called inside ``run``.

    Example:
        >>> import jax, numpy as np, jaxmirror
        >>> from jaxmirror import checkpoint
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with s.scope():
        ...     total = jaxmirror.Variable(0.0, synchronization="on_read", aggregation="sum")
        >>> bias = jax.device_put(np.zeros(2, np.float32), s.extended.replicated_sharding)
        >>> out = checkpoint.restore_into({"total": total, "bias": bias},
        ...                               {"total": np.asarray(6.0), "bias": np.ones(2)})
        >>> out["total"] is total, [float(c) for c in total.values], float(total.numpy())
        (True, [3.0, 3.0], 6.0)
        >>> out["bias"].tolist(), out["bias"].sharding == bias.sharding
        ([1.0, 1.0], True)
    """
    _check_not_in_run("restore_into")
    target_pairs, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=_is_leaf)
    for path, leaf in target_pairs:
        _target_shape_dtype(path, leaf)
    saved_pairs = jax.tree_util.tree_flatten_with_path(to_saveable(saved), is_leaf=_is_leaf)[0]
    values = _check_same_structure(target_pairs, saved_pairs, "saved tree")
    leaves, writes = [], []
    for (path, leaf), x in zip(target_pairs, values.values()):
        _check_shape(path, leaf, np.shape(x))
        if isinstance(leaf, Variable):
            writes.append((leaf, x))
            leaves.append(leaf)
        else:
            leaves.append(_placed_like(leaf, x))
    old = [(var, var._state) for var, _ in writes]
    try:
        for var, x in writes:
            var.assign(x)
    except BaseException:
        for var, state in old:  # all or nothing, as a step's variable writes are
            var._state = state
        raise
    return jax.tree.unflatten(treedef, leaves)


def restore(directory, target):
    """Restore the checkpoint in ``directory`` into ``target``; return the restored tree.

    The checkpoint may have been written with any number of replicas (or none). Variables of
    ``target`` are assigned in place (see ``restore_into``: a SUM sync-on-read variable of ``N``
    replicas gets ``value / N`` per component, a mirrored one the value in every component) and
    returned in the result; arrays are read straight into the target leaf's sharding (a
    ``jax.Array`` or a ``jax.ShapeDtypeStruct`` with one), into NumPy arrays for NumPy or
    unsharded abstract leaves, or as Python numbers for numbers. Nothing is assigned if the
    structure or a shape does not match.

    Args:
        directory: the checkpoint's directory (what ``save`` was given), a str or
            ``os.PathLike``.
        target: a pytree like the saved one, of variables, ``jax.Array``s,
            ``jax.ShapeDtypeStruct``s, NumPy arrays, numbers and ``Mirrored`` values.

    Returns:
        A pytree with ``target``'s structure: its variables (assigned), new arrays elsewhere.

    Raises:
        FileNotFoundError: ``directory`` does not exist.
        ValueError: ``directory`` holds no orbax checkpoint; or as ``restore_into``.
        TypeError: for a bad ``directory``; or as ``restore_into``.

    Example:
        >>> import os, tempfile, jax, numpy as np, jaxmirror
        >>> from jaxmirror import checkpoint
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with s.scope():
        ...     w = jaxmirror.Variable([1.0, 2.0])
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> checkpoint.save(path, {"w": w, "step": 3})
        >>> one = jaxmirror.OneDeviceStrategy("CPU:0")
        >>> with one.scope():
        ...     w1 = jaxmirror.Variable([0.0, 0.0])
        >>> out = checkpoint.restore(path, {"w": w1, "step": 0})
        >>> w1.numpy().tolist(), out["step"]
        ([1.0, 2.0], 3)
        >>> checkpoint.restore(path, {"w": np.zeros(2, np.float32), "step": 0})["w"]
        array([1., 2.], dtype=float32)
    """
    _check_not_in_run("restore")
    path = _as_directory(directory, "restore")
    if not os.path.exists(path):
        raise FileNotFoundError(f"jaxmirror.checkpoint.restore: no checkpoint at {path!r} (the "
                                f"directory does not exist).")
    if not os.path.isdir(path) or not _is_checkpoint(path):
        raise ValueError(f"jaxmirror.checkpoint.restore: {path!r} is not an orbax checkpoint "
                         f"directory (no {_CHECKPOINT_MARKERS[0]} file); give the directory "
                         f"`save` wrote.")
    target_pairs = jax.tree_util.tree_flatten_with_path(target, is_leaf=_is_leaf)[0]
    targets = _by_name(target_pairs)
    for p, leaf in target_pairs:
        _target_shape_dtype(p, leaf)
    ocp = _ocp()
    with ocp.PyTreeCheckpointer() as checkpointer:
        item_metadata = checkpointer.metadata(path).item_metadata
        if item_metadata is None:
            raise ValueError(f"jaxmirror.checkpoint.restore: {path!r} holds no pytree checkpoint.")
        metadata = getattr(item_metadata, "tree", item_metadata)
        saved_pairs = jax.tree_util.tree_flatten_with_path(metadata)[0]
        metas = _check_same_structure(target_pairs, saved_pairs, "checkpoint")
        # Checked before reading anything, so that a mismatch assigns no variable.
        for (p, leaf), meta in zip(target_pairs, metas.values()):
            if getattr(meta, "shape", None) is None:  # a string, say
                raise ValueError(f"Cannot restore into {_where(p)}: the checkpoint holds a "
                                 f"{type(meta).__name__} there, not an array.")
            _check_shape(p, leaf, meta.shape)

        def restore_args(p, meta):
            _, leaf = targets[tuple(_key_name(k) for k in p)]
            _, dtype = _target_shape_dtype(p, leaf)
            sharding = _sharding(leaf)
            if sharding is not None and isinstance(meta, ocp.metadata.ArrayMetadata):
                # Read straight into the target's placement, whatever the writer's devices were.
                return ocp.ArrayRestoreArgs(sharding=sharding, global_shape=tuple(meta.shape),
                                            dtype=dtype)
            return ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)

        args = jax.tree_util.tree_map_with_path(restore_args, metadata)
        saved = checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
    return restore_into(target, saved)


__all__ = ["restore", "restore_into", "save", "to_saveable"]
