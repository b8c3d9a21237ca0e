"""``RayClusterResolver``: a parameter-server cluster made of Ray actors."""

from __future__ import annotations

import math
import os
import time
import warnings

from jaxmirror.cluster_resolver.base import ClusterResolver
from jaxmirror.cluster_resolver.cluster_spec import ClusterSpec
from jaxmirror.cluster_resolver import ray_support

DEFAULT_STARTUP_TIMEOUT = 120.0
_RAY_WAIT_S = 30  # Ray's own fixed wait for each process of a new node (ray/_private/node.py)
_GCS_WAIT_VAR = "RAY_gcs_server_port_wait_time_s"


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


def _seconds(value) -> float:
    try:  # an int too big for a float overflows
        seconds = float(value) if isinstance(value, (int, float)) else math.nan
    except OverflowError:
        seconds = math.inf
    if isinstance(value, bool) or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"RayClusterResolver: `startup_timeout_seconds` must be a finite number "
                         f"of seconds > 0, got {value!r}; give e.g. 300 on a busy machine.")
    return seconds


def _try_init(ray, kwargs: dict, timeout: float, wait: int) -> None:
    """One ``ray.init``, with Ray's GCS start-up wait set to ``wait`` seconds unless the operator
    set it (Ray reads the variable during the call; it is restored after), and the workers'
    registration bounded by ``timeout`` (a new dict each time: Ray writes the try's session
    directory into it)."""
    gcs_wait = os.environ.get(_GCS_WAIT_VAR)
    if gcs_wait is None:
        os.environ[_GCS_WAIT_VAR] = str(wait)
    system_config = {"worker_register_timeout_seconds": max(60, math.ceil(timeout))}
    try:
        ray.init(**kwargs, _system_config=system_config)
    finally:
        if gcs_wait is None:
            os.environ.pop(_GCS_WAIT_VAR, None)


def _start_local(ray, kwargs: dict, timeout: float) -> None:
    """Start a local Ray node, trying again while ``timeout`` seconds have not passed when its
    processes start too slowly (a busy machine); the failed tries' processes are stopped."""
    deadline = time.monotonic() + timeout
    tries = 0
    while True:
        tries += 1
        before = ray_support.child_pids()
        try:
            _try_init(ray, kwargs, timeout,
                      max(_RAY_WAIT_S, math.ceil(deadline - time.monotonic())))
            return
        except Exception as e:  # noqa: BLE001 -- Ray raises a plain Exception for it
            if not ray_support.is_startup_timeout(e):
                raise
            ray_support.stop_new_ray_processes(before)
            ray.shutdown()
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"RayClusterResolver: the local Ray node did not start within "
                    f"{timeout:g} s ({tries} tries; the machine may be busy; Ray said: {e}); "
                    f"give it longer with RayClusterResolver(num_workers, num_ps, "
                    f"startup_timeout_seconds=...) and pass that resolver to "
                    f"ParameterServerStrategy, or start Ray first (`ray start --head`) and "
                    f"pass address='auto'.") from e
            time.sleep(1.0)


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
        startup_timeout_seconds: how long a local Ray node may take to start (default 120):
            on a busy machine Ray's processes can miss Ray's own 30 s wait, and the start is
            tried again (the failed try's processes stopped) until this time has passed; it
            also bounds Ray's wait for the GCS and for each actor's process to register.

    Raises:
        ValueError: for counts below 1 or a timeout that is not a positive number.
            ``TypeError`` for resources that are not dicts.
        ImportError: when Ray is not installed (``pip install 'jaxmirror[ray]'``).
        TimeoutError: when the local node did not start in time, saying what to do.

    Example:
        >>> import jaxmirror
        >>> r = jaxmirror.cluster_resolver.RayClusterResolver(2, 1)   # doctest: +SKIP
        >>> r.cluster_spec().num_tasks("worker")                       # doctest: +SKIP
        2
    """

    def __init__(self, num_workers, num_ps, address=None, worker_resources=None,
                 ps_resources=None, startup_timeout_seconds=DEFAULT_STARTUP_TIMEOUT):
        self.num_workers = _count("num_workers", num_workers, 1)
        self.num_ps = _count("num_ps", num_ps, 1)
        self.worker_resources = _resources("worker_resources", worker_resources)
        self.ps_resources = _resources("ps_resources", ps_resources)
        self.startup_timeout_seconds = _seconds(startup_timeout_seconds)
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
                    _start_local(ray, dict(num_cpus=max(2, os.cpu_count() or 1),
                                           include_dashboard=False, log_to_driver=True,
                                           configure_logging=False),
                                 self.startup_timeout_seconds)
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
