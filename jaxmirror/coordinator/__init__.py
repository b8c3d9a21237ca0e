"""Parameter-server training on Ray: the actors, the closures and their scheduling.

Modules, bottom up (``cluster_resolver.ray_support`` imports Ray, which is optional): ``errors``,
``shipping`` (pickling functions and arguments for the workers), ``nnx_state`` (NNX objects'
state leaves, and a worker's copy of them), ``worker_runtime`` (a worker's state and what
pickled references resolve to there), ``closures`` (running closures in a worker), ``actors``
(the parameter server and worker actor classes), ``ps_variables`` (the coordinator's handles on
parameter-server values), ``nnx_binding`` (NNX objects whose state is on the parameter
servers), ``cluster`` (starting and replacing actors), ``per_worker`` (per-worker datasets and
iterators), ``remote_value``, ``dispatch`` (the closure queue) and ``cluster_coordinator``
(``ClusterCoordinator``). Nothing here imports the strategies; ``strategies.parameter_server``
builds on it.
"""
