"""Parameter-server training on Ray: the actors, the closures and their scheduling.

Ray is imported only when it is used (``cluster_resolver.ray_support``). Nothing here imports
the strategies; ``strategies.parameter_server`` builds on it.

Modules:
    ``errors``: the errors parameter-server training raises, with the worker's traceback.
    ``shipping``: pickling functions and arguments for workers, noting their variables.
    ``nnx_state``: NNX objects' state leaves, and a worker's copy of the objects.
    ``worker_runtime``: inside a worker: its copies of variables, what references resolve to.
    ``closures``: running closures in a worker: load, run, send the changes.
    ``actors``: the parameter-server and worker actor classes.
    ``ps_variables``: ``PSVariable``: the coordinator's handle on a parameter-server variable.
    ``nnx_binding``: NNX objects whose state lives on the parameter servers.
    ``cluster``: ``RayCluster``: starting the actors, and replacing dead workers.
    ``per_worker``: per-worker datasets and iterators.
    ``remote_value``: ``RemoteValue``: a scheduled function's result.
    ``dispatch``: the closure queue: calls in flight, re-runs after a worker dies.
    ``cluster_coordinator``: ``ClusterCoordinator``.
"""
