"""`ClusterResolver`, TF's abstract base of cluster resolvers, and `SimpleClusterResolver`."""

from __future__ import annotations

import abc
from collections.abc import Mapping

import jax

from jaxmirror.cluster_resolver.cluster_spec import ClusterSpec

# JAX names the platform of CUDA and ROCm devices 'gpu' (some versions 'cuda'/'rocm'); CPUs
# are not accelerators, as in TF.
_ACCELERATOR_KINDS = {"gpu": "GPU", "cuda": "GPU", "rocm": "GPU", "tpu": "TPU"}


def format_master_url(master: str, rpc_layer: str | None = None) -> str:
    """``"rpc_layer://master"``, or ``master`` alone when there is no RPC layer or no master.

    TF writes ``"grpc://"`` for an empty master; an empty master stays ``""`` here.

    Example:
        >>> format_master_url("host:2222", "grpc"), format_master_url("host:2222")
        ('grpc://host:2222', 'host:2222')
    """
    return f"{rpc_layer}://{master}" if rpc_layer and master else master


def local_accelerators() -> dict[str, int]:
    """This process's accelerators by TF kind, e.g. ``{"GPU": 2}``; ``{}`` on a CPU-only host.

    Example:
        >>> counts = local_accelerators()  # e.g. {"GPU": 2}; {} with CPUs only
        >>> set(counts) <= {"GPU", "TPU"} and all(n > 0 for n in counts.values())
        True
    """
    counts: dict[str, int] = {}
    for device in jax.local_devices():
        kind = _ACCELERATOR_KINDS.get(device.platform)
        if kind is not None:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


class ClusterResolver(abc.ABC):
    """The base of all cluster resolvers (TF's ``tf.distribute.cluster_resolver.ClusterResolver``).

    A cluster resolver tells a multi-process strategy which cluster it runs in (`cluster_spec`)
    and which task of it this process is (`task_type`, `task_id`). Subclasses implement
    `cluster_spec` and `master`, and set ``self._task_type``, ``self._task_id`` and
    ``self._rpc_layer`` (or override the properties).

    - ``task_type``: this process's job, e.g. ``"chief"``, ``"worker"``, ``"ps"``,
      ``"evaluator"``; ``None`` when it does not apply.
    - ``task_id``: this process's index within its job; ``None`` when it does not apply.
    - ``rpc_layer``: the protocol between tasks, e.g. ``"grpc"``; ``None`` for none.

    Example:
        >>> class OneTask(ClusterResolver):
        ...     def cluster_spec(self):
        ...         return ClusterSpec({"worker": ["localhost:2222"]})
        ...     def master(self, task_type=None, task_id=None, rpc_layer=None):
        ...         return ""
        >>> resolver = OneTask()
        >>> resolver.task_type, resolver.task_id, resolver.environment
        (None, None, '')
        >>> resolver.task_type, resolver.task_id = "worker", 0
        >>> resolver.cluster_spec().task_address(resolver.task_type, resolver.task_id)
        'localhost:2222'
    """

    @abc.abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """The cluster as it is now: a `ClusterSpec` (re-read every call, not cached).

        Returns:
            A `ClusterSpec`.
        """

    @abc.abstractmethod
    def master(self, task_type=None, task_id=None, rpc_layer=None) -> str:
        """The address of a task, e.g. ``"grpc://host:2222"`` (TF 1's session master).

        Args:
            task_type: the task's job; this resolver's own task when ``None``.
            task_id: the task's index; this resolver's own task when ``None``.
            rpc_layer: the protocol put in front; this resolver's `rpc_layer` when ``None``.

        Returns:
            The address as a string, ``""`` when there is none.
        """

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None) -> dict[str, int]:
        """The accelerators of a task by kind, e.g. ``{"GPU": 2}``; ``{}`` without any.

        This counts this process's own devices (`jax.local_devices`): JAX cannot ask another
        process, so every task is taken to have the same devices as this one, as TF's
        multi-worker strategies assume. CPUs are not counted.

        Args:
            task_type: unused (accepted for TF's signature).
            task_id: unused (accepted for TF's signature).
            config_proto: unused (TF's session configuration).

        Returns:
            A dict from ``"GPU"``/``"TPU"`` to a count; ``{}`` on a CPU-only machine.
        """
        del task_type, task_id, config_proto
        return local_accelerators()

    @property
    def environment(self) -> str:
        """``"google"`` inside Google, ``""`` elsewhere (always ``""`` unless a subclass says)."""
        return ""

    @property
    def task_type(self):
        """This process's job name (e.g. ``"worker"``), or ``None``; settable."""
        return getattr(self, "_task_type", None)

    @task_type.setter
    def task_type(self, task_type):
        self._task_type = task_type

    @property
    def task_id(self):
        """This process's index within its job, or ``None``; settable."""
        return getattr(self, "_task_id", None)

    @task_id.setter
    def task_id(self, task_id):
        self._task_id = task_id

    @property
    def rpc_layer(self):
        """The protocol between tasks, e.g. ``"grpc"``, or ``None``; settable."""
        return getattr(self, "_rpc_layer", None)

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer):
        self._rpc_layer = rpc_layer


