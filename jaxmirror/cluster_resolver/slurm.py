"""`SlurmClusterResolver`: the cluster and this process's task from a Slurm job step's variables.

Slurm (``srun``) starts one process per task and tells each, through environment variables,
its rank (``SLURM_PROCID``), the nodes of the step (``SLURM_STEP_NODELIST``, compressed as
``"node[01-03,07],gpu5"``) and how many tasks run on each (``SLURM_STEP_TASKS_PER_NODE``,
compressed as ``"2(x3),1"``). Everything is read once, when the resolver is made.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping

from jaxmirror.cluster_resolver.base import ClusterResolver, format_master_url
from jaxmirror.cluster_resolver.cluster_spec import ClusterSpec

_API = "SlurmClusterResolver"
_HOST_PART_RE = re.compile(r"([^\[\],]*)(?:\[([^\[\]]+)\]([^\[\],]*))?")
_RANGE_RE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_TASKS_PART_RE = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")
# CUDA stops reading CUDA_VISIBLE_DEVICES at the first entry that is not an index or a UUID
# (Slurm writes "NoDevFiles" when a step has no GPUs).
_GPU_ID_RE = re.compile(r"[0-9]+|GPU-.+|MIG-.+")
# The CUDA_VISIBLE_DEVICES values this module set, mapped to the ones they were chosen from: a
# second resolver in the same process must split the node's GPUs, not this task's share again.
_CHOSEN_FROM: dict[str, str] = {}


def expand_hostlist(hostlist: str) -> list[str]:
    """The host names of a Slurm hostlist, in its order, e.g. ``"node[01-03,07],gpu5"``.

    Ranges keep the zero padding of their first number (``[08-10]`` gives ``08, 09, 10``);
    one bracket group per name is supported (not ``"a[1-2]b[3-4]"``).

    Args:
        hostlist: the compressed list, as in ``SLURM_STEP_NODELIST``.

    Returns:
        The names, in order, without removing repeats.

    Raises:
        ValueError: ``hostlist`` is not a hostlist; the message quotes it and says why.

    Example:
        >>> expand_hostlist("node[01-03,07],gpu5")
        ['node01', 'node02', 'node03', 'node07', 'gpu5']
        >>> expand_hostlist("n[8-10]-ib")
        ['n8-ib', 'n9-ib', 'n10-ib']
    """

    def bad(why):
        return ValueError(f"{hostlist!r} is not a Slurm hostlist ({why}); expected names and "
                          f"bracketed ranges such as 'node[01-03,07],gpu5'.")

    if not isinstance(hostlist, str) or not hostlist.strip():
        raise bad("it is empty" if isinstance(hostlist, str) else "not a string")
    parts, depth, start = [], 0, 0
    for i, char in enumerate(hostlist.strip() + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise bad("its brackets do not pair up")
        if char == "," and depth == 0:
            parts.append(hostlist.strip()[start:i])
            start = i + 1
    if depth:
        raise bad("a '[' is not closed")
    hosts = []
    for part in parts:
        match = _HOST_PART_RE.fullmatch(part)
        if not part or match is None:
            raise bad(f"{part!r} is not a name with at most one bracket group" if part
                      else "it has an empty name")
        prefix, ranges, suffix = match.groups()
        if ranges is None:
            hosts.append(prefix)
            continue
        for item in ranges.split(","):
            bounds = _RANGE_RE.fullmatch(item)
            if bounds is None:
                raise bad(f"{item!r} in {part!r} is not a number or a range like 01-03")
            low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
            if int(high) < int(low):
                raise bad(f"the range {item!r} in {part!r} runs backwards")
            width = len(low)
            hosts += [f"{prefix}{n:0{width}d}{suffix}" for n in range(int(low), int(high) + 1)]
    return hosts


def expand_tasks_per_node(tasks_per_node: str) -> list[int]:
    """The number of tasks on each node from Slurm's compressed form, e.g. ``"2(x3),1"``.

    Args:
        tasks_per_node: as in ``SLURM_STEP_TASKS_PER_NODE``: counts, ``"n(xk)"`` for ``k`` nodes
            with ``n`` tasks each.

    Returns:
        One count per node, in the node list's order.

    Raises:
        ValueError: the text is not in that form; the message quotes it.

    Example:
        >>> expand_tasks_per_node("2(x3),1")
        [2, 2, 2, 1]
    """
    counts = []
    for part in str(tasks_per_node).split(","):
        match = _TASKS_PART_RE.fullmatch(part.strip())
        if match is None:
            raise ValueError(f"{tasks_per_node!r} is not a Slurm tasks-per-node list ({part!r} "
                             f"is not 'n' or 'n(xk)'); expected e.g. '2(x3),1'.")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _first_set(environ, *names) -> tuple[str, str] | None:
    for name in names:
        if environ.get(name, "").strip():
            return name, environ[name].strip()
    return None


def _not_under_slurm(what: str) -> RuntimeError:
    return RuntimeError(f"{_API}: not running under Slurm: {what}; start the processes with "
                        f"srun, or describe the cluster with TFConfigClusterResolver or "
                        f"SimpleClusterResolver.")


def _int_var(name: str, value: str) -> int:
    if not value.isascii() or not value.isdigit():
        raise ValueError(f"{_API}: {name}={value!r} is not an integer >= 0.")
    return int(value)


def _count(name: str, value, at_least: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < at_least:
        error = ValueError if isinstance(value, int) and not isinstance(value, bool) else TypeError
        raise error(f"{_API}: `{name}` must be an integer >= {at_least}, got "
                    f"{type(value).__name__} {value!r}.")
    return value


def _visible_gpus(value: str | None) -> list[str] | None:
    if value is None:
        return None
    ids = []
    for entry in value.split(","):
        if not _GPU_ID_RE.fullmatch(entry.strip()):
            break
        ids.append(entry.strip())
    return ids


def _nvidia_smi_gpus() -> int:
    """GPUs ``nvidia-smi`` lists; 0 where it is missing or fails (a CPU node)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def forget_chosen_gpus() -> None:
    """Forget the ``CUDA_VISIBLE_DEVICES`` values this process's resolvers set (for tests and
    diagnostics): a value set since is then read as given, not as a share of a longer list.

    Returns:
        ``None``.

    Example:
        >>> forget_chosen_gpus()
    """
    _CHOSEN_FROM.clear()


