"""The multi-worker runtime: the cluster's processes, joining them, and surviving failures.

Modules:
    ``cluster``: ``Layout``: a resolver's cluster as ``jax.distributed`` processes, chief first.
    ``service``: JAX's coordination service, run in a helper process of the chief.
    ``service_main``: the entry point of that helper process.
    ``connect``: joining with ``jax.distributed`` within a timeout, and leaving.
    ``failures``: the cluster's failure record: one worker's failure told to the others.
    ``watch``: the thread that notices when the cluster breaks.
    ``ledger``: workers agree, call by call, on the calls every worker must make.
    ``exchange``: ``StepExchange``: small per-step facts shared between workers.
    ``server``: ``Server``: this process as one task of a cluster.
"""
