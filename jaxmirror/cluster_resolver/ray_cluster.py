"""``RayClusterResolver``: a parameter-server cluster made of Ray actors."""

from __future__ import annotations

import os
import warnings

from jaxmirror.cluster_resolver.base import ClusterResolver
from jaxmirror.cluster_resolver.cluster_spec import ClusterSpec
from jaxmirror.cluster_resolver import ray_support


def _count(name: str, value, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"RayClusterResolver: `{name}` must be an integer >= {least}, got "
                         f"{value!r}.")
    return value


def _resources(name: str, value) -> dict | None:
    if value is not None and not isinstance(value, dict):
        raise TypeError(f"RayClusterResolver: `{name}` must be a dict of Ray actor options "
                        f"such as {{'num_gpus': 1}}, got {type(value).__name__}.")
    return dict(value) if value else None


class RayClusterResolver(ClusterResolver):
    """A cluster of ``num_workers`` workers and ``num_ps`` parameter servers run as Ray actors.

    Connects to the Ray cluster at ``address``, or to the one already initialized in this
    process, or starts a local one (stopped by ``shutdown()``, or when the process ends). This
    process is the chief (the coordinator). Ray addresses tasks by actor, not by port, so every
    task of ``cluster_spec()`` shows the Ray cluster's own address.

    Args:
        num_workers: how many worker actors (>= 1).
        num_ps: how many parameter-server actors (>= 1).
        address: a Ray cluster address (``"auto"``, ``"ray://host:10001"``, ``"host:6379"``), or
            ``None``.
        worker_resources: Ray options of each worker actor, e.g. ``{"num_gpus": 1}`` (a worker
            with GPUs runs one replica per GPU); by default no CPU is reserved.
        ps_resources: Ray options of each parameter-server actor.

    Raises:
        ValueError: for counts below 1. ``TypeError`` for resources that are not dicts.
        ImportError: when Ray is not installed (``pip install 'jaxmirror[ray]'``).

    Example:
        >>> import jaxmirror
        >>> r = jaxmirror.cluster_resolver.RayClusterResolver(2, 1)   # doctest: +SKIP
        >>> r.cluster_spec().num_tasks("worker")                       # doctest: +SKIP
        2
    """

    def __init__(self, num_workers, num_ps, address=None, worker_resources=None,
                 ps_resources=None):
        self.num_workers = _count("num_workers", num_workers, 1)
        self.num_ps = _count("num_ps", num_ps, 1)
        self.worker_resources = _resources("worker_resources", worker_resources)
        self.ps_resources = _resources("ps_resources", ps_resources)
        if address is not None and not isinstance(address, str):
            raise TypeError(f"RayClusterResolver: `address` must be a string or None, got "
                            f"{type(address).__name__}.")
        ray = ray_support.ray_module()
        self._started_ray = False
        if not ray.is_initialized():
            # Ray starts its processes with fork + exec, which is safe in a process where JAX
            # already runs threads; Python's warning about fork would only alarm.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called",
                                        category=RuntimeWarning)
                if address is None:
                    ray.init(num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False,
                             log_to_driver=True, configure_logging=False)
                    self._started_ray = True
                else:
                    ray.init(address=address, log_to_driver=True, configure_logging=False)
        self._address = ray.get_runtime_context().gcs_address
        self.task_type, self.task_id = "chief", 0
        self._clusters: list = []

    def cluster_spec(self) -> ClusterSpec:
        """The ``chief``, ``worker`` and ``ps`` jobs.

        Returns:
            A ``ClusterSpec``.
        """
        return ClusterSpec({"chief": [self._address],
                            "worker": [self._address] * self.num_workers,
                            "ps": [self._address] * self.num_ps})

    def master(self, task_type=None, task_id=None, rpc_layer=None) -> str:
        """The Ray cluster's address (every task is reached through it).

        Returns:
            A string.
        """
        return self._address

    def adopt(self, cluster) -> None:
        """Remember a ``RayCluster`` started for this resolver, to close it in ``shutdown``.

        Args:
            cluster: the cluster.

        Returns:
            ``None``.
        """
        self._clusters.append(cluster)

    def shutdown(self) -> None:
        """Kill the actors started for this resolver; stop Ray if this resolver started it.

        Returns:
            ``None``.
        """
        for cluster in self._clusters:
            cluster.close()
        self._clusters.clear()
        ray = ray_support.ray_module()
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        self._started_ray = False

    def __repr__(self) -> str:
        return (f"<RayClusterResolver {self.num_workers} worker(s), {self.num_ps} ps at "
                f"{self._address}>")
