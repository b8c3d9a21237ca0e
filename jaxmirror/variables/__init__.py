"""Variables: ``Variable``, ``MirroredVariable`` and ``SyncOnReadVariable``, and their checkpoints.

Modules:
    ``variable``: ``Variable``: a box around one ``jax.Array`` (``tf.Variable``).
    ``state``: what a variable holds, and how a step's writes to it commit or roll back.
    ``distributed``: ``MirroredVariable`` and ``SyncOnReadVariable``: one component per replica.
    ``creation``: what ``Variable(...)`` checks, which strategy owns it, its first array.
    ``assignment``: what an assignment writes: the value checked, cast, combined with the old.
    ``identity``: what TF asks of a variable besides its value: ``name``, ``ref()``, ``device``.
    ``operators``: ``ArrayOperators``: operators and conversions, as an array has them.
    ``display``: how a variable prints (TF's ``<tf.Variable ...>``).
    ``trees``: ``read_values`` and ``assign_values`` on pytrees of variables and arrays.
    ``handle``: ``VariableHandle``: a variable whose value lives elsewhere.
    ``sharded``: ``ShardedVariable``: one variable split along axis 0.
    ``partitioners``: TF's variable partitioners: shard counts and ``shard_sizes``.
    ``overwrites``: ``OverwriteWatch``: telling a worker's ``assign`` from its increments.
    ``checkpoint``: ``jaxmirror.checkpoint``'s save and restore.
    ``checkpoint_leaves``: one leaf of a checkpoint: matched by its path, saved, restored.
    ``checkpoint_files``: the atomic replace of a checkpoint directory.
    ``checkpoint_workers``: checkpoints across workers: the chief decides and swaps.
    ``checkpoint_manager``: TF's ``CheckpointManager``: numbered checkpoints, ``max_to_keep``.
    ``checkpoint_manager_files``: the manager's state file, and recovery after a killed save.
"""
