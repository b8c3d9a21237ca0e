"""``PSVariable``: the coordinator's handle on a variable stored on a parameter server.

Reads and assignments made on the coordinator go to the parameter server at once. Pickled for
a worker (a scheduled function referring to it), the handle becomes that worker's local copy,
whose value the worker pulls before each closure and whose changes it pushes after.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxmirror.coordinator import shipping, worker_runtime
from jaxmirror.cluster_resolver import ray_support
from jaxmirror.coordinator.errors import UnavailableError
from jaxmirror.coordinator.shipping import unpack
from jaxmirror.core import rich_display
from jaxmirror.core.reduce_op import as_aggregation, as_synchronization
from jaxmirror.variables.handle import VariableHandle
from jaxmirror.variables.variable import Variable


_COORDINATOR_WRITES = [0]  # how many writes this process made to parameter servers directly


def coordinator_writes() -> int:
    """How many assignments this process (the coordinator) has made to parameter servers.

    Closures carry this count: a worker drops values it pulled back after its previous
    closure when the coordinator has written since, so a closure sees the coordinator's writes.

    Returns:
        An int.

    Example:
        >>> coordinator_writes() >= 0
        True
    """
    return _COORDINATOR_WRITES[0]


def ps_device(index: int) -> str:
    """The TF device name of parameter server ``index``.

    Args:
        index: the task index.

    Returns:
        A string.

    Example:
        >>> ps_device(1)
        '/job:ps/replica:0/task:1/device:CPU:0'
    """
    return f"/job:ps/replica:0/task:{index}/device:CPU:0"


def call_ps(ps_index: int, ref, what: str):
    """``ray.get(ref)`` of a call on parameter server ``ps_index``, with a clear error if it died.

    Args:
        ps_index: the parameter server's index.
        ref: the call's object ref.
        what: what was being done, for the error.

    Returns:
        The call's result.

    Raises:
        UnavailableError: the parameter server is gone.
    """
    ray = ray_support.ray_module()
    try:
        return ray.get(ref)
    except ray_support.actor_died_errors() as e:
        raise UnavailableError(ps_unavailable(ps_index, what, e)) from None


def ps_unavailable(ps_index: int, what: str, cause) -> str:
    """The message for a parameter server that is gone.

    Args:
        ps_index: its index.
        what: what was being done.
        cause: Ray's error (or its text).

    Returns:
        A string.
    """
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    return (f"ParameterServerStrategy: parameter server {ps_device(ps_index)} is unavailable "
            f"while {what} ({first}); its variables are lost: restart the cluster and restore "
            f"the variables from a checkpoint (jaxmirror.checkpoint.restore).")


class PSVariable(VariableHandle):
    """A variable stored on a parameter server (what ``ParameterServerStrategy`` makes).

    Made by ``jaxmirror.Variable(...)`` inside the strategy's scope. On the coordinator
    ``read_value()``, ``numpy()`` and the operators fetch the value, and ``assign``,
    ``assign_add``, ``assign_sub`` apply at once. Inside a scheduled function (on a worker) it is
    the worker's copy: read at the closure's start, its changes sent at the closure's end.

    Args:
        strategy: the owning strategy.
        spec: the variable's ``shipping.VariableSpec``.
        ps: the parameter-server actor holding it.

    Example:
        (needs a Ray cluster; see ``ParameterServerStrategy``)
        >>> PSVariable.__name__
        'PSVariable'
    """

    def __init__(self, strategy, spec: shipping.VariableSpec, ps):
        self._strategy = strategy
        self._spec = spec
        self._ps = ps
        self._name = spec.name
        self._shape = tuple(spec.shape)
        self._dtype = jnp.dtype(spec.dtype)
        self._trainable = spec.trainable
        self._aggregation = as_aggregation(spec.aggregation)
        self._synchronization = as_synchronization(spec.synchronization)

    @property
    def spec(self) -> shipping.VariableSpec:
        """What a worker needs to make its copy."""
        return self._spec

    @property
    def distribute_strategy(self):
        """The ``ParameterServerStrategy`` that made it."""
        return self._strategy

    @property
    def device(self) -> str:
        """The parameter server's device name."""
        return ps_device(self._spec.ps_index)

    def read_value(self):
        """The value, fetched from the parameter server now.

        Returns:
            A ``jax.Array``.

        Raises:
            UnavailableError: the parameter server is gone.
        """
        value, = unpack(call_ps(self._spec.ps_index, self._ps.pull.remote([self._spec.var_id]),
                                f"reading {self._name!r}"))
        return jnp.asarray(value)

    def _apply(self, method: str, value) -> None:
        value = np.asarray(value, dtype=np.dtype(self._dtype))
        call_ps(self._spec.ps_index,
                self._ps.update.remote([(self._spec.var_id, method, value)]),
                f"{method} of {self._name!r}")
        _COORDINATOR_WRITES[0] += 1

    def __reduce__(self):
        if shipping.shipping():
            shipping.check_owner(self._strategy, f"variable {self._name!r}")
            shipping.note_variable(self._spec)
            return (worker_runtime.local_variable, (self._spec,))
        raise TypeError(f"PSVariable {self._name!r} cannot be pickled or copied: its value "
                        f"lives on a parameter server. Save it with jaxmirror.checkpoint, or "
                        f"read its value (numpy()).")

    def _repr_html_(self) -> str | None:
        # Jupyter's rich display; reading the value is one request to its parameter server.
        return rich_display.safe_html(lambda: rich_display.table(
            f"PSVariable '{self._name}' shape={self._shape} dtype={np.dtype(self._dtype).name}",
            ["stored on", "shape", "values"],
            [[self.device, str(self._shape), rich_display.preview(self.read_value())]]))

    def __repr__(self) -> str:
        return (f"<PSVariable {self._name!r} shape={self._shape} "
                f"dtype={np.dtype(self._dtype).name} on {self.device}>")


def read_many(handles) -> list:
    """The values of parameter-server variables (``PSVariable`` or ``ShardedVariable`` of them),
    read with one request per parameter server.

    Args:
        handles: the variables.

    Returns:
        A list of NumPy arrays, in order.

    Raises:
        UnavailableError: a parameter server is gone.
    """
    parts = [list(getattr(h, "variables", [h])) for h in handles]
    by_ps: dict = {}
    for part in parts:
        for v in part:
            by_ps.setdefault(v.spec.ps_index, (v._ps, []))[1].append(v.spec.var_id)
    refs = {ps: actor.pull.remote(ids) for ps, (actor, ids) in by_ps.items()}
    values = {}
    for ps, ref in refs.items():
        ids = by_ps[ps][1]
        values.update(zip(ids, unpack(call_ps(ps, ref, "reading variables"))))
    return [np.concatenate([values[v.spec.var_id] for v in part]) if len(part) > 1
            else values[part[0].spec.var_id] for part in parts]


def refuse_local_variable(obj) -> None:
    """A ``shipping`` guard: a ``jaxmirror.Variable`` not on the parameter servers.

    Raises:
        ValueError: saying to create it in the strategy's scope.
    """
    if isinstance(obj, Variable):
        raise ValueError(
            f"ClusterCoordinator.schedule: the function or its arguments refer to variable "
            f"{obj.name!r}, which is not on the parameter servers (it was created outside "
            f"the ParameterServerStrategy's scope, or by another strategy): each worker would "
            f"change a copy of its own and the changes would be lost. Create it inside "
            f"`with strategy.scope():` (metrics too), or pass its value (v.numpy()) as an "
            f"argument.")


shipping.add_guard(refuse_local_variable)

