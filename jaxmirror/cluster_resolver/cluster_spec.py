"""`ClusterSpec` (TF's ``tf.train.ClusterSpec``) and `parse_address`, the one "host:port" check.

A cluster is a set of jobs (``"worker"``, ``"chief"``, ``"ps"``, ...), each a set of tasks
numbered from 0 and reached at a ``"host:port"`` address. Everything is checked when the spec
is built, so a typo in a cluster fails where it is written, not when a process tries to connect.
"""

from __future__ import annotations

import ipaddress
import operator
import re
from collections.abc import Mapping

# Letters, digits, '-', '_' and dots: hostnames, Kubernetes service names (which may hold
# underscores in Docker Compose) and IPv4 addresses all fit.
_HOST_RE = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?")
_PORT_RE = re.compile(r"[0-9]+")
EXPECTED_ADDRESS = ("expected 'host:port' with a port in 1-65535, e.g. 'localhost:2222' "
                    "(an IPv6 host in brackets: '[::1]:2222')")


def parse_address(address, where: str = "parse_address") -> tuple[str, int]:
    """Splits a task's ``"host:port"`` address, checking it.

    The host is a hostname, an IPv4 address, or an IPv6 address in brackets; the port is an
    integer in 1-65535. Every address of a `ClusterSpec` goes through this check.

    Args:
        address: the address, e.g. ``"worker0.example.com:2222"`` or ``"[::1]:2222"``.
        where: what the address belongs to, put at the head of an error message, e.g.
            ``"ClusterSpec: job 'worker' task 1"``.

    Returns:
        ``(host, port)``: the host as written (an IPv6 host without its brackets) and the port
        as an ``int``.

    Raises:
        TypeError: ``address`` is not a string.
        ValueError: ``address`` is not ``"host:port"``; the message names ``where``, quotes the
            address and says what was expected.

    Example:
        >>> parse_address("worker0.example.com:2222")
        ('worker0.example.com', 2222)
        >>> parse_address("[::1]:2222")
        ('::1', 2222)
        >>> parse_address("localhost", where="job 'worker' task 0")
        Traceback (most recent call last):
        ValueError: job 'worker' task 0: address 'localhost' has no port; expected 'host:port' ...
    """
    if not isinstance(address, str):
        raise TypeError(f"{where}: address {address!r} is a {type(address).__name__}, not a "
                        f"string; {EXPECTED_ADDRESS}.")

    def bad(why):
        return ValueError(f"{where}: address {address!r} {why}; {EXPECTED_ADDRESS}.")

    if "://" in address:
        raise bad("has a protocol; give the protocol as `rpc_layer`, not in the address")
    if address.startswith("["):
        host, sep, rest = address[1:].partition("]")
        if not sep:
            raise bad("opens a '[' it does not close")
        if not rest.startswith(":"):
            raise bad("has no port")
        port = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise bad(f"has {host!r} in brackets, which is not an IPv6 address") from None
    else:
        host, sep, port = address.rpartition(":")
        if not sep:
            raise bad("has no port")
        if ":" in host:
            raise bad("looks like an IPv6 address without brackets")
        if not _HOST_RE.fullmatch(host):
            raise bad("has no host" if not host else f"has an invalid host {host!r}")
    if not _PORT_RE.fullmatch(port):
        raise bad(f"has port {port!r}, not an integer" if port else "has no port")
    if not 1 <= int(port) <= 65535:
        raise bad(f"has port {int(port)}, outside 1-65535")
    return host, int(port)


def describe_indices(indices) -> str:
    """``"0-2"`` for dense task indices, ``"0, 2, 5"`` for sparse ones, ``"none"`` for no task."""
    indices = sorted(indices)
    if not indices:
        return "none"
    if len(indices) > 1 and indices == list(range(indices[0], indices[-1] + 1)):
        return f"{indices[0]}-{indices[-1]}"
    return ", ".join(map(str, indices))


def _task_index(key, where: str, job: str) -> int:
    # JSON (TF_CONFIG) can only spell a sparse job's indices as strings: "1" means task 1.
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    if isinstance(key, bool) or not isinstance(key, int):
        raise TypeError(f"{where}: job {job!r} has task index {key!r}, a "
                        f"{type(key).__name__}; task indices are integers >= 0.")
    if key < 0:
        raise ValueError(f"{where}: job {job!r} has task index {key}; task indices are "
                         f"integers >= 0.")
    return int(key)


def normalize_cluster(cluster, where: str = "ClusterSpec") -> dict[str, dict[int, str]]:
    """Checks a cluster given as a dict and returns it as ``{job: {task index: address}}``.

    Args:
        cluster: ``None`` (no jobs) or a mapping from job names to a list of addresses (tasks
            0, 1, ...) or a dict ``{task index: address}`` (a sparse job, as TF allows).
        where: what the cluster is, at the head of error messages, e.g. ``"TF_CONFIG['cluster']"``.

    Returns:
        A new dict, jobs sorted by name and each job's tasks sorted by index.

    Raises:
        TypeError: a job name, a job's tasks, an index or an address has the wrong type.
        ValueError: an index is negative or repeated, or an address is not ``"host:port"``.

    Example:
        >>> normalize_cluster({"worker": ["a:1", "b:2"], "ps": {"3": "c:3"}})
        {'ps': {3: 'c:3'}, 'worker': {0: 'a:1', 1: 'b:2'}}
    """
    if cluster is None:
        return {}
    if not isinstance(cluster, Mapping):
        raise TypeError(f"{where}: the cluster must be a dict mapping job names to lists of "
                        f"'host:port' strings, got {type(cluster).__name__} {cluster!r}.")
    jobs = {}
    for job, tasks in cluster.items():
        if not isinstance(job, str) or not job:
            raise TypeError(f"{where}: job name {job!r} is not a non-empty string.")
        if isinstance(tasks, (list, tuple)):
            items = list(enumerate(tasks))
        elif isinstance(tasks, Mapping):
            items = [(_task_index(k, where, job), v) for k, v in tasks.items()]
            seen = set()
            for index, _ in items:
                if index in seen:
                    raise ValueError(f"{where}: job {job!r} gives task {index} twice (as the "
                                     f"key {index} and the key '{index}').")
                seen.add(index)
        else:
            hint = f"; write [{tasks!r}] for one task" if isinstance(tasks, str) else ""
            raise TypeError(f"{where}: job {job!r} must be a list of 'host:port' strings or a "
                            f"dict {{task index: 'host:port'}}, got {type(tasks).__name__} "
                            f"{tasks!r}{hint}.")
        for index, address in items:
            parse_address(address, where=f"{where}: job {job!r} task {index}")
        jobs[job] = dict(sorted(items))
    return dict(sorted(jobs.items()))


