"""``jaxmirror.checkpoint``'s implementation: save, restore, to_saveable, restore_into.

The rules (one cross-replica value per leaf; a restore assigns as a cross-replica ``assign``
does) are in ``jaxmirror.checkpoint``'s docstring; ``checkpoint_leaves`` handles single leaves,
``checkpoint_files`` the atomic replace of a checkpoint directory.
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
from flax import nnx

from jaxmirror.core import _compat, context
from jaxmirror.core.checkpointable import Checkpointable
from jaxmirror.runtime import ledger
from jaxmirror.variables import checkpoint_files as files
from jaxmirror.variables import checkpoint_workers as workers
from jaxmirror.variables import checkpoint_leaves as leaves
from jaxmirror.variables import state
from jaxmirror.variables.handle import VariableHandle
from jaxmirror.variables.variable import Variable


def _ocp():
    # Imported on first use so that importing jaxmirror does not pay for orbax.
    import orbax.checkpoint as ocp

    return ocp


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
    return jax.tree_util.tree_map_with_path(leaves.saveable_leaf, tree, is_leaf=leaves.is_leaf)


def _agreed_as(call: str):
    """Every cross-worker call inside (reading sync-on-read variables, writing) is agreed
    with the other workers as ``call`` (``runtime/ledger.py``)."""
    def wrap(fn):
        @functools.wraps(fn)
        def agreed(*args, **kwargs):
            if not ledger.active():
                return fn(*args, **kwargs)
            with ledger.named(call):
                return fn(*args, **kwargs)
        return agreed
    return wrap


@_agreed_as("jaxmirror.checkpoint.save")
def save(directory, tree, *, force=False):
    """Save ``tree`` (variables and arrays) as an orbax checkpoint in ``directory``.

    Each leaf is saved as its cross-replica value (see ``to_saveable``), so the checkpoint can be
    restored with any number of replicas. Returns once the checkpoint is completely written.

    The save is atomic: the new checkpoint is written beside ``directory`` (in a hidden sibling
    ``.<name>.jaxmirror-new-...`` of the same parent directory) and only then swapped in, in one
    step (Linux's ``renameat2`` exchange; elsewhere two renames, whose gap ``save`` and
    ``restore`` repair). A save killed at any point, SIGKILL included, leaves the previous
    checkpoint (or, once the new one is complete, possibly the new one) restorable, never a
    half-written one; a save that raises leaves the previous checkpoint as it was. The next
    ``save`` deletes what killed saves left beside ``directory``. In a multi-worker run every
    worker calls ``save`` (each writes its part; only the chief touches the directory), and
    the same holds when any worker is killed.

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
        >>> os.listdir(os.path.dirname(path))   # nothing left beside it
        ['ckpt']
    """
    _check_not_in_run("save")
    path = _as_directory(directory, "save")
    if not isinstance(force, bool):
        raise TypeError(f"jaxmirror.checkpoint.save: `force` must be a bool, got "
                        f"{type(force).__name__} {force!r}.")
    # Before touching the directory: a tree that cannot be saved must not cost the old checkpoint.
    saveable = to_saveable(tree)
    if not jax.tree.leaves(saveable):
        raise ValueError(f"jaxmirror.checkpoint.save: `tree` has no leaves to save (got "
                         f"{tree!r}); give a tree of variables or arrays.")
    ocp = _ocp()
    if not _one_process():
        workers.save(ocp, path, saveable, force)
        return
    # A save killed between its two renames left `path` missing: put its checkpoint back before
    # deciding whether `path` may be written.
    files.recover(path)
    files.remove_leftovers(path)
    files.check_destination(path, force)
    new = files.sibling(path, "new")
    try:
        # PyTreeCheckpointer saves synchronously, into a temporary directory that it renames to
        # `new` when complete: `new` never exists half-written.
        with ocp.PyTreeCheckpointer() as checkpointer:
            checkpointer.save(new, args=ocp.args.PyTreeSave(saveable))
        files.replace(new, path)
    finally:
        files.abandon(path, new)  # what a failed save left beside `path`; nothing after success


def _one_process() -> bool:
    return jax.process_count() == 1


# -- restoring ------------------------------------------------------------------------------------
def restore_into(target, saved):
    """Apply saved values to ``target``: assign its variables, place its arrays like it does.

    Every variable of ``target`` is assigned its saved value in place, as a cross-replica
    ``assign`` does (a SUM sync-on-read variable of ``N`` replicas gets ``value / N`` per
    component; a mirrored variable gets the value in every component), and every flax NNX
    object (model, optimizer) takes its saved state in place. Every other leaf is
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
    target_pairs, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=leaves.is_leaf)
    for path, leaf in target_pairs:
        leaves.target_shape_dtype(path, leaf)
    saved_pairs = jax.tree_util.tree_flatten_with_path(to_saveable(saved),
                                                       is_leaf=leaves.is_leaf)[0]
    values = leaves.check_same_structure(target_pairs, saved_pairs, "saved tree")
    out, writes, remote, states = [], [], [], []
    for (path, leaf), x in zip(target_pairs, values.values()):
        leaves.check_shape(path, leaf, np.shape(x))
        if isinstance(leaf, Checkpointable):  # checked now, taken once the variables are
            leaf.check_checkpoint_state(np.asarray(x))
            states.append((leaf, np.asarray(x)))
            out.append(leaf)
        elif isinstance(leaf, (Variable, VariableHandle)):
            (writes if isinstance(leaf, Variable) else remote).append((leaf, x))
            out.append(leaf)
        else:
            out.append(leaves.placed_like(leaf, x))
    old_remote = _assign_handles_all_or_nothing(remote)
    try:
        _assign_all_or_nothing(writes)
    except BaseException:
        for handle, value in old_remote:
            handle.assign(value, read_value=False)
        raise
    for leaf, x in states:
        leaf.restore_checkpoint_state(x)
    return _nnx_updated_in_place(target, jax.tree.unflatten(treedef, out))


