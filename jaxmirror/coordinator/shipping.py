"""Pickling what a worker runs: functions, their arguments, and the variables they reach.

A scheduled function refers to parameter-server variables, the strategy and per-worker
iterators. Pickled for a worker, each of these becomes a small reference that the worker resolves
to its own object (``worker_runtime``). While pickling, every parameter-server variable met is
noted, so the worker knows which values to pull before the closure runs without looking at the
function.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import sysconfig
import threading
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


def _by_value_if_local(obj) -> None:
    # Functions from modules a worker process may not import (a test file, a script next to the
    # notebook) travel by value; library modules travel by reference.
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    path = getattr(module, "__file__", None)
    if module is None or path is None or module.__name__.split(".")[0] == "jaxmirror":
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
        blob = cloudpickle.dumps(obj)
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
