"""`TFConfigClusterResolver`: the cluster and this process's task from the ``TF_CONFIG`` variable.

``TF_CONFIG`` is the JSON that Kubernetes operators, Vertex AI and launch scripts set for TF::

    {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]},
     "task": {"type": "worker", "index": 0}, "rpc_layer": "grpc"}

It is read every time it is needed, as TF does, and checked every time it is read: every
malformed part is an error naming ``TF_CONFIG``, what it holds and what was expected.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

from jaxmirror.cluster_resolver.base import (ClusterResolver, check_task,
                                             format_master_url)
from jaxmirror.cluster_resolver.cluster_spec import (ClusterSpec, describe_indices,
                                                     normalize_cluster)

_API = "TFConfigClusterResolver"
_EXAMPLE = ('{"cluster": {"worker": ["host0:2222", "host1:2222"]}, '
            '"task": {"type": "worker", "index": 0}}')
_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}
# TF lets an evaluator run outside the cluster it evaluates (multi_worker_util does too).
_OUTSIDE_JOBS = ("evaluator",)


class TFConfig(NamedTuple):
    """What a ``TF_CONFIG`` says; ``None`` (``""`` for ``environment``) for what it leaves out."""

    cluster: ClusterSpec
    task_type: str | None
    task_id: int | None
    rpc_layer: str | None
    environment: str
    session_master: str | None


def _shown(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return repr(text if len(text) <= 300 else text[:300] + "...")


def check_task_in_cluster(cluster: ClusterSpec, task_type, task_id, source: str) -> None:
    """ValueError unless the task is in ``cluster`` (or ``cluster`` is empty, or the task is an
    evaluator, which may run outside it); ``source`` says where the task came from."""
    if not cluster or task_type is None:
        return
    if task_type in _OUTSIDE_JOBS and task_type not in cluster.jobs:
        return
    if task_type not in cluster.jobs:
        raise ValueError(f"{_API}: {source}: task type {task_type!r} is not a job of the cluster "
                         f"in TF_CONFIG; its jobs are {cluster.jobs} (an 'evaluator' may be "
                         f"outside it).")
    indices = cluster.task_indices(task_type)
    if task_id is not None and task_id not in indices:
        count = f"{len(indices)} task" + ("" if len(indices) == 1 else "s")
        raise ValueError(f"{_API}: {source}: task index {task_id} is outside the cluster: job "
                         f"{task_type!r} has {count} (indices {describe_indices(indices)}).")


def _task(task) -> tuple[str | None, int | None]:
    if task is None:
        return None, None
    expected = '{"type": "worker", "index": 0}'
    if not isinstance(task, dict):
        raise ValueError(f"{_API}: TF_CONFIG['task'] must be an object like {expected}, got a "
                         f"JSON {_JSON_KINDS.get(type(task), 'value')}: {_shown(task)}.")
    missing = [key for key in ("type", "index") if key not in task]
    if missing:
        raise ValueError(f"{_API}: TF_CONFIG['task'] has no {' or '.join(map(repr, missing))}: "
                         f"{_shown(task)}; expected an object like {expected}.")
    task_type, index = task["type"], task["index"]
    if not isinstance(task_type, str) or not task_type:
        raise ValueError(f"{_API}: TF_CONFIG['task']['type'] must be a job name such as "
                         f"'worker', got {_shown(task_type)}.")
    # TF reads the index with int(), so "1" is task 1; 1.5, true or -1 are mistakes.
    if isinstance(index, str) and index.isascii() and index.isdigit():
        index = int(index)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"{_API}: TF_CONFIG['task']['index'] must be an integer >= 0, got "
                         f"{_shown(index)}.")
    return task_type, index


def _optional_string(config: dict, key: str):
    value = config.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{_API}: TF_CONFIG[{key!r}] must be a string, got {_shown(value)}.")
    return value


def parse_tf_config(text: str | None) -> TFConfig:
    """Parses and checks the text of a ``TF_CONFIG``.

    Args:
        text: the JSON; ``None``, ``""`` or blanks mean no ``TF_CONFIG`` (no cluster, no task).

    Returns:
        A `TFConfig`.

    Raises:
        ValueError: the JSON is malformed, is not an object, or one of ``"cluster"``,
            ``"task"``, ``"rpc_layer"``, ``"environment"``, ``"session_master"`` is wrong, or the
            task is not in the cluster. The message names ``TF_CONFIG`` and quotes what it holds.

    Example:
        >>> config = parse_tf_config('{"cluster": {"worker": ["a:2222", "b:2222"]},'
        ...                          ' "task": {"type": "worker", "index": 1}}')
        >>> config.cluster, config.task_type, config.task_id
        (ClusterSpec({'worker': ['a:2222', 'b:2222']}), 'worker', 1)
        >>> parse_tf_config('{"cluster": {"worker": ["a:2222"]},'
        ...                 ' "task": {"type": "worker", "index": 3}}')
        Traceback (most recent call last):
        ValueError: TFConfigClusterResolver: TF_CONFIG: task index 3 is outside the cluster: job
        'worker' has 1 task (indices 0).
    """
    if text is None or not text.strip():
        return TFConfig(ClusterSpec(), None, None, None, "", None)
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{_API}: TF_CONFIG is not valid JSON ({e.msg}: line {e.lineno} column "
                         f"{e.colno}): {_shown(text)}; expected an object like "
                         f"{_EXAMPLE}.") from None
    if not isinstance(config, dict):
        raise ValueError(f"{_API}: TF_CONFIG must be a JSON object like {_EXAMPLE}, got a JSON "
                         f"{_JSON_KINDS.get(type(config), 'value')}: {_shown(text)}.")
    cluster = config.get("cluster")
    if cluster is not None and not isinstance(cluster, dict):
        raise ValueError(f"{_API}: TF_CONFIG['cluster'] must be an object mapping job names to "
                         f"lists of 'host:port' strings, like {_EXAMPLE}; got a JSON "
                         f"{_JSON_KINDS.get(type(cluster), 'value')}: {_shown(cluster)}.")
    try:
        cluster = ClusterSpec(normalize_cluster(cluster, f"{_API}: TF_CONFIG['cluster']"))
    except TypeError as e:
        raise ValueError(str(e)) from None  # a wrong type in a string is a wrong value
    task_type, task_id = _task(config.get("task"))
    check_task_in_cluster(cluster, task_type, task_id, "TF_CONFIG")
    rpc_layer = _optional_string(config, "rpc_layer")
    return TFConfig(cluster, task_type, task_id, rpc_layer or None,
                    _optional_string(config, "environment") or "",
                    _optional_string(config, "session_master"))


def read_tf_config() -> TFConfig:
    """Reads and checks the ``TF_CONFIG`` environment variable now (see `parse_tf_config`).

    Returns:
        A `TFConfig`; with no ``TF_CONFIG`` set, an empty cluster and no task.

    Example:
        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, {"TF_CONFIG": '{"cluster": {"ps": ["p:1"]}}'}):
        ...     read_tf_config().cluster
        ClusterSpec({'ps': ['p:1']})
    """
    return parse_tf_config(os.environ.get("TF_CONFIG"))


class TFConfigClusterResolver(ClusterResolver):
    """The cluster and this process's task from ``TF_CONFIG`` (TF's ``TFConfigClusterResolver``).

    ``TF_CONFIG`` holds JSON: ``"cluster"`` maps job names to task addresses, ``"task"`` is
    this process's ``{"type": job, "index": i}``, and the optional ``"rpc_layer"`` (e.g.
    ``"grpc"``) and ``"environment"`` are used unless given here. With no ``TF_CONFIG`` set
    the cluster is empty and `task_type` and `task_id` are ``None``, as in TF.

    When it is checked: the constructor reads and checks ``TF_CONFIG`` (and the task given
    here against its cluster), so a malformed ``TF_CONFIG`` fails before anything starts. Like
    TF, every method and property then reads ``TF_CONFIG`` again (it may be set or changed
    later) and checks it again: a ``TF_CONFIG`` broken later fails at its next use.

    Args:
        task_type: this process's job, instead of ``TF_CONFIG``'s ``task.type``.
        task_id: this process's index in its job, instead of ``TF_CONFIG``'s ``task.index``.
        rpc_layer: the protocol between tasks, instead of ``TF_CONFIG``'s ``rpc_layer``.
        environment: ``"google"`` or ``""``, instead of ``TF_CONFIG``'s ``environment``.

    Raises:
        ValueError: ``TF_CONFIG`` is malformed (the message names it, quotes what it holds and
            shows what was expected), or the task given is not in its cluster.
        TypeError: an argument has the wrong type.

    Example:
        >>> import json, os
        >>> from unittest import mock
        >>> config = {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]},
        ...           "task": {"type": "worker", "index": 1}, "rpc_layer": "grpc"}
        >>> with mock.patch.dict(os.environ, {"TF_CONFIG": json.dumps(config)}):
        ...     resolver = TFConfigClusterResolver()
        ...     print(resolver.task_type, resolver.task_id, resolver.master())
        ...     print(resolver.cluster_spec().num_tasks("worker"), resolver.master("chief", 0))
        worker 1 grpc://host2:2222
        2 grpc://host0:2222
        >>> with mock.patch.dict(os.environ, {"TF_CONFIG": '{"cluster": '}):
        ...     TFConfigClusterResolver()
        Traceback (most recent call last):
        ValueError: TFConfigClusterResolver: TF_CONFIG is not valid JSON (Expecting value: line 1
        column 13): '{"cluster": '; expected an object like {...}.
    """

    def __init__(self, task_type=None, task_id=None, rpc_layer=None, environment=None):
        check_task(_API, task_type, task_id)
        for name, value in (("rpc_layer", rpc_layer), ("environment", environment)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{_API}: `{name}` must be a string, got "
                                f"{type(value).__name__} {value!r}.")
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer
        self._environment = environment
        self._config()

    def _config(self) -> TFConfig:
        config = read_tf_config()
        if self._task_type is not None or self._task_id is not None:
            task_type = config.task_type if self._task_type is None else self._task_type
            task_id = config.task_id if self._task_id is None else self._task_id
            check_task_in_cluster(config.cluster, task_type, task_id,
                                  "the task given to it")
        return config

    @property
    def task_type(self):
        """This process's job: the one given, else ``TF_CONFIG``'s; ``None`` without either."""
        return self._config().task_type if self._task_type is None else self._task_type

    @task_type.setter
    def task_type(self, task_type):
        check_task(_API, task_type, None)
        self._task_type = task_type

    @property
    def task_id(self):
        """This process's index in its job: the one given, else ``TF_CONFIG``'s; or ``None``."""
        return self._config().task_id if self._task_id is None else self._task_id

    @task_id.setter
    def task_id(self, task_id):
        check_task(_API, None, task_id)
        self._task_id = task_id

    @property
    def rpc_layer(self):
        """The protocol between tasks: the one given, else ``TF_CONFIG``'s; or ``None``."""
        return self._config().rpc_layer if self._rpc_layer is None else self._rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer):
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> str:
        """The environment given, else ``TF_CONFIG``'s ``environment``, else ``""``."""
        return self._config().environment if self._environment is None else self._environment

    def cluster_spec(self) -> ClusterSpec:
        """The cluster in ``TF_CONFIG`` now; an empty `ClusterSpec` without one.

        Returns:
            A `ClusterSpec`.
        """
        return self._config().cluster

    def master(self, task_type=None, task_id=None, rpc_layer=None) -> str:
        """A task's address with its protocol, e.g. ``"grpc://host1:2222"``.

        As in TF: ``TF_CONFIG``'s ``session_master`` when it has one, and ``""`` when the
        cluster is empty or is a single task.

        Args:
            task_type: the task's job; this process's when ``None``.
            task_id: the task's index; this process's when ``None``.
            rpc_layer: the protocol; this resolver's `rpc_layer` when ``None``.

        Returns:
            The address, ``"rpc_layer://host:port"`` (``"host:port"`` without an RPC layer).

        Raises:
            ValueError: there is no task to take (none given, none in ``TF_CONFIG``), or the
                cluster has no such task.
        """
        config = self._config()
        if config.session_master is not None:
            return config.session_master
        spec = config.cluster
        if not spec or (len(spec.jobs) == 1 and spec.num_tasks(spec.jobs[0]) == 1):
            return ""
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        if task_type is None or task_id is None:
            raise ValueError(f"{_API}.master: no task to give the address of: TF_CONFIG has no "
                             f"'task' and none was given; pass `task_type` and `task_id`.")
        return format_master_url(spec.task_address(task_type, task_id),
                                 rpc_layer or self.rpc_layer)
