"""The coordinator's side of NNX objects on parameter servers (``ParameterServerStrategy.init``).

The coordinator keeps the objects ``init`` returned (for evaluating, saving, inspecting them)
and a parameter-server variable per numeric state leaf. Pickled for a worker, an object becomes
a reference to the worker's copy (``worker_runtime.nnx_object``). The coordinator's objects get
the servers' values at every ``ClusterCoordinator.join()``; changes made to them on the
coordinator are sent to the servers at the next ``schedule`` or ``join``, as an assignment
made there would be.

An NNX object not made by ``init`` would be a private copy in each worker, its changes never
seen anywhere else: scheduling a function that refers to one is an error.
"""

from __future__ import annotations

import itertools
import warnings
import weakref

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmirror.coordinator import nnx_state, shipping, worker_runtime
from jaxmirror.coordinator.ps_variables import read_many
from jaxmirror.step.graphs import is_graph_node
from jaxmirror.variables.variable import Variable

_ids = itertools.count()
_BOUND: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # object -> ref to Bundle
_ALL: "weakref.WeakSet" = weakref.WeakSet()  # every live Bundle


class Bundle:
    """NNX objects built together and the parameter-server variables holding their state.

    Args:
        objects: the coordinator's objects.
        strategy: the ``ParameterServerStrategy``; variables are made in its scope.

    Example:
        (made by ``ParameterServerStrategy.init``)
        >>> Bundle.__name__
        'Bundle'
    """

    def __init__(self, objects: tuple, strategy):
        self.bundle_id = next(_ids)
        self.strategy = weakref.ref(strategy)
        # Held weakly: a bundle goes when its objects go (``bind``), with its server values.
        self._objects = tuple(weakref.ref(o) for o in objects)
        self.graphdef, self.treedef, leaves = nnx_state.split_objects(objects)
        self.leaves = []
        with strategy.scope():
            for path, kind, value in leaves:
                if nnx_state.is_numeric(value):
                    var = Variable(nnx_state.as_host(value), trainable=kind == "Param",
                                   name=f"{type(objects[0]).__name__}{path}")
                    self.leaves.append(("variable", var))
                else:
                    self.leaves.append(("key", value))
        # What a worker is sent: each numeric leaf as the specs of its shards, in order.
        self.shipped = [("variable", [part.spec for part in getattr(x, "variables", [x])])
                        if kind == "variable" else (kind, x) for kind, x in self.leaves]
        self.var_ids = [spec.var_id for kind, specs in self.shipped if kind == "variable"
                        for spec in specs]
        # The objects' own nnx.Variables, in leaf order: a change made here is seen by the
        # identity of their raw values, cheaply, before every schedule.
        self.nnx_vars = nnx_state.variables_of(objects)
        # What the servers were last given, per leaf: the raw value (that first check) and the
        # value on the host (nnx.jit gives every leaf a new object, changed or not).
        self.synced = self._current()
        # An nnx.Variable of these objects shipped alone is refused.
        self.nnx_variables = {id(v): v for v in self.nnx_vars}
        # Parts of the objects (submodules), refused alone with a message of their own.
        self.parts = weakref.WeakValueDictionary()
        for obj in objects:
            for _, node in nnx.iter_graph(obj):
                if is_graph_node(node) and node not in objects:
                    try:
                        self.parts[id(node)] = node
                    except TypeError:  # not weakly referable: not worth refusing
                        pass
        _ALL.add(self)

    def _current(self) -> list:
        return [(v.get_raw_value(), nnx_state.as_host(v.get_value()) if kind == "variable"
                 else None) for (kind, _), v in zip(self.leaves, self.nnx_vars)]

    @property
    def objects(self) -> tuple:
        """The coordinator's objects."""
        return tuple(r() for r in self._objects)

    def variables(self) -> list:
        """The parameter-server variables, in leaf order."""
        return [x for kind, x in self.leaves if kind == "variable"]

    def reduction(self, index: int) -> tuple:
        """How object ``index`` pickles for a worker; notes the variables it needs."""
        shipping.check_owner(self.strategy(), f"the NNX object {type(self.objects[index]).__name__}")
        for kind, specs in self.shipped:
            for spec in specs if kind == "variable" else ():
                shipping.note_variable(spec)
        return (worker_runtime.nnx_object, (self.bundle_id, self.graphdef, self.treedef,
                                            self.shipped, self.var_ids, index))

    def refresh(self) -> None:
        """Give the coordinator's objects the servers' values (at ``join``)."""
        objects = self.objects  # held for the update: the garbage collector may run meanwhile
        if None in objects:  # going: ``bind``'s finalizer drops the bundle
            return
        self.send_changes()  # a change made on the coordinator meanwhile is a write: it wins
        values = iter(read_many(self.variables()))
        new = [jnp.asarray(next(values)) if kind == "variable" else x for kind, x in self.leaves]
        nnx.update(objects, nnx_state.state_of(self.treedef, new))
        self.synced = self._current()

    def send_changes(self) -> None:
        """Send the values changed on the coordinator since the last sync to the servers."""
        for i, ((kind, var), v, (old, old_host)) in enumerate(
                zip(self.leaves, self.nnx_vars, self.synced)):
            raw = v.get_raw_value()
            if kind != "variable" or raw is old:
                continue
            host = nnx_state.as_host(v.get_value())
            if not np.array_equal(host, old_host, equal_nan=host.dtype.kind in "fc"):
                var.assign(host, read_value=False)
            self.synced[i] = (raw, host)


