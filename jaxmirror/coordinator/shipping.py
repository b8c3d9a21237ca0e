"""Pickling what a worker runs: functions, their arguments, and the variables they reach.

A scheduled function refers to parameter-server variables, the strategy and per-worker
iterators. Pickled for a worker, each of these becomes a small reference that the worker resolves
to its own object (``worker_runtime``). While pickling, every parameter-server variable met is
noted, so the worker knows which values to pull before the closure runs without looking at the
function.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import pickle
import site
import sys
import sysconfig
import threading
import types
import weakref
from typing import NamedTuple

import cloudpickle

_local = threading.local()


class VariableSpec(NamedTuple):
    """What a worker needs to make its local copy of a parameter-server variable.

    Attributes:
        var_id: the variable's id, unique in its strategy.
        ps_index: the parameter server holding it.
        shape: its shape.
        dtype: its dtype's name.
        name: its name.
        trainable: whether it is trainable.
        aggregation: its ``VariableAggregation`` value (a string).
        synchronization: its ``VariableSynchronization`` value (a string).
    """

    var_id: int
    ps_index: int
    shape: tuple
    dtype: str
    name: str
    trainable: bool
    aggregation: str
    synchronization: str


class Shipment(NamedTuple):
    """A pickled object and the parameter-server variables it refers to.

    Attributes:
        blob: the pickle (cloudpickle) bytes.
        variables: the ``VariableSpec`` of every parameter-server variable inside, by id.
    """

    blob: bytes
    variables: dict


def shipping() -> bool:
    """Whether this thread is pickling something for a worker now.

    Returns:
        A bool: objects that pickle differently for a worker ask this in ``__reduce__``.

    Example:
        >>> shipping()
        False
    """
    return getattr(_local, "found", None) is not None


def owner():
    """The strategy the pickle being made is for (``None`` when not said).

    Returns:
        The ``ParameterServerStrategy`` given to ``ship``, or ``None``.
    """
    return getattr(_local, "owner", None)


def check_owner(strategy, what: str) -> None:
    """Raise when the pickle being made is for another strategy than ``strategy``.

    Args:
        strategy: the strategy that made the object being pickled.
        what: the object, for the message.

    Raises:
        ValueError: naming ``what`` and saying to re-run the cells that made it.
    """
    current = owner()
    if current is not None and strategy is not current:
        raise ValueError(
            f"ClusterCoordinator.schedule: {what} belongs to another ParameterServerStrategy "
            f"than this coordinator's (a re-run notebook cell made a new strategy?): its "
            f"values live on that strategy's parameter servers. Create it again in this "
            f"strategy's scope (or strategy.init), and re-run the cells defining the scheduled "
            f"functions.")


def note_variable(spec: VariableSpec) -> None:
    """Record that the pickle being made refers to the variable ``spec`` (from ``__reduce__``).

    Args:
        spec: the variable's ``VariableSpec``.

    Returns:
        ``None``.
    """
    _local.found[spec.var_id] = spec


# Objects that pickle differently for a worker but cannot say so in a ``__reduce__`` of their
# own (flax NNX objects bound to parameter servers): object -> function giving the reduction.
_REDUCTIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_REDUCED_TYPES: set = set()
_GUARDS: list = []


def bind_reduction(obj, reduction) -> None:
    """Pickle ``obj`` for workers as ``reduction()`` says (a ``__reduce__``-style tuple).

    Args:
        obj: a weakly referable object.
        reduction: a function of no arguments returning ``(callable, args)``; it may call
            ``note_variable``.

    Returns:
        ``None``.
    """
    _REDUCTIONS[obj] = reduction
    _REDUCED_TYPES.add(type(obj))


def add_guard(guard) -> None:
    """Call ``guard(obj)`` for every object pickled for a worker whose type has no reduction
    bound: it raises to refuse one (an NNX object whose changes a worker would keep to itself).

    Args:
        guard: a function of one object, returning nothing.

    Returns:
        ``None``.
    """
    if guard not in _GUARDS:
        _GUARDS.append(guard)


class _Pickler(cloudpickle.CloudPickler):
    def reducer_override(self, obj):
        if isinstance(obj, types.ModuleType) and obj.__name__ in sys.modules and getattr(
                obj, "__file__", None):
            # A module a function refers to is imported on the worker, never sent whole (even
            # one whose functions go by value here).
            return importlib.import_module, (obj.__name__,)
        if type(obj) in _REDUCED_TYPES:
            reduction = _REDUCTIONS.get(obj)
            if reduction is not None:
                return reduction()
        for guard in _GUARDS:
            guard(obj)
        return super().reducer_override(obj)


def _dumps(obj) -> bytes:
    out = io.BytesIO()
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return out.getvalue()


_CHECKED: dict = {}  # module name -> whether it travels by value


def _library_dirs() -> tuple:
    dirs = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    dirs.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    dirs.add(site.getusersitepackages())
    dirs.update({sys.base_prefix, sys.prefix, sys.exec_prefix})
    return tuple(os.path.realpath(d) for d in dirs if d)


def _local_module(obj):
    """The module of ``obj`` (a function or class) when it is the user's own code (a script, a
    notebook, a test file, a module next to them), which a worker may not be able to import;
    ``None`` for library code (installed packages, the standard library, jaxmirror)."""
    if not isinstance(obj, (types.FunctionType, type)):
        return None
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    name = getattr(module, "__name__", None)
    if module is None or name == "__main__":  # __main__ goes by value anyway
        return None
    if name not in _CHECKED:
        path = getattr(module, "__file__", None)
        _CHECKED[name] = (
            path is not None and path.endswith(".py") and name.split(".")[0] != "jaxmirror"
            and not any(part in path for part in ("site-packages", "dist-packages"))
            and not os.path.realpath(path).startswith(_library_dirs()))
    return module if _CHECKED[name] else None


@contextlib.contextmanager
def _collecting():
    outer = getattr(_local, "found", None)
    _local.found = {}
    try:
        yield _local.found
    finally:
        _local.found = outer


def ship(obj, for_strategy=None) -> Shipment:
    """Pickle ``obj`` for a worker.

    Args:
        obj: a function, or a tuple of arguments.
        for_strategy: the ``ParameterServerStrategy`` it is scheduled on (objects of another
            one are refused), or ``None``.

    Returns:
        A ``Shipment``.

    Raises:
        Whatever pickling ``obj`` raises (a ``RemoteValue`` inside raises ``ValueError``).

    Example:
        >>> s = ship((1, 2))
        >>> s.variables
        {}
    """
    # The function (and functions passed as arguments) by value when they are the user's own
    # code; registered for this pickle only (cloudpickle's registry is global).
    local = {m for m in map(_local_module, obj if isinstance(obj, tuple) else (obj,)) if m}
    local -= {sys.modules[n] for n in cloudpickle.list_registry_pickle_by_value()
              if n in sys.modules}
    for module in local:
        cloudpickle.register_pickle_by_value(module)
    with _collecting() as found:
        _local.owner = for_strategy
        try:
            blob = _dumps(obj)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise type(e)(f"ClusterCoordinator.schedule: cannot send the function or its "
                          f"arguments to the workers: {e}. A function goes by value, with "
                          f"what it refers to (as a tf.function's trace captures it); make "
                          f"that picklable, or create it inside the function.") from e
        finally:
            _local.owner = None
            for module in local:
                cloudpickle.unregister_pickle_by_value(module)
    return Shipment(blob, dict(found))


def pack(obj) -> bytes:
    """``obj`` as one bytes object: what parameter servers take and give.

    Ray handles a NumPy array in a call's arguments or result with a costlier path (out-of-band
    buffers) than one ``bytes``; for the small arrays of a step's updates that path is most of a
    call's cost, so the hot calls send their arrays pickled in-band.

    Args:
        obj: a picklable object (NumPy arrays, lists, tuples, ints, strings).

    Returns:
        Bytes for ``unpack``.

    Example:
        >>> unpack(pack([1, "add", (2.5,)]))
        [1, 'add', (2.5,)]
    """
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(data: bytes):
    """The object ``pack`` made ``data`` of.

    Args:
        data: bytes from ``pack``.

    Returns:
        The object.

    Example:
        >>> unpack(pack({"a": 1}))
        {'a': 1}
    """
    return pickle.loads(data)
