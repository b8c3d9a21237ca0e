"""Strategies: ``Strategy`` and ``StrategyExtended``, and one module per concrete strategy.

Strategies differ only in their devices and where they keep variables; everything else
(``run``, ``reduce``, the input methods) is shared.

Modules:
    ``strategy``: ``Strategy``: one class for every strategy.
    ``input_methods``: the ``Strategy`` methods that bring host data onto the replicas.
    ``extended``: ``StrategyExtended``: TF's extended API, and ``placement``.
    ``updates``: ``reduce_to``, ``batch_reduce_to`` and ``update``.
    ``default``: the default strategy, what is current when no strategy is.
    ``mirrored``: ``MirroredStrategy``.
    ``one_device``: ``OneDeviceStrategy``.
    ``central_storage``: ``CentralStorageStrategy``.
    ``multi_worker``: ``MultiWorkerMirroredStrategy``.
    ``parameter_server``: ``ParameterServerStrategy``, and ``WorkerStrategy``.
    ``tpu``: ``TPUStrategy``.
"""