def bind(strategy, built):
    """Put the numeric state of the NNX objects in ``built`` on the parameter servers.

    Args:
        strategy: the ``ParameterServerStrategy``.
        built: what ``init``'s function returned (its NNX objects are bound in place).

    Returns:
        The ``Bundle``, or ``None`` when ``built`` holds no NNX object.
    """
    objects = tuple(nnx_state.find_objects(built))
    if not objects:
        return None
    bundle = Bundle(objects, strategy)
    # Held by its strategy only: entries keyed weakly by the objects must not keep them alive.
    ref = weakref.ref(bundle)
    bundles = _bundles(strategy)
    for index, obj in enumerate(objects):
        _BOUND[obj] = ref
        shipping.bind_reduction(obj, lambda index=index: ref().reduction(index))
        weakref.finalize(obj, _drop, bundles, ref)
    bundles.append(bundle)
    strategy.extended.nnx_inits += 1
    return bundle


def _bundles(strategy) -> list:
    # On the strategy itself: a module-level map keyed by strategy would keep it alive through
    # its bundles' variables.
    return strategy.extended.nnx_bundles


def _drop(bundles: list, ref) -> None:
    bundle = ref()
    if bundle is not None and bundle in bundles:
        bundles.remove(bundle)


def warn_if_superseded(strategy, var_ids, fn) -> None:
    """Warn when ``fn`` uses NNX objects of a ``strategy.init`` that a later call with the same
    structure replaced (a notebook's init cell re-run without the cell defining ``fn``).

    Args:
        strategy: the ``ParameterServerStrategy``.
        var_ids: the parameter-server variables ``fn`` refers to.
        fn: the scheduled function.

    Returns:
        ``None``.
    """
    bundles = list(_bundles(strategy))  # a copy: a finalizer may drop one meanwhile
    used = set(var_ids)
    for i, bundle in enumerate(bundles):
        if used.intersection(bundle.var_ids) and any(
                later.graphdef == bundle.graphdef for later in bundles[i + 1:]):
            warnings.warn(
                f"ClusterCoordinator.schedule: {getattr(fn, '__qualname__', fn)!r} uses NNX "
                f"objects from an earlier strategy.init call, which a later call of the same "
                f"structure replaced; it keeps training the earlier ones (a function keeps what "
                f"it referred to when first scheduled, as a tf.function's trace). Re-run the "
                f"cell that defines it.", stacklevel=3)
            return


def init_count(strategy) -> int:
    """How many ``strategy.init`` calls made NNX objects on ``strategy``: a version that only
    grows (the number of live bundles would not: one dropped and one added leave it as it was)."""
    return strategy.extended.nnx_inits


def before_schedule(strategy) -> None:
    """Send what changed on the coordinator since the last sync (a cheap check when nothing
    did: the leaves are the same objects).

    Args:
        strategy: the ``ParameterServerStrategy``.

    Returns:
        ``None``.
    """
    for bundle in list(_bundles(strategy)):
        bundle.send_changes()


def after_join(strategy) -> None:
    """Give the coordinator's objects the parameter servers' values.

    Args:
        strategy: the ``ParameterServerStrategy``.

    Returns:
        ``None``.
    """
    for bundle in list(_bundles(strategy)):
        bundle.refresh()


def refuse_unbound(obj) -> None:
    """A ``shipping`` guard: an NNX object not made by ``ParameterServerStrategy.init``.

    Raises:
        ValueError: saying how to make it.
    """
    if isinstance(obj, nnx.Variable) and any(b.nnx_variables.get(id(obj)) is obj
                                             for b in list(_ALL)):
        raise ValueError(
            f"ClusterCoordinator.schedule: the function or its arguments refer to a "
            f"{type(obj).__name__} of an NNX object on the parameter servers on its own: a "
            f"worker would get a copy of its value now, never updated. Refer to it through its "
            f"object inside the function (model.kernel[...]), or pass its value as an argument.")
    if is_graph_node(obj) and any(b.parts.get(id(obj)) is obj for b in list(_ALL)):
        raise ValueError(
            f"ClusterCoordinator.schedule: the function or its arguments refer to a part "
            f"({type(obj).__name__}) of an NNX object on the parameter servers on its own: "
            f"refer to it through the object strategy.init returned, inside the function "
            f"(model.layer(x), not layer = model.layer outside it).")
    if is_graph_node(obj) and (obj not in _BOUND or _BOUND[obj]() is None):
        raise ValueError(
            f"ClusterCoordinator.schedule: the function or its arguments refer to an NNX "
            f"object ({type(obj).__name__}) that is not on the parameter servers: each worker "
            f"would change a copy of its own, and the changes would be lost. Build it with "
            f"strategy.init(lambda: ...) (for example strategy.init(lambda: (m := Model("
            f"rngs=nnx.Rngs(0)), nnx.Optimizer(m, optax.adam(1e-3), wrt=nnx.Param)))), which "
            f"keeps its state on the parameter servers; the objects it returns are updated by "
            f"every join().")


shipping.add_guard(refuse_unbound)
