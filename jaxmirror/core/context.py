"""Where we are: a thread-local stack of (strategy, replica context) entries.

The bottom entry is the default strategy in its default replica context. ``Strategy.scope()``
pushes a cross-replica entry, ``run`` pushes a replica entry while it traces the step function,
and ``merge_call`` pushes a cross-replica entry while it traces ``merge_fn``. Nothing else in
jaxmirror is global.

The default strategy is a strategy like the others, defined in the strategies layer above this
one; it registers how to make it with ``register_default`` when jaxmirror is imported, so that
this module never imports upwards.
"""

from __future__ import annotations

import contextlib
import threading
from typing import NamedTuple

_local = threading.local()
# "make": the registered factory; "entry": the bottom entry, made on first use (building the
# default strategy starts JAX's backend, which importing jaxmirror must not do).
_default: dict = {}


class Entry(NamedTuple):
    strategy: object
    replica_context: object  # a ReplicaContext, or None in cross-replica context
    in_run: bool = False  # True while `run` traces the step function (merge_fn included)
    merging: object = None  # in a merge_fn: the ReplicaContext whose merge_call runs it


def register_default(make) -> None:
    """Say how to make the default strategy (the strategies layer does, on import).

    Args:
        make: a zero-argument function returning ``(strategy, replica_context)``: the default
            strategy and its default replica context (replica 0 of 1). Called once, on first use.

    Returns:
        None.

    Example:
        >>> import jaxmirror
        >>> from jaxmirror.core import context
        >>> context.default_strategy() is jaxmirror.get_strategy()
        True
    """
    _default["make"] = make


def _bottom() -> Entry:
    try:
        return _default["entry"]
    except KeyError:
        pass
    try:
        make = _default["make"]
    except KeyError:
        raise RuntimeError("jaxmirror: no default strategy is registered; import jaxmirror "
                           "(its strategies register it) before using contexts.") from None
    return _default.setdefault("entry", Entry(*make()))


def default_strategy():
    """The strategy in force when none is: one replica on JAX's default device."""
    return _bottom().strategy


def _stack() -> list:
    try:
        return _local.stack
    except AttributeError:
        _local.stack = [_bottom()]
        _local.global_scope = None
        _local.global_depth = 1  # the stack's depth with the global scope entered
        _local.default_scopes = [0]  # a list: its generator may finish on another thread
        return _local.stack


def current() -> Entry:
    try:  # the hot path of every `run` call comes through here
        return _local.stack[-1]
    except AttributeError:
        return _stack()[-1]


@contextlib.contextmanager
def pushed(entry: Entry):
    stack = _stack()
    stack.append(entry)
    try:
        yield entry
    finally:
        stack.pop()


@contextlib.contextmanager
def default_scope():
    """Enter the default strategy's scope: TF pushes no context for it, only a variable
    creator that refuses variables of another strategy (``in_default_scope``)."""
    _stack()
    count = _local.default_scopes  # this thread's, even if the generator ends elsewhere
    count[0] += 1
    try:
        yield
    finally:
        count[0] -= 1


def in_default_scope() -> bool:
    """Whether the default strategy's ``scope()`` is entered on this thread."""
    _stack()
    return _local.default_scopes[0] > 0


def mixing_error(current_strategy, strategy) -> RuntimeError:
    """TF's error for using one strategy inside another's scope (TF's wording, on purpose),
    with what to do: two strategies over the same devices print alike, and in a notebook the
    usual cause is a strategy cell run again while an old strategy's scope is still entered."""
    return RuntimeError(
        f"Mixing different jaxmirror Strategy objects: {strategy!r} (at {id(strategy):#x}) is "
        f"not {current_strategy!r} (at {id(current_strategy):#x}), whose scope is entered. Use "
        f"one strategy object at a time: in a notebook this usually means the cell that creates "
        f"the strategy ran again; use the strategy of the `with strategy.scope():` you are in, "
        f"or leave that scope first (experimental_set_strategy(None) if you set it globally)."
    )


