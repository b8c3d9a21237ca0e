"""``RayCluster``: the parameter-server and worker actors of one ``ParameterServerStrategy``.

Workers are started with Ray's own restarts off: when a worker process dies, the calls in flight
on it fail within milliseconds, and the coordinator starts a replacement itself (``replace``)
and re-runs those closures there. Parameter servers are not restarted: their values would be
lost anyway, so their death is an error naming them.
"""

from __future__ import annotations

import os
import re

from jaxmirror.cluster_resolver import ray_support
from jaxmirror.coordinator.actors import ParameterServer, Worker
from jaxmirror.core.errors import DeadlineExceededError

_REMOTE_CLASSES: dict = {}
_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S+")


def _remote(cls):
    if cls not in _REMOTE_CLASSES:
        _REMOTE_CLASSES[cls] = ray_support.ray_module().remote(cls)
    return _REMOTE_CLASSES[cls]


def _options(resources: dict | None) -> dict:
    # Actors ask for no CPU by default: a laptop with 2 cores can still hold 2 workers and 2
    # parameter servers. Resources given (num_cpus, num_gpus, memory, resources) are Ray's.
    options = {"num_cpus": 0, "max_restarts": 0, "max_task_retries": 0,
               "enable_task_events": False}
    options.update(resources or {})
    return options


def worker_environment(resources: dict | None) -> dict:
    """Environment variables a worker process starts JAX with.

    A worker is one machine's worth of devices: CPU workers get one device (the simulated CPU
    device count of the coordinator's process is not inherited); workers given GPUs use them.

    Args:
        resources: the workers' Ray resources.

    Returns:
        A dict of environment variables.

    Example:
        >>> worker_environment(None)["JAX_PLATFORMS"]
        'cpu'
    """
    flags = _DEVICE_COUNT_FLAG.sub("", os.environ.get("XLA_FLAGS", "")).strip()
    env = {"XLA_FLAGS": flags}
    if not (resources or {}).get("num_gpus"):
        env["JAX_PLATFORMS"] = "cpu"
    return env


class RayCluster:
    """Start the actors: ``num_ps`` parameter servers and ``num_workers`` workers.

    Args:
        num_workers: how many workers.
        num_ps: how many parameter servers.
        worker_resources: Ray resources of each worker actor (e.g. ``{"num_gpus": 1}``).
        ps_resources: Ray resources of each parameter-server actor.
        strategy_factory: a function, importable in the workers, returning a worker's strategy.

    Example:
        (needs Ray; ``ParameterServerStrategy`` makes one)
        >>> RayCluster.__name__
        'RayCluster'
    """

    def __init__(self, num_workers: int, num_ps: int, worker_resources, ps_resources,
                 strategy_factory):
        self.num_workers = num_workers
        self.worker_options = dict(worker_resources or {})
        self._worker_options = _options(worker_resources)
        self._env = worker_environment(worker_resources)
        self._factory = strategy_factory
        ps_class = _remote(ParameterServer)
        self.ps = [ps_class.options(**_options(ps_resources)).remote(i) for i in range(num_ps)]
        self.workers = [self._start(i) for i in range(num_workers)]
        self.generation = [0] * num_workers  # bumped at each replacement
        self._closed = False

    def _start(self, index: int):
        return _remote(Worker).options(**self._worker_options).remote(
            index, self.num_workers, self.ps, self._factory, self._env)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until every actor is up (each is a new process that imports JAX: on a busy
        machine that can take minutes).

        Args:
            timeout: seconds.

        Returns:
            ``None``.

        Raises:
            jaxmirror.errors.DeadlineExceededError: naming the actors not up in time.
        """
        ray = ray_support.ray_module()
        names = ([f"parameter server {i}" for i in range(len(self.ps))]
                 + [f"worker {i}" for i in range(len(self.workers))])
        refs = [a.ping.remote() for a in self.ps + self.workers]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if pending:
            late = [name for name, ref in zip(names, refs) if ref in pending]
            raise DeadlineExceededError(
                f"ParameterServerStrategy: {', '.join(late)} did not start within {timeout:g} "
                f"s (the machine may be busy); wait longer: "
                f"strategy.extended.ray_cluster.wait_ready(timeout=...).")
        ray.get(refs)  # an actor that failed to start raises its error here

    @property
    def closed(self) -> bool:
        """Whether ``close()`` ran (``resolver.shutdown()`` closes every cluster)."""
        return self._closed

    def replace(self, index: int, generation: int) -> bool:
        """Start a new worker ``index`` in place of the one of ``generation`` (if not done yet).

        Args:
            index: the worker's index.
            generation: the generation that died.

        Returns:
            Whether a new worker was started now.
        """
        if self._closed or self.generation[index] != generation:
            return False
        ray = ray_support.ray_module()
        try:
            ray.kill(self.workers[index], no_restart=True)
        except Exception:  # already gone
            pass
        self.workers[index] = self._start(index)
        self.generation[index] += 1
        return True

    def worker_pids(self) -> list:
        """The workers' process ids (tests kill them)."""
        ray = ray_support.ray_module()
        return ray.get([w.ping.remote() for w in self.workers])

    def ps_pids(self) -> list:
        """The parameter servers' process ids."""
        ray = ray_support.ray_module()
        return ray.get([p.ping.remote() for p in self.ps])

    def close(self) -> None:
        """Kill every actor of this cluster.

        Returns:
            ``None``.
        """
        if self._closed:
            return
        self._closed = True
        ray = ray_support.ray_module()
        if not ray.is_initialized():
            return
        for actor in self.workers + self.ps:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
