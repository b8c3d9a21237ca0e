"""Positions in a distributed dataset, as a checkpoint saves them (TF saves a ``tf.data``
iterator in a ``tf.train.Checkpoint``).

A position is how many elements a pass has given: ``[format, elements, input pipelines, each
pipeline its own data]`` (int64). A restore reads the pass again from its start up to there
(on the host, without placing it), so a dataset whose passes give the same batches (a list,
arrays, a grain dataset, a function) continues where it was. Global batches read by every
worker mean the same elements on any number of workers; per-worker data only with as many
input pipelines. Both a ``DistributedIterator`` (its own pass) and a ``DistributedDataset``
(its latest pass, or the start of the next one once that has ended: TF's loop that makes an
iterator per epoch) are saved so.
"""

from __future__ import annotations

import numpy as np

from jaxmirror.runtime import ledger

FORMAT = 1
SHAPE_DTYPE = ((4,), np.dtype(np.int64))


def state(given: int, dataset) -> np.ndarray:
    """The position after ``given`` elements of a pass over ``dataset``, agreed across workers
    (every worker must have given as many).

    Args:
        given: elements given in the pass.
        dataset: the ``DistributedDataset``.

    Returns:
        The int64 array a checkpoint saves.

    Raises:
        ValueError: the dataset cannot be read again (a one-shot iterator).
    """
    if not dataset.restorable:
        raise ValueError(
            "jaxmirror.checkpoint.save: the distributed dataset in the checkpoint reads a "
            "one-shot iterator (e.g. a generator), which a restarted run cannot read again, so "
            "its position could not be restored; distribute a re-iterable (a list, a grain "
            "dataset) or a zero-argument function that returns a new iterator.")
    pipelines, own = dataset.input_pipelines
    if ledger.active():
        ledger.agree("DistributedDataset position", f"{given} elements given")
    return np.array([FORMAT, given, pipelines, int(own)], np.int64)


def check(saved, dataset) -> int:
    """The number of elements to skip for ``saved``; raises ``ValueError`` unless it is a
    position ``dataset`` can take.

    Args:
        saved: a saved ``state``.
        dataset: the ``DistributedDataset`` to restore into.

    Returns:
        The elements given at the save.
    """
    saved = np.asarray(saved)
    if saved.shape != (4,) or int(saved[0]) != FORMAT or int(saved[1]) < 0:
        raise ValueError(f"jaxmirror.checkpoint.restore: the value saved for a distributed "
                         f"iterator or dataset is {saved.tolist()}, not a position; restore a "
                         f"checkpoint that saved an iterator or a dataset here.")
    pipelines, own = dataset.input_pipelines
    if bool(saved[3]) and int(saved[2]) != pipelines:
        raise ValueError(
            f"jaxmirror.checkpoint.restore: the position was saved with {int(saved[2])} input "
            f"pipelines each reading its own data, and this dataset has {pipelines}; a "
            f"position in per-worker data means the same elements only with as many "
            f"pipelines: restore onto as many workers (or replicas), or distribute global "
            f"batches with experimental_distribute_dataset (any number of workers).")
    if own and not bool(saved[3]):
        raise ValueError(
            f"jaxmirror.checkpoint.restore: the position was saved over global batches read "
            f"by every worker, and this dataset has {pipelines} input pipelines each reading "
            f"its own data; restore into an iterator of the same kind of dataset.")
    return int(saved[1])


__all__ = ["FORMAT", "SHAPE_DTYPE", "check", "state"]