def get_strategy():
    """Returns the current strategy, or the default strategy when none is current.

    As ``tf.distribute.get_strategy``. Inside ``strategy.scope()``, inside a function run by
    ``strategy.run`` and inside a ``merge_call`` it is ``strategy``; elsewhere it is the default
    strategy (one replica on JAX's default device).

    Returns:
        A ``Strategy``.

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.OneDeviceStrategy("CPU:0")
        >>> with s.scope():
        ...     jaxmirror.get_strategy() is s
        True
        >>> jaxmirror.get_strategy().num_replicas_in_sync
        1
    """
    return current().strategy


def has_strategy() -> bool:
    """True if a non-default strategy is current (as ``tf.distribute.has_strategy``).

    Returns:
        ``False`` outside every scope and ``run``; ``True`` inside them.

    Example:
        >>> import jaxmirror
        >>> jaxmirror.has_strategy()
        False
        >>> with jaxmirror.OneDeviceStrategy("CPU:0").scope():
        ...     jaxmirror.has_strategy()
        True
    """
    return current().strategy is not default_strategy()


def get_replica_context():
    """The current ``ReplicaContext``, or ``None`` in a cross-replica context.

    As ``tf.distribute.get_replica_context``: outside any scope it is the default replica context
    (replica 0 of 1); inside ``scope()`` and inside a ``merge_call``'s ``merge_fn`` it is ``None``;
    inside ``run`` it is the running strategy's replica context.

    Returns:
        A ``ReplicaContext`` or ``None``.

    Example:
        >>> import jaxmirror
        >>> jaxmirror.get_replica_context().replica_id_in_sync_group
        0
        >>> with jaxmirror.OneDeviceStrategy("CPU:0").scope():
        ...     print(jaxmirror.get_replica_context())
        None
    """
    return current().replica_context


def in_cross_replica_context() -> bool:
    """True inside a strategy's ``scope()`` or a ``merge_fn``; False elsewhere.

    Returns:
        A bool, as ``tf.distribute.in_cross_replica_context``.

    Example:
        >>> import jaxmirror
        >>> jaxmirror.in_cross_replica_context()
        False
        >>> with jaxmirror.OneDeviceStrategy("CPU:0").scope():
        ...     jaxmirror.in_cross_replica_context()
        True
    """
    return current().replica_context is None


def get_cross_replica_context():
    """The current strategy in a cross-replica context, else ``None``.

    As ``tf.distribute.get_cross_replica_context``: inside ``scope()`` and inside a
    ``merge_call``'s ``merge_fn`` it is the strategy; inside ``run`` (replica context) and
    outside every scope (the default replica context) it is ``None``.

    Returns:
        A ``Strategy`` or ``None``.

    Example:
        >>> import jaxmirror
        >>> print(jaxmirror.get_cross_replica_context())
        None
        >>> s = jaxmirror.OneDeviceStrategy("CPU:0")
        >>> with s.scope():
        ...     jaxmirror.get_cross_replica_context() is s
        True
    """
    entry = current()
    return entry.strategy if entry.replica_context is None else None


def experimental_set_strategy(strategy) -> None:
    """Make ``strategy`` current on this thread without a ``with`` block; ``None`` clears it.

    As ``tf.distribute.experimental_set_strategy``: the same as entering ``strategy.scope()`` and
    leaving it only at the next call. Calling it inside a ``with strategy.scope()`` block raises.
    Setting the default strategy enters its scope, as in TF: until the next call, variables made
    in another strategy's scope raise "Mixing different ... Strategy objects".

    Args:
        strategy: a ``Strategy``, or ``None`` to return to the default strategy.

    Returns:
        None.

    Raises:
        RuntimeError: when called inside a strategy's scope.

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.OneDeviceStrategy("CPU:0")
        >>> jaxmirror.experimental_set_strategy(s)
        >>> jaxmirror.get_strategy() is s
        True
        >>> jaxmirror.experimental_set_strategy(None)
        >>> jaxmirror.has_strategy()
        False
    """
    stack = _stack()
    old = _local.global_scope
    if len(stack) != (1 if old is None else _local.global_depth):  # the default's pushes none
        raise RuntimeError("Must not be called inside a jaxmirror Strategy scope.")  # TF's wording
    if old is not None:
        old.__exit__(None, None, None)
        _local.global_scope = None
    if strategy is not None:
        scope = strategy.scope()
        scope.__enter__()
        _local.global_scope, _local.global_depth = scope, len(stack)
