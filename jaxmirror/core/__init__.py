"""The bottom layer: what every other layer builds on. It imports nothing else of jaxmirror.

Modules:
    ``context``: who is current: the stack of (strategy, replica context) entries.
    ``values``: ``PerReplica`` and ``Mirrored``, the distributed values.
    ``reduce_op``: ``ReduceOp``, ``VariableAggregation`` and ``VariableSynchronization``.
    ``devices``: TF device names, and simulated CPU devices.
    ``placement``: ``Placement``: a strategy's devices, mesh and shardings; how it places values.
    ``across_processes``: one value placed on several processes' devices.
    ``bits``: moving floats bit for bit, as unsigned integers.
    ``replicated``: ``mark_replicated``: a value known to be the same on every replica.
    ``stateful``: ``Stateful``: what a compiled step needs from a variable.
    ``binding``: the traced stand-ins a step gives its variables while it is traced.
    ``inflight``: the bound on steps queued on CPU devices.
    ``checkpointable``: ``Checkpointable``: objects a checkpoint saves as a small array.
    ``errors``: TF's error names for failures between processes (``UnavailableError``, ...).
    ``rich_display``: the HTML tables Jupyter shows for values, variables and strategies.
    ``_compat``: every JAX-version-specific call; the only module that touches ``jax._src``.
"""
