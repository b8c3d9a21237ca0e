"""The compiled step: what ``strategy.run`` makes of a function, and what runs inside it.

Modules:
    ``program``: ``Program``, a strategy's cache of them, ``Step``, ``RunOptions``, ``run``'s rules.
    ``call_plan``: how a step call runs: the plan chosen once per kind of arguments.
    ``compiled``: ``Compiled``: a program's jitted side; the user's function traced and emitted.
    ``arguments``: what a step's arguments may be, deleted and donated arrays, and placing them.
    ``graphs``: flax NNX objects in steps: as arguments, split and updated; by closure, refused.
    ``analysis``: the analyses of a traced step's jaxpr (a folder; its ``__init__`` lists them).
    ``fused``: ``FusedStep``: ``steps_per_execution`` steps in one program, a ``lax.scan`` inside.
    ``replica_context``: ``ReplicaContext``: collectives and ``merge_call``.
    ``cross_replica``: ``reduce``, ``gather``, local results, and the sums a step makes for them.
    ``losses``: ``compute_average_loss``.
"""