class SlurmClusterResolver(ClusterResolver):
    """The cluster and this process's task from Slurm (TF's ``SlurmClusterResolver``).

    Reads, when made, ``SLURM_PROCID`` (this task's rank), ``SLURM_STEP_NUM_TASKS`` (or
    ``SLURM_NTASKS``), the node list ``SLURM_STEP_NODELIST`` (or ``SLURM_JOB_NODELIST``) and
    ``SLURM_STEP_TASKS_PER_NODE`` (or ``SLURM_TASKS_PER_NODE``). Tasks are laid out as Slurm's
    default block distribution places them: the first node's tasks get ranks 0, 1, ..., then the
    next node's; a node's tasks listen on ``port_base``, ``port_base + 1``, .... Ranks go to the
    jobs in the order of their sorted names (as TF), e.g. ``{"ps": 1, "worker": 3}`` makes rank
    0 the ps. Where Slurm says (``SLURM_LOCALID``, ``SLURMD_NODENAME``), this task's place is
    checked against that layout.

    GPUs: each task on a node gets ``gpus_per_task`` of them, in order. With ``auto_set_gpu``
    and ``gpus_per_task > 0`` the constructor sets ``CUDA_VISIBLE_DEVICES`` to this task's GPUs
    (chosen from those already listed there, if any), so make the resolver before JAX first
    uses a GPU. Unlike TF, which sets it in every `cluster_spec` call whatever the task gets,
    it is set once, here, and left alone when the task gets no GPUs.

    Args:
        jobs: ``{job name: number of tasks}``; ``None`` makes every task a ``"worker"``.
        port_base: the port of the first task on each node.
        gpus_per_node: the GPUs of a node; when ``None``, counted from ``CUDA_VISIBLE_DEVICES``,
            else ``SLURM_GPUS_ON_NODE``, else ``nvidia-smi`` (0 without it).
        gpus_per_task: GPUs for each task; when ``None``, a node's GPUs split evenly among the
            most tasks a node runs.
        tasks_per_node: tasks on each node: an int for every node, or ``{host: count}`` (the
            hosts then come from it, in its order); when ``None``, read from Slurm.
        auto_set_gpu: whether to set ``CUDA_VISIBLE_DEVICES`` to this task's GPUs.
        rpc_layer: the protocol `master` puts in front of addresses.

    Raises:
        RuntimeError: a Slurm variable is missing (not running under Slurm), the variables
            disagree, ``jobs`` ask for a number of tasks other than the step has, or the tasks of
            a node want more GPUs than it has.
        ValueError: a Slurm variable is malformed (the message names and quotes it).
        TypeError: an argument has the wrong type.

    Example:
        >>> from unittest import mock
        >>> step = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1",
        ...         "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        ...         "SLURMD_NODENAME": "node02"}
        >>> with mock.patch.dict(os.environ, step):
        ...     resolver = SlurmClusterResolver(gpus_per_node=4, auto_set_gpu=False)
        >>> resolver.cluster_spec()
        ClusterSpec({'worker': ['node01:8888', 'node01:8889', 'node02:8888', 'node02:8889']})
        >>> resolver.task_type, resolver.task_id, resolver.master()
        ('worker', 3, 'grpc://node02:8889')
        >>> resolver.num_accelerators()
        {'GPU': 2}
    """

    def __init__(self, jobs=None, port_base=8888, gpus_per_node=None, gpus_per_task=None,
                 tasks_per_node=None, auto_set_gpu=True, rpc_layer="grpc"):
        environ = dict(os.environ)
        procid = environ.get("SLURM_PROCID", "").strip()
        if not procid:
            raise _not_under_slurm("SLURM_PROCID is not set")
        rank = _int_var("SLURM_PROCID", procid)
        nodes, source = self._nodes(environ, tasks_per_node)
        total = sum(count for _, count in nodes)
        ntasks = _first_set(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        if ntasks is not None:
            if _int_var(*ntasks) != total:
                raise RuntimeError(f"{_API}: {ntasks[0]}={ntasks[1]} but {source} place "
                                   f"{total} tasks; they must agree.")
            source = f"{ntasks[0]}={ntasks[1]}"
        jobs = {"worker": total} if jobs is None else jobs
        if not isinstance(jobs, Mapping) or not all(isinstance(j, str) and j for j in jobs):
            raise TypeError(f"{_API}: `jobs` must be a dict {{job name: number of tasks}}, got "
                            f"{type(jobs).__name__} {jobs!r}.")
        for job, count in jobs.items():
            _count(f"jobs[{job!r}]", count)
        if sum(jobs.values()) != total:
            raise RuntimeError(f"{_API}: `jobs` {dict(jobs)} ask for {sum(jobs.values())} tasks "
                               f"but the Slurm step has {total} ({source}); ask for exactly "
                               f"{total}.")
        if rank >= total:
            raise RuntimeError(f"{_API}: SLURM_PROCID={rank} but the step has only {total} "
                               f"tasks ({source}).")
        _count("port_base", port_base, at_least=1)
        most = max(count for _, count in nodes)
        if port_base + most - 1 > 65535:
            raise ValueError(f"{_API}: `port_base` {port_base} + {most} tasks on a node runs "
                             f"past port 65535; give a lower `port_base`.")

        tasks = [(host, local) for host, count in nodes for local in range(count)]
        host, local = tasks[rank]
        if tasks_per_node is None:
            self._check_place(environ, rank, host, local)
        addresses = [f"{h}:{port_base + i}" for h, i in tasks]
        cluster, start = {}, 0
        for job, count in sorted(jobs.items()):
            cluster[job] = addresses[start:start + count]
            if start <= rank < start + count:
                self._task_type, self._task_id = job, rank - start
            start += count
        self._cluster = ClusterSpec(cluster)
        self._rpc_layer = rpc_layer
        self._gpus_per_task = self._assign_gpus(environ, gpus_per_node, gpus_per_task, most,
                                                local, auto_set_gpu)

    @staticmethod
    def _nodes(environ, tasks_per_node) -> tuple[list[tuple[str, int]], str]:
        """``[(host, tasks on it)]`` in rank order, and where that came from (for messages)."""
        if isinstance(tasks_per_node, Mapping):
            nodes = [(str(h), _count(f"tasks_per_node[{h!r}]", n))
                     for h, n in tasks_per_node.items()]
            if not nodes:
                raise ValueError(f"{_API}: `tasks_per_node` is an empty dict; give "
                                 f"{{host: number of tasks}} for every node.")
            return nodes, f"tasks_per_node={dict(tasks_per_node)}"
        nodelist = _first_set(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                              "SLURM_NODELIST")
        if nodelist is None:
            raise _not_under_slurm("SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are not set")
        try:
            hosts = expand_hostlist(nodelist[1])
        except ValueError as e:
            raise ValueError(f"{_API}: {nodelist[0]}: {e}") from None
        if tasks_per_node is not None:
            count = _count("tasks_per_node", tasks_per_node, at_least=1)
            return [(h, count) for h in hosts], f"tasks_per_node={count} on {len(hosts)} nodes"
        spec = _first_set(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
        if spec is None:
            raise _not_under_slurm("SLURM_STEP_TASKS_PER_NODE is not set (or pass "
                                   "`tasks_per_node`)")
        try:
            counts = expand_tasks_per_node(spec[1])
        except ValueError as e:
            raise ValueError(f"{_API}: {spec[0]}: {e}") from None
        if len(counts) != len(hosts):
            raise RuntimeError(f"{_API}: {spec[0]}={spec[1]!r} counts tasks on {len(counts)} "
                               f"nodes but {nodelist[0]}={nodelist[1]!r} has {len(hosts)}.")
        return list(zip(hosts, counts)), f"{spec[0]}={spec[1]!r}"

    @staticmethod
    def _check_place(environ, rank: int, host: str, local: int) -> None:
        # Another distribution (--distribution=cyclic, ...) puts ranks elsewhere: the addresses
        # and GPUs would be wrong, so say so rather than hang on a wrong port.
        localid = _first_set(environ, "SLURM_LOCALID")
        nodename = _first_set(environ, "SLURMD_NODENAME")
        if (localid is not None and _int_var(*localid) != local) or (
                nodename is not None and nodename[1] != host):
            where = ", ".join(f"{n}={v}" for n, v in filter(None, (localid, nodename)))
            raise RuntimeError(f"{_API}: rank {rank} should be task {local} on {host} under "
                               f"Slurm's block distribution, but Slurm says {where}; run with "
                               f"--distribution=block (Slurm's default) or pass `tasks_per_node`.")

    def _assign_gpus(self, environ, gpus_per_node, gpus_per_task, most, local, auto_set_gpu):
        given = environ.get("CUDA_VISIBLE_DEVICES")
        visible = _visible_gpus(_CHOSEN_FROM.get(given, given))
        if gpus_per_node is None:
            on_node = _first_set(environ, "SLURM_GPUS_ON_NODE")
            gpus_per_node = (len(visible) if visible is not None
                             else _int_var(*on_node) if on_node else _nvidia_smi_gpus())
        _count("gpus_per_node", gpus_per_node)
        if gpus_per_task is None:
            gpus_per_task = gpus_per_node // most if most else 0
        _count("gpus_per_task", gpus_per_task)
        if most * gpus_per_task > gpus_per_node:
            raise RuntimeError(f"{_API}: {most} tasks on a node with gpus_per_task="
                               f"{gpus_per_task} need {most * gpus_per_task} GPUs but a node has "
                               f"{gpus_per_node} (gpus_per_node); ask for fewer.")
        if auto_set_gpu and gpus_per_task:
            ids = visible if visible is not None else [str(i) for i in range(gpus_per_node)]
            mine = ids[local * gpus_per_task:(local + 1) * gpus_per_task]
            if len(mine) < gpus_per_task:
                raise RuntimeError(f"{_API}: CUDA_VISIBLE_DEVICES={given!r} lists {len(ids)} "
                                   f"GPUs, too few for task {local} on its node to get "
                                   f"{gpus_per_task}; pass auto_set_gpu=False to leave it.")
            value = ",".join(mine)
            _CHOSEN_FROM[value] = ",".join(ids) if given is None else _CHOSEN_FROM.get(given, given)
            os.environ["CUDA_VISIBLE_DEVICES"] = value
        return gpus_per_task

    def cluster_spec(self) -> ClusterSpec:
        """The cluster laid out from Slurm's variables when this resolver was made.

        Returns:
            A `ClusterSpec`.
        """
        return self._cluster

    def get_task_info(self) -> tuple[str, int]:
        """``(task_type, task_id)`` of this process (TF's ``get_task_info``).

        Returns:
            This process's job name and index in it.
        """
        return self.task_type, self.task_id

    def master(self, task_type=None, task_id=None, rpc_layer=None) -> str:
        """A task's address with its protocol, e.g. ``"grpc://node01:8888"``.

        Args:
            task_type: the task's job; this process's when ``None``.
            task_id: the task's index; this process's when ``None``.
            rpc_layer: the protocol; this resolver's `rpc_layer` when ``None``.

        Returns:
            ``"rpc_layer://host:port"``; ``""`` when there is no task to take, as in TF.
        """
        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        if task_type is None or task_id is None:
            return ""
        return format_master_url(self._cluster.task_address(task_type, task_id),
                                 rpc_layer or self.rpc_layer)

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None) -> dict:
        """``{"GPU": gpus_per_task}`` (every task gets as many); ``{}`` with no GPUs per task.

        Returns:
            A dict from accelerator kind to count; the arguments are unused.
        """
        del task_type, task_id, config_proto
        return {"GPU": self._gpus_per_task} if self._gpus_per_task else {}
