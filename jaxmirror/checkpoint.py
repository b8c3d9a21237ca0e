"""``jaxmirror.checkpoint``: orbax checkpoints of pytrees of variables and arrays.

A checkpoint holds one array per leaf: what a cross-replica read gives. A ``MirroredVariable``
saves its value (component 0), a ``SyncOnReadVariable`` its aggregate (the SUM or MEAN of its
components, component 0 for ONLY_FIRST_REPLICA), a plain variable or array its value, a
``jax.Array`` replicated over a strategy's devices (a Mirrored ``run`` result) its one value. So a
checkpoint does not depend on the number of replicas that wrote it: restore it into variables of
any strategy, into plain variables, or into arrays placed anywhere. A restored variable is
assigned as a cross-replica ``assign`` does it: every component of a mirrored variable gets the
value, a SUM sync-on-read variable gets ``value / N`` in each of its ``N`` components (so its read
gives the value back), other sync-on-read variables get the value in each component.

``save`` and ``restore`` read and write a directory. ``CheckpointManager`` (TF's
``tf.train.CheckpointManager``) keeps the last few checkpoints of a tree in numbered directories
and restores the latest, on one worker or several, whenever a save was killed. With your own
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

from jaxmirror.variables.checkpoint import restore, restore_into, save, to_saveable
from jaxmirror.variables.checkpoint_manager import CheckpointManager

__all__ = ["CheckpointManager", "restore", "restore_into", "save", "to_saveable"]
