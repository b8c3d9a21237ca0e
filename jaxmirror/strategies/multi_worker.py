"""``MultiWorkerMirroredStrategy``: synchronous data parallelism over many machines.

Every worker runs the same program. The strategy joins the cluster its resolver describes
with ``jax.distributed`` (the chief, or worker 0, is the coordinator) and runs one SPMD
program over a global mesh of every worker's devices: XLA's collectives cross the processes
(NCCL on GPUs, gloo between CPU processes). Values a worker reads are this worker's replicas'
(``experimental_local_results``) or replicated on every device (``reduce``, ``gather``, Mirrored
results), so nothing ever fetches an array held by another process.
"""

from __future__ import annotations

import jax

from jaxmirror.cluster_resolver.base import ClusterResolver
from jaxmirror.cluster_resolver.tf_config import TFConfigClusterResolver
from jaxmirror.collectives.communication import CommunicationOptions
from jaxmirror.core import devices as devices_lib
from jaxmirror.runtime import cluster, connect, watch
from jaxmirror.strategies.extended import StrategyExtended
from jaxmirror.strategies.strategy import Strategy

_API = "MultiWorkerMirroredStrategy"


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous training on many workers (``tf.distribute.MultiWorkerMirroredStrategy``).

    Start the same program on every worker, each with its ``TF_CONFIG`` (``python -m
    jaxmirror.launch --workers N script.py`` does that on one machine). Construction joins the
    cluster: it returns once every worker has joined, or raises within
    ``communication_options.timeout_seconds`` naming the workers that did not. One replica per
    device of every worker: ``num_replicas_in_sync`` counts them all; ``extended.worker_devices``
    lists this worker's. Datasets given to ``experimental_distribute_dataset`` are read in full
    by every worker, each keeping its replicas' rows of every global batch (TF's auto-shard
    ``DATA``). With no cluster (``TF_CONFIG`` unset) it trains on this machine's devices, as TF.

    Create it before any other JAX work: ``jax.distributed`` must start before JAX's backend.

    Args:
        cluster_resolver: a ``jaxmirror.cluster_resolver.ClusterResolver``; ``None`` reads
            ``TF_CONFIG`` (``TFConfigClusterResolver``).
        communication_options: a ``jaxmirror.experimental.CommunicationOptions``; its
            ``timeout_seconds`` bounds joining the cluster and is the heartbeat timeout after
            which a silent worker counts as dead (default 300 s); ``bytes_per_pack`` and
            ``wire_dtype`` are the defaults of every all-reduce (a call's own options override
            them). The sums are ``NcclAllReduce`` packs (gloo between CPU processes).

    Raises:
        ValueError: for a malformed cluster (see the resolver), a task that is not a chief or
            worker, or bad arguments; before anything starts.
        TimeoutError: when the cluster does not assemble within the timeout.
        RuntimeError: when JAX has already started, or ``jax.distributed`` was initialized for
            another cluster.

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.MultiWorkerMirroredStrategy()   # no TF_CONFIG: this machine only
        >>> s.num_replicas_in_sync == len(s.extended.worker_devices)
        True
        >>> s.cluster_resolver.cluster_spec().as_dict()
        {}
    """

    def __init__(self, cluster_resolver=None, communication_options=None):
        if cluster_resolver is None:
            cluster_resolver = TFConfigClusterResolver()
        if not isinstance(cluster_resolver, ClusterResolver):
            raise ValueError(f"{_API}: `cluster_resolver` must be a jaxmirror.cluster_resolver."
                             f"ClusterResolver or None; got {cluster_resolver!r}.")
        if communication_options is None:
            communication_options = CommunicationOptions()
        if not isinstance(communication_options, CommunicationOptions):
            raise ValueError(f"{_API}: `communication_options` must be a jaxmirror.experimental."
                             f"CommunicationOptions or None; got {communication_options!r}.")
        timeout = communication_options.timeout_seconds or connect.DEFAULT_TIMEOUT
        layout = cluster.layout(cluster_resolver, _API)
        if layout is not None and layout.num_processes == 1:
            # One worker needs no runtime; with jax.distributed up, XLA's CPU client would
            # route even its local collectives through gloo's TCP (measured: ~20x slower).
            layout = None
        if layout is not None:
            limit = communication_options.timeout_seconds
            connect.join(layout, timeout, _API, heartbeat=connect.heartbeat_for(limit))
            watch.set_timeout(limit)
        self._cluster_resolver = cluster_resolver
        self._communication_options = communication_options
        self._timeout = timeout
        self._layout = layout
        tasks = None if layout is None else tuple((t.job, t.index) for t in layout.tasks)
        super().__init__(StrategyExtended(self, devices_lib.default_global_devices(),
                                          tasks=tasks,
                                          communication_options=communication_options))

    @property
    def cluster_resolver(self):
        """The ``ClusterResolver`` the strategy read its cluster from."""
        return self._cluster_resolver

    @property
    def communication_options(self) -> CommunicationOptions:
        """The ``CommunicationOptions`` given (or the defaults)."""
        return self._communication_options

    def _constructor_args(self) -> tuple:
        return (self._cluster_resolver, self._communication_options)

    def experimental_initialize(self) -> None:
        """Connect the collectives now (a first all-reduce over every worker's devices).

        The first collective between processes sets up their connections; doing it here keeps
        that cost out of the first training step.

        Returns:
            None.

        Example:
            >>> import jaxmirror
            >>> jaxmirror.MultiWorkerMirroredStrategy().experimental_initialize()
        """
        total = self.reduce("SUM", self.run(lambda: jax.numpy.float32(1.0)), axis=None)
        if int(total) != self.num_replicas_in_sync:
            raise RuntimeError(f"{_API}: the warm-up all-reduce over "
                               f"{self.num_replicas_in_sync} replicas gave {int(total)}.")

    def experimental_finalize(self) -> None:
        """Shut the multi-worker runtime down cleanly (every worker calls it at the end).

        Waits for the other workers, then stops ``jax.distributed``; after it the strategy
        cannot run steps. Without a cluster it does nothing.

        Returns:
            None.

        Example:
            >>> import jaxmirror
            >>> jaxmirror.MultiWorkerMirroredStrategy().experimental_finalize()
        """
        if self._layout is not None:
            connect.leave()

    def update_config_proto(self, config=None) -> dict:
        """The JAX/XLA settings this strategy runs with, added to ``config`` (a dict); with
        ``Strategy.update_config_proto``'s keys and ``initialization_timeout``.

        Args:
            config: a dict (or ``None``) to update; it is not modified.

        Returns:
            A new dict.

        Example:
            >>> import jaxmirror
            >>> cfg = jaxmirror.MultiWorkerMirroredStrategy().update_config_proto()
            >>> cfg["num_processes"], cfg["jax_cpu_collectives_implementation"]
            (1, 'gloo')
        """
        out = super().update_config_proto(config)
        out["initialization_timeout"] = self._timeout
        return out

    def __repr__(self) -> str:
        return (f"<{_API} with {self.num_replicas_in_sync} replica(s) on "
                f"{jax.process_count()} worker(s)>")
