"""Checkpoints in a multi-worker run: the chief decides and touches the directory, every
worker writes its part, and a worker killed at any point leaves the previous checkpoint.

Every worker calls ``jaxmirror.checkpoint.save`` (TF saves on every worker too). The chief
repairs and cleans up what killed saves left and checks the destination; the workers learn its
decision (or its error, raised on every worker) through the ledger (``runtime/ledger.py``), all
write a new sibling directory with orbax (which coordinates them), the chief swaps it in
(``checkpoint_files.replace``), and no worker returns before the swap. A killed worker leaves
the old checkpoint in place, and the others stop, naming it (``runtime/watch.py``).
"""

from __future__ import annotations

import os

import jax
import numpy as np

from jaxmirror.runtime import ledger
from jaxmirror.variables import checkpoint_files as files


def save(ocp, path: str, saveable, force: bool) -> None:
    """``save`` in a multi-process run, as atomic as in one process: the chief decides where
    the new checkpoint goes (after repairing and cleaning up what killed saves left), every
    worker writes its part there with orbax, the chief swaps it in, and no worker returns
    before the swap. A worker killed at any point leaves the previous checkpoint in place
    (the others then stop, naming it: ``runtime/watch.py``).

    Args:
        ocp: the ``orbax.checkpoint`` module.
        path: the absolute destination.
        saveable: the tree to save (``checkpoint.to_saveable``'s).
        force: replace a checkpoint already there.

    Raises:
        FileExistsError: as ``checkpoint.save``, on every worker.
    """
    chief = jax.process_index() == 0
    shapes = [f"{np.dtype(x.dtype).name}{list(np.shape(x))}" for x in jax.tree.leaves(saveable)]
    new = chief_decides("jaxmirror.checkpoint.save", f"{path} {shapes}",
                        lambda: _prepare_save(path, force))["new"]
    try:
        # Orbax coordinates the workers writing `new` (each its own shards; the chief renames
        # orbax's temporary directory to `new` once all are written).
        with ocp.PyTreeCheckpointer() as checkpointer:
            checkpointer.save(new, args=ocp.args.PyTreeSave(saveable))
        if chief:
            files.replace(new, path)
    finally:
        if chief:
            files.abandon(path, new)
    ledger.agree("jaxmirror.checkpoint.save", "swapped in")  # nobody returns before the swap


def _prepare_save(path: str, force: bool) -> dict:
    files.recover(path)
    files.remove_leftovers(path)
    files.check_destination(path, force)
    return {"new": files.sibling(path, "new")}


def decided_by_chief(chief: bool, decide):
    """On the chief, ``decide()`` (or the error it raised, to be raised on every worker).

    Args:
        chief: whether this worker is the chief.
        decide: the chief's decision, a function returning a JSON-serializable dict.

    Returns:
        The decision, ``{"error": [type name, message]}``, or ``None`` off the chief.

    Example:
        >>> decided_by_chief(True, lambda: {"new": "x"}), decided_by_chief(False, dict)
        ({'new': 'x'}, None)
    """
    if not chief:
        return None
    try:
        return decide()
    except (FileExistsError, FileNotFoundError, ValueError, OSError) as error:
        return {"error": [type(error).__name__, str(error)]}


def chief_decides(call: str, detail: str, decide) -> dict:
    """``decide()`` on the chief, handed to every worker through the ledger as ``call``; the
    chief's error is raised on every worker. In one process, ``decide()`` itself.

    Args:
        call: the call every worker makes (``ledger.agree``'s).
        detail: what must match across workers.
        decide: the chief's decision, a function returning a JSON-serializable dict.

    Returns:
        The chief's decision.

    Example:
        >>> chief_decides("doc", "", lambda: {"new": "x"})
        {'new': 'x'}
    """
    if not ledger.active():
        return decide()
    decision = decided_by_chief(jax.process_index() == 0, decide)
    decision = ledger.agree(call, detail, decision)[0]
    raise_decided(decision)
    return decision


def raise_decided(decision: dict) -> None:
    """Raise the chief's error, if its decision is one (the same type and message everywhere).

    Args:
        decision: what ``decided_by_chief`` gave on the chief.

    Example:
        >>> raise_decided({"new": "x"})
    """
    if "error" in decision:
        kind, message = decision["error"]
        raise {"FileExistsError": FileExistsError, "FileNotFoundError": FileNotFoundError,
               "ValueError": ValueError}.get(kind, OSError)(message)


def prepare_restore(path: str) -> dict:
    """Check that ``path`` holds a checkpoint, after putting back one a killed save left beside
    it (a save killed between its two renames), so that a killed save never costs it.

    Args:
        path: the checkpoint directory.

    Returns:
        ``{}`` (the chief's decision: go ahead).

    Raises:
        FileNotFoundError, ValueError: no checkpoint there.
    """
    files.recover(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"jaxmirror.checkpoint.restore: no checkpoint at {path!r} (the "
                                f"directory does not exist).")
    if not os.path.isdir(path) or not files.is_checkpoint(path):
        raise ValueError(f"jaxmirror.checkpoint.restore: {path!r} is not an orbax checkpoint "
                         f"directory (no {files.MARKERS[0]} file); give the directory "
                         f"`save` wrote.")
    return {}


def agree_restore(path: str) -> None:
    """The chief checks ``path`` (repairing a killed save's window); every worker raises its
    error, or goes on to read.

    Args:
        path: the checkpoint directory.
    """
    chief_decides("jaxmirror.checkpoint.restore", path, lambda: prepare_restore(path))


__all__ = ["agree_restore", "chief_decides", "decided_by_chief", "prepare_restore",
           "raise_decided", "save"]
