"""The bottom layer: what every other layer of jaxmirror builds on, and nothing above it.

* ``context``: the stack of (strategy, replica context) entries, and the registry the default
  strategy fills in;
* ``values``: ``PerReplica`` and ``Mirrored`` values;
* ``reduce_op``: ``ReduceOp``, ``VariableAggregation``, ``VariableSynchronization``;
* ``devices``: TF device names, simulated CPU devices;
* ``placement``: a strategy's mesh, shardings and the ways it places values;
* ``stateful`` and ``binding``: what a compiled step needs from values with state, and the
  traced stand-ins it binds them to;
* ``inflight``: the bound on steps queued on CPU devices;
* ``_compat``: every JAX-version-specific call.
"""
