"""``Layout``: the processes of a multi-worker cluster, read from a cluster resolver.

TF's multi-worker jobs are ``chief`` (at most one task) and ``worker``; together they run the
same program, chief first. ``jax.distributed`` numbers processes 0..n-1 and runs its
coordination service in process 0, so the chief (or worker 0 without a chief) is process 0
and the coordinator. Other jobs (``ps``, ``evaluator``) take no part in the collectives.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxmirror.cluster_resolver.cluster_spec import parse_address

# The jobs whose tasks run the synchronous program, in process order.
COLLECTIVE_JOBS = ("chief", "worker")


class Task(NamedTuple):
    """One process of the cluster: its TF job, index in that job, and ``host:port`` address."""

    job: str
    index: int
    address: str

    def __str__(self) -> str:
        return f"{self.job} {self.index} ({self.address})"


class Layout(NamedTuple):
    """The cluster as ``jax.distributed`` sees it.

    Attributes:
        tasks: every process's ``Task``, in process order (chief, then workers).
        process_id: this process's position in ``tasks``.
    """

    tasks: tuple
    process_id: int

    @property
    def num_processes(self) -> int:
        return len(self.tasks)

    @property
    def coordinator(self) -> Task:
        return self.tasks[0]

    @property
    def me(self) -> Task:
        return self.tasks[self.process_id]

    @property
    def others(self) -> list:
        """Every task but this one, in process order."""
        return [t for i, t in enumerate(self.tasks) if i != self.process_id]

    @property
    def is_chief(self) -> bool:
        return self.process_id == 0


def layout(resolver, api: str) -> Layout | None:
    """The cluster ``resolver`` describes, or ``None`` when it describes none (one process).

    Args:
        resolver: a ``cluster_resolver.ClusterResolver``.
        api: the caller, for error messages.

    Returns:
        A ``Layout``, or ``None`` for an empty cluster spec (TF then trains on this machine).

    Raises:
        ValueError: when this task is not a chief or worker, its index is outside its job,
            there is more than one chief, an address is not ``host:port``, or two tasks share
            one.

    Example:
        >>> from jaxmirror.cluster_resolver import ClusterSpec, SimpleClusterResolver
        >>> spec = ClusterSpec({"chief": ["a:1"], "worker": ["b:2", "c:3"]})
        >>> lay = layout(SimpleClusterResolver(spec, task_type="worker", task_id=1), "api")
        >>> lay.process_id, lay.coordinator.address, lay.num_processes
        (2, 'a:1', 3)
    """
    spec = resolver.cluster_spec().as_dict()
    tasks = []
    for job in COLLECTIVE_JOBS:
        addresses = spec.get(job, [])
        if isinstance(addresses, dict):
            # A sparse job (TF allows {index: address}) cannot number processes densely.
            if sorted(addresses) != list(range(len(addresses))):
                raise ValueError(f"{api}: job {job!r} of the cluster has task indices "
                                 f"{sorted(addresses)}; a multi-worker cluster needs 0..n-1.")
            addresses = [addresses[i] for i in range(len(addresses))]
        for index, address in enumerate(addresses):
            parse_address(address, f"{api}: cluster job {job!r} task {index}")
            tasks.append(Task(job, index, address))
    if not tasks:
        if spec:
            raise ValueError(f"{api}: the cluster has no 'chief' or 'worker' job (it has "
                             f"{sorted(spec)}); MultiWorkerMirroredStrategy runs on workers.")
        return None
    seen = {}
    for task in tasks:
        if task.address in seen:
            raise ValueError(f"{api}: {seen[task.address]} and {task} of the cluster have the same "
                             f"address; give every task its own host:port in TF_CONFIG (or the "
                             f"cluster resolver).")
        seen[task.address] = task
    if len(spec.get("chief", [])) > 1:
        raise ValueError(f"{api}: the cluster has {len(spec['chief'])} chief tasks; TF allows "
                         f"at most one.")
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type is None or task_id is None:
        raise ValueError(f"{api}: the cluster resolver names no task for this process (task_type="
                         f"{task_type!r}, task_id={task_id!r}); set TF_CONFIG's \"task\", e.g. "
                         f"{{\"type\": \"worker\", \"index\": 0}}.")
    if task_type not in COLLECTIVE_JOBS:
        raise ValueError(f"{api}: this task is {task_type!r} {task_id}, but only 'chief' and "
                         f"'worker' tasks run MultiWorkerMirroredStrategy (a 'ps' task is for "
                         f"ParameterServerStrategy).")
    for process_id, task in enumerate(tasks):
        if (task.job, task.index) == (task_type, task_id):
            return Layout(tuple(tasks), process_id)
    count = sum(t.job == task_type for t in tasks)
    raise ValueError(f"{api}: task index {task_id} is outside the cluster: job {task_type!r} "
                     f"has {count} task(s).")