def _nnx_updated_in_place(target, restored):
    """``restored`` with the NNX objects of ``target`` given their restored state in place (as
    variables are assigned in place: TF's ``Checkpoint.restore`` habit), not as new copies."""
    target_nodes = jax.tree.leaves(target, is_leaf=_compat.is_graph_node)
    if not any(map(_compat.is_graph_node, target_nodes)):
        return restored
    restored_nodes, tree = jax.tree.flatten(restored, is_leaf=_compat.is_graph_node)
    out = []
    for old, new in zip(target_nodes, restored_nodes):
        if isinstance(old, nnx.Variable):
            old.set_value(new.get_value())
        elif _compat.is_graph_node(old):
            nnx.update(old, nnx.state(new))
        else:
            old = new
        out.append(old)
    return jax.tree.unflatten(tree, out)


def _assign_handles_all_or_nothing(writes) -> list:
    """``handle.assign(x)`` for variables stored elsewhere; if one fails, those assigned get
    their old values back. Returns the old values."""
    old = [(handle, np.asarray(handle.read_value())) for handle, _ in writes]
    done = []
    try:
        for handle, x in writes:
            handle.assign(x, read_value=False)
            done.append(handle)
    except BaseException:
        for handle, value in old[:len(done)]:
            handle.assign(value, read_value=False)
        raise
    return old


def _assign_all_or_nothing(writes) -> None:
    """``var.assign(x)`` for each pair; if one fails, every variable gets its old state back."""
    variables = [var for var, _ in writes]
    with state.lock:  # no step may write them between the snapshot and the assignments
        old = {i: state.settled(var) for i, var in enumerate(variables)}
        try:
            for var, x in writes:
                var.assign(x)
        except BaseException:
            state.write_back(variables, old)
            raise


@_agreed_as("jaxmirror.checkpoint.restore")
def restore(directory, target):
    """Restore the checkpoint in ``directory`` into ``target``; return the restored tree.

    The checkpoint may have been written with any number of replicas (or none). Variables and
    flax NNX objects (models, optimizers) of ``target`` are updated in place (see
    ``restore_into``: a SUM sync-on-read variable of ``N`` replicas gets ``value / N`` per
    component, a mirrored one the value in every component) and returned in the result; arrays
    are read straight into the target leaf's sharding (a ``jax.Array`` or a
    ``jax.ShapeDtypeStruct`` with one), into NumPy arrays for NumPy or unsharded abstract
    leaves, or as Python numbers for numbers. Nothing is assigned if the structure or a shape
    does not match.

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
    if _one_process():
        workers.prepare_restore(path)
    else:  # the chief repairs and checks; every worker raises what it found, or reads
        workers.agree_restore(path)
    target_pairs = jax.tree_util.tree_flatten_with_path(target, is_leaf=leaves.is_leaf)[0]
    for p, leaf in target_pairs:
        leaves.target_shape_dtype(p, leaf)
    ocp = _ocp()
    with ocp.PyTreeCheckpointer() as checkpointer:
        metadata = _checked_metadata(checkpointer, path, target_pairs)
        targets = leaves.by_name(target_pairs)
        args = jax.tree_util.tree_map_with_path(
            lambda p, meta: _restore_args(ocp, targets[tuple(map(leaves.key_name, p))][1], meta),
            metadata)
        saved = checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
    return restore_into(target, saved)


def _checked_metadata(checkpointer, path: str, target_pairs):
    """The checkpoint's tree of array metadata, checked against the target's structure and
    shapes before anything is read (so a mismatch assigns no variable)."""
    item_metadata = checkpointer.metadata(path).item_metadata
    if item_metadata is None:
        raise ValueError(f"jaxmirror.checkpoint.restore: {path!r} holds no pytree checkpoint; "
                         f"give a directory `save` wrote.")
    metadata = getattr(item_metadata, "tree", item_metadata)
    saved_pairs = jax.tree_util.tree_flatten_with_path(metadata)[0]
    metas = leaves.check_same_structure(target_pairs, saved_pairs, "checkpoint")
    for (p, leaf), meta in zip(target_pairs, metas.values()):
        if getattr(meta, "shape", None) is None:  # a string, say
            raise ValueError(f"jaxmirror.checkpoint.restore: cannot restore into "
                             f"{leaves.where(p)}: the checkpoint holds a {type(meta).__name__} "
                             f"there, not an array; restore a checkpoint of arrays.")
        leaves.check_shape(p, leaf, meta.shape)
    return metadata


def _restore_args(ocp, leaf, meta):
    """How orbax reads one saved array for the target ``leaf``."""
    _, dtype = leaves.target_shape_dtype((), leaf)
    sharding = leaves.sharding_of(leaf)
    if sharding is not None and isinstance(meta, ocp.metadata.ArrayMetadata):
        # Read straight into the target's placement, whatever the writer's devices were.
        return ocp.ArrayRestoreArgs(sharding=sharding, global_shape=tuple(meta.shape),
                                    dtype=dtype)
    return ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)


__all__ = ["restore", "restore_into", "save", "to_saveable"]