class ClusterSpec:
    """A cluster as a set of jobs, each a set of tasks with network addresses (TF's
    ``tf.train.ClusterSpec``).

    Unlike TF, `jobs` are sorted by name, every address is checked, and there is no
    ``as_cluster_def`` (no protocol buffers here).

    Args:
        cluster: a dict mapping job names to a list of ``"host:port"`` addresses (tasks 0, 1,
            ...) or to a dict ``{task index: "host:port"}`` (a sparse job: a process may know only
            some of the tasks); or another `ClusterSpec`; or ``None`` or ``{}`` for no jobs.

    Raises:
        TypeError: ``cluster`` or a part of it has the wrong type; the message names the job.
        ValueError: an address is not ``"host:port"`` (see `parse_address`) or an index is bad.

    Example:
        >>> spec = ClusterSpec({"worker": ["w0.example.com:2222", "w1.example.com:2222"],
        ...                     "ps": {1: "ps1.example.com:2222"}})
        >>> spec.jobs
        ['ps', 'worker']
        >>> spec.num_tasks("worker"), spec.task_indices("ps")
        (2, [1])
        >>> spec.task_address("worker", 1)
        'w1.example.com:2222'
        >>> spec.as_dict()
        {'ps': {1: 'ps1.example.com:2222'},
         'worker': ['w0.example.com:2222', 'w1.example.com:2222']}
        >>> ClusterSpec(spec.as_dict()) == spec
        True
        >>> spec.task_address("chief", 0)
        Traceback (most recent call last):
        ValueError: ClusterSpec: no job 'chief' in the cluster; its jobs are ['ps', 'worker'].
    """

    def __init__(self, cluster=None):
        if isinstance(cluster, ClusterSpec):
            self._jobs = {job: dict(tasks) for job, tasks in cluster._jobs.items()}
        else:
            self._jobs = normalize_cluster(cluster, "ClusterSpec")

    def __bool__(self):
        return bool(self._jobs)

    def __eq__(self, other):
        if isinstance(other, Mapping):
            try:
                other = ClusterSpec(other)
            except (TypeError, ValueError):
                return False
        if not isinstance(other, ClusterSpec):
            return NotImplemented
        return self._jobs == other._jobs

    __hash__ = None  # equal to dicts, which are not hashable

    def __repr__(self):
        return f"ClusterSpec({self.as_dict()!r})"

    @property
    def jobs(self) -> list[str]:
        """The job names, sorted."""
        return list(self._jobs)

    def _job(self, job_name) -> dict[int, str]:
        try:
            return self._jobs[job_name]
        except (KeyError, TypeError):
            there = f"its jobs are {self.jobs}" if self._jobs else "the cluster has no jobs"
            raise ValueError(f"ClusterSpec: no job {job_name!r} in the cluster; {there}.") from None

    def num_tasks(self, job_name: str) -> int:
        """The number of tasks of ``job_name``; ValueError if the cluster has no such job."""
        return len(self._job(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        """The sorted task indices of ``job_name``; ValueError if the cluster has no such job."""
        return list(self._job(job_name))

    def task_address(self, job_name: str, task_index: int) -> str:
        """The ``"host:port"`` address of task ``task_index`` of ``job_name``.

        Raises:
            ValueError: no such job, or the job has no task ``task_index``; the message lists
                the jobs, or the job's task indices.
        """
        tasks = self._job(job_name)
        try:
            return tasks[operator.index(task_index)]
        except (KeyError, TypeError):
            raise ValueError(f"ClusterSpec: job {job_name!r} has no task {task_index!r}; its "
                             f"task indices are {describe_indices(tasks)}.") from None

    def job_tasks(self, job_name: str) -> list:
        """The addresses of ``job_name``'s tasks by index, ``None`` where a sparse job has a hole.

        As in TF, the list's length is one past the highest index; use `num_tasks` to count.
        """
        tasks = self._job(job_name)
        out = [None] * (max(tasks) + 1 if tasks else 0)
        for index, address in tasks.items():
            out[index] = address
        return out

    def as_dict(self) -> dict:
        """``{job: addresses}``: a list for a job with tasks 0..n-1, a ``{index: address}`` dict
        for a sparse job (as TF; an empty job is ``{}``). ``ClusterSpec(spec.as_dict()) == spec``.
        """
        out = {}
        for job, tasks in self._jobs.items():
            dense = bool(tasks) and list(tasks) == list(range(len(tasks)))
            out[job] = list(tasks.values()) if dense else dict(tasks)
        return out
