"""The compiled step: what ``strategy.run`` makes of a function, and what runs inside it.

* ``program``: ``Program``, one ``jax.jit(shard_map(...))`` per step function, and its hot path;
* ``trace``: tracing the user's function once per replica signature and emitting it;
* ``jaxpr_walk``, ``replication``, ``rows``: the analyses of the traced jaxpr (which outputs are
  Mirrored, which hold a padded batch's rows);
* ``replica_context``: ``ReplicaContext`` (collectives, ``merge_call``);
* ``cross_replica``: ``reduce``, ``gather`` and local results;
* ``losses``: ``compute_average_loss``;
* ``run_options``: ``RunOptions``.
"""
