"""What runs inside a worker process: local copies of variables, per-worker resources, closures.

A worker keeps one local ``jaxmirror.Variable`` per parameter-server variable its closures use,
made in the worker's own strategy (every device of the worker, one replica each), so
``strategy.run`` inside a closure is the ordinary compiled step. A closure:

1. loads the values of the variables it refers to: pulled, one request per parameter server,
   or the values the worker's previous call brought back with its updates, or (after the first
   closure of a call) the values the closure before it left;
2. runs the function;
3. notes what it changed, tagged with the closure's id: ``assign_add``/``assign_sub`` as the
   difference from the value it started from (the server adds it to its current value, so
   concurrent increments add up), ``assign`` as the new value.

At the end of a call (one or more closures) the notes go out, one message per parameter server.

The objects a scheduled function refers to resolve here, when the worker unpickles it:
``local_variable``, ``nnx_object``, ``worker_strategy``, ``resource``. ``closures`` runs the
closures on this state.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxmirror.coordinator.nnx_state import WorkerObjects
from jaxmirror.variables.variable import Variable

_worker = None  # this process's ``_WorkerState``, installed by the worker actor


class _Local:
    """The worker's copy of a parameter-server variable: a ``jaxmirror.Variable`` and its
    overwrite flag, or (``var`` None: part of an NNX object's state) host values only, which the
    object reads at a closure's start (``pulled``) and sets at its end (``final``)."""

    __slots__ = ("var", "flag", "spec", "pulled", "final")

    def __init__(self, var, flag, spec):
        self.var, self.flag, self.spec = var, flag, spec
        self.pulled = self.final = None


class _WorkerState:
    def __init__(self, index, num_workers, ps_handles, strategy_factory):
        self.index = index
        self.num_workers = num_workers
        self.ps = list(ps_handles)
        self.strategy_factory = strategy_factory
        self.strategy = None
        self.locals: dict = {}
        self.resources: dict = {}
        self.functions: dict = {}
        self.prefetched: dict = {}
        self.prefetched_writes = 0  # the coordinator's write count the prefetched values follow
        self.pushes = 0
        self.exit_after_push = None
        self.current: set = set()  # variables whose local values are current in this call
        self.objects: dict = {}  # bundle id -> WorkerObjects (NNX objects on the servers)
        self.watermark = None  # the coordinator's oldest unfinished closure, for the servers
        self.fast = True  # compiled loads (``closures``)
        self.load_counts = {"compiled": 0, "assigned": 0}  # loads, by how (testing)
        self.loads: dict = {}  # variable ids loaded together -> how often
        self.loaders: dict = {}  # variable ids -> a function assigning them all, or False


def install(index: int, num_workers: int, ps_handles, strategy_factory) -> None:
    """Make this process worker ``index`` (called once, by the worker actor).

    Args:
        index: the worker's task index.
        num_workers: how many workers the cluster has.
        ps_handles: the parameter-server actors, by index.
        strategy_factory: a function returning the worker's own strategy.

    Returns:
        ``None``.
    """
    global _worker
    _worker = _WorkerState(index, num_workers, ps_handles, strategy_factory)


def uninstall() -> None:
    """Make this process no worker again: ``install`` undone (for tests and diagnostics).

    Returns:
        ``None``.

    Example:
        >>> install(0, 1, [], lambda: None)
        >>> worker_index()
        0
        >>> uninstall()
    """
    global _worker
    _worker = None


def current() -> _WorkerState:
    """This worker's state (``closures`` runs closures on it).

    Returns:
        The state ``install`` made.

    Raises:
        RuntimeError: outside a worker process.
    """
    return _state()


def _state() -> _WorkerState:
    if _worker is None:
        raise RuntimeError("jaxmirror: this object refers to a parameter-server worker's own "
                           "copy and only resolves inside a worker process; schedule the "
                           "function with ClusterCoordinator.schedule.")
    return _worker


def worker_index() -> int:
    """This worker's task index.

    Returns:
        An int.

    Raises:
        RuntimeError: outside a worker process.
    """
    return _state().index


def worker_strategy():
    """The worker's own strategy: what ``ParameterServerStrategy`` is inside a closure.

    Returns:
        A strategy over this worker's devices, made on first use.
    """
    state = _state()
    if state.strategy is None:
        state.strategy = state.strategy_factory()
    return state.strategy


def local_variable(spec):
    """The worker's local copy of the parameter-server variable ``spec`` (made on first use).

    Args:
        spec: a ``shipping.VariableSpec``.

    Returns:
        A ``jaxmirror.Variable`` of the worker's strategy.
    """
    state = _state()
    local = state.locals.get(spec.var_id)
    if local is None:
        with worker_strategy().scope():
            var = Variable(np.zeros(spec.shape, jnp.dtype(spec.dtype)), trainable=spec.trainable,
                           aggregation=spec.aggregation, synchronization=spec.synchronization,
                           name=spec.name)
            flag = Variable(np.int32(0), aggregation="only_first_replica",
                            name=f"{spec.name}/overwritten")
        var.watch_overwrites(flag)
        local = state.locals[spec.var_id] = _Local(var, flag, spec)
    return local.var


def nnx_object(bundle_id, graphdef, treedef, leaves, var_ids, index):
    """The worker's copy of object ``index`` of the NNX objects ``bundle_id`` (made once).

    Args:
        bundle_id: the objects' id, unique in the coordinator.
        graphdef: their graph definition.
        treedef: their state's structure.
        leaves: ``nnx_state.WorkerObjects``' leaves (the variables already the worker's).
        var_ids: the parameter-server variables behind them.
        index: which of the objects.

    Returns:
        The NNX object.
    """
    state = _state()
    bundle = state.objects.get(bundle_id)
    if bundle is None:
        # Each worker its own random stream: the keys folded with its index (the counts are
        # shared, on the parameter servers).
        leaves = [(kind, jax.random.fold_in(x, state.index)) if kind == "key" else (kind, x)
                  for kind, x in leaves]
        for kind, specs in leaves:
            for spec in specs if kind == "variable" else ():
                state.locals.setdefault(spec.var_id, _Local(None, None, spec))
        bundle = state.objects[bundle_id] = WorkerObjects(graphdef, treedef, leaves, var_ids,
                                                          state.locals)
    return bundle.objects[index]


def resource(resource_id, make):
    """A per-worker resource (dataset, iterator), made here on first use by ``make()``.

    Args:
        resource_id: its id, unique in the coordinator.
        make: a function making it in this worker.

    Returns:
        The resource.
    """
    state = _state()
    if resource_id not in state.resources:
        state.resources[resource_id] = make()
    return state.resources[resource_id]


def cached_function(fn_id, blob):
    """The function ``fn_id``, unpickled from ``blob`` the first time and kept.

    Args:
        fn_id: the function's id in the coordinator.
        blob: its pickle, or ``None`` when the coordinator knows this worker has it.

    Returns:
        The function.
    """
    import pickle
    state = _state()
    fn = state.functions.get(fn_id)
    if fn is None:
        if blob is None:
            raise KeyError(fn_id)
        fn = state.functions[fn_id] = pickle.loads(blob)
    return fn


def exit_after_pushes(count: int) -> None:
    """Testing: end this worker process right after its ``count``-th push from now.

    Args:
        count: how many more closures may push before the process exits.

    Returns:
        ``None``.
    """
    state = _state()
    state.exit_after_push = state.pushes + count
    sys.stdout.flush()