def check_task(api: str, task_type, task_id) -> None:
    """TypeError/ValueError naming ``api`` unless ``task_type`` is a string or ``None`` and
    ``task_id`` an integer >= 0 or ``None``."""
    if task_type is not None and (not isinstance(task_type, str) or not task_type):
        raise TypeError(f"{api}: `task_type` must be a job name such as 'worker', got "
                        f"{type(task_type).__name__} {task_type!r}.")
    if task_id is not None and (isinstance(task_id, bool) or not isinstance(task_id, int)):
        raise TypeError(f"{api}: `task_id` must be an integer >= 0, got "
                        f"{type(task_id).__name__} {task_id!r}.")
    if task_id is not None and task_id < 0:
        raise ValueError(f"{api}: `task_id` must be an integer >= 0, got {task_id}.")


class SimpleClusterResolver(ClusterResolver):
    """A cluster resolver that returns what it was given (TF's ``SimpleClusterResolver``).

    Args:
        cluster_spec: the cluster: a `ClusterSpec` (or a dict, made into one).
        master: the master address `master` returns when no task is asked for.
        task_type: this process's job, e.g. ``"worker"``.
        task_id: this process's index within its job.
        environment: ``"google"`` or ``""``.
        num_accelerators: what `num_accelerators` returns, e.g. ``{"GPU": 8}``, as given. As in
            TF, nothing is detected: ``None`` means ``{}`` (no accelerators).
        rpc_layer: the protocol `master` puts in front of addresses, e.g. ``"grpc"``.

    Raises:
        TypeError: an argument has the wrong type; the message names it.

    Example:
        >>> spec = ClusterSpec({"worker": ["w0.example.com:2222", "w1.example.com:2222"]})
        >>> resolver = SimpleClusterResolver(spec, task_type="worker", task_id=1,
        ...                                  num_accelerators={"GPU": 8}, rpc_layer="grpc")
        >>> resolver.task_type, resolver.task_id, resolver.num_accelerators()
        ('worker', 1, {'GPU': 8})
        >>> resolver.master("worker", 0)
        'grpc://w0.example.com:2222'
    """

    def __init__(self, cluster_spec, master="", task_type=None, task_id=None, environment="",
                 num_accelerators=None, rpc_layer=None):
        api = "SimpleClusterResolver"
        if isinstance(cluster_spec, Mapping) or cluster_spec is None:
            cluster_spec = ClusterSpec(cluster_spec)
        if not isinstance(cluster_spec, ClusterSpec):
            raise TypeError(f"{api}: `cluster_spec` must be a ClusterSpec, got "
                            f"{type(cluster_spec).__name__} {cluster_spec!r}.")
        if not isinstance(master, str):
            raise TypeError(f"{api}: `master` must be a string, got {type(master).__name__} "
                            f"{master!r}.")
        check_task(api, task_type, task_id)
        if num_accelerators is not None and not isinstance(num_accelerators, Mapping):
            raise TypeError(f"{api}: `num_accelerators` must be a dict such as {{'GPU': 8}}, "
                            f"got {type(num_accelerators).__name__} {num_accelerators!r}.")
        self._cluster_spec = cluster_spec
        self._master = master
        self._task_type = task_type
        self._task_id = task_id
        self._environment = environment
        self._num_accelerators = num_accelerators
        self._rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        """The `ClusterSpec` given to the constructor.

        Returns:
            A `ClusterSpec`.
        """
        return self._cluster_spec

    def master(self, task_type=None, task_id=None, rpc_layer=None) -> str:
        """The given master, or task ``task_id`` of ``task_type``'s address when both are given.

        Args:
            task_type: a job of the cluster.
            task_id: a task index of that job.
            rpc_layer: the protocol put in front; this resolver's `rpc_layer` when ``None``.

        Returns:
            E.g. ``"grpc://host:2222"``; ``""`` when no master was given and no task is asked for.
        """
        if task_type is not None and task_id is not None:
            master = self._cluster_spec.task_address(task_type, task_id)
        else:
            master = self._master
        return format_master_url(master, rpc_layer or self._rpc_layer)

    @property
    def environment(self) -> str:
        """The ``environment`` given to the constructor."""
        return self._environment

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None) -> dict:
        """The ``num_accelerators`` given to the constructor, or ``{}``; the arguments are unused.

        Returns:
            A dict from accelerator kind to count.
        """
        del task_type, task_id, config_proto
        return {} if self._num_accelerators is None else self._num_accelerators
