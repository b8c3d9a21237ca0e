"""Pickling what a worker runs: functions, their arguments, and the variables they reach.

A scheduled function refers to parameter-server variables, the strategy and per-worker
iterators. Pickled for a worker, each of these becomes a small reference that the worker resolves
to its own object (``worker_runtime``). While pickling, every parameter-server variable met is
noted, so the worker knows which values to pull before the closure runs without looking at the
function.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import sys
import sysconfig
import threading
import types
import weakref
from typing import NamedTuple

import cloudpickle

_local = threading.local()
_LIBRARY_DIRS = tuple({os.path.realpath(p) for p in (sysconfig.get_paths()["purelib"],
                                                     sysconfig.get_paths()["platlib"],
                                                     sysconfig.get_paths()["stdlib"])})


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
        if isinstance(obj, (types.ModuleType, types.FunctionType, type)):
            _by_value_if_local(obj)
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


_CHECKED: set = set()  # module names already sorted into by value / by reference


def _by_value_if_local(obj) -> None:
    # Code from the user's own modules (a script or notebook, a config.py next to it, a test
    # file) travels by value, with the values its globals have now, as a tf.function's trace
    # captures them on the coordinator; a worker may not even be able to import those modules.
    # Library modules (site-packages, the standard library, jaxmirror) travel by reference.
    module = obj if isinstance(obj, types.ModuleType) else sys.modules.get(
        getattr(obj, "__module__", None) or "")
    name = getattr(module, "__name__", None)
    if module is None or name in _CHECKED:
        return
    _CHECKED.add(name)
    path = getattr(module, "__file__", None)
    if path is None or name.split(".")[0] == "jaxmirror":
        return
    if not os.path.realpath(path).startswith(_LIBRARY_DIRS):
        cloudpickle.register_pickle_by_value(module)


@contextlib.contextmanager
def _collecting():
    outer = getattr(_local, "found", None)
    _local.found = {}
    try:
        yield _local.found
    finally:
        _local.found = outer


def ship(obj) -> Shipment:
    """Pickle ``obj`` for a worker.

    Args:
        obj: a function, or a tuple of arguments.

    Returns:
        A ``Shipment``.

    Raises:
        Whatever pickling ``obj`` raises (a ``RemoteValue`` inside raises ``ValueError``).

    Example:
        >>> s = ship((1, 2))
        >>> s.variables
        {}
    """
    for item in obj if isinstance(obj, tuple) else (obj,):
        _by_value_if_local(item)
    with _collecting() as found:
        try:
            blob = _dumps(obj)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise type(e)(f"ClusterCoordinator.schedule: cannot send the function or its "
                          f"arguments to the workers: {e}. A function goes by value, with "
                          f"what it refers to and the globals of your own modules it uses "
                          f"(as a tf.function's trace captures them); make what it needs "
                          f"picklable, or create it inside the function.") from e
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
