"""What ``Variable(...)`` checks, which strategy owns the new variable, and its initial array."""

from __future__ import annotations

import itertools
import weakref

import jax
import jax.numpy as jnp

from jaxmirror.core import _compat, context
from jaxmirror.core.reduce_op import VariableSynchronization
from jaxmirror.core.values import Mirrored, PerReplica, components
from jaxmirror.variables.operators import ArrayOperators

Sync = VariableSynchronization
# strategy -> {variable made in its scope and still alive: creation number}
_CREATED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_NUMBERS = itertools.count()


def register(strategy, var) -> None:
    """Remember that ``var`` was made in ``strategy``'s scope (for as long as both live).

    Args:
        strategy: the owning strategy.
        var: the new variable.
    """
    _CREATED.setdefault(strategy, weakref.WeakKeyDictionary())[var] = next(_NUMBERS)


def created_in(strategy) -> list:
    """The live variables made in ``strategy``'s scope, oldest first.

    A step reaching variables by closure takes these as candidate inputs of its first trace, so
    that it need not be traced again once it is known which ones it uses.

    Args:
        strategy: a strategy.

    Returns:
        A list of variables.

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.OneDeviceStrategy("CPU:0")
        >>> with s.scope():
        ...     v = jaxmirror.Variable(1.0)
        >>> created_in(s) == [v]
        True
    """
    made = _CREATED.get(strategy)
    return [v for v, _ in sorted(made.items(), key=lambda item: item[1])] if made else []


def owning_strategy():
    """The strategy whose scope is current, or ``None`` outside every scope (a plain variable).

    Returns:
        A ``Strategy`` or ``None``.

    Raises:
        RuntimeError: in another strategy's scope entered inside the default strategy's scope
            (TF's "Mixing different tf.distribute.Strategy objects").
    """
    entry = context.current()
    default = context.default_strategy()
    if entry.strategy is default:
        return None
    if context.in_default_scope():  # TF's default-scope variable creator refuses it
        raise context.mixing_error(default, entry.strategy)
    return entry.strategy


def checked_trainable(trainable, sync, name: str) -> bool:
    """``trainable`` as TF 2 resolves it: ``None`` means True, except for ON_READ variables.

    TF 2's ``tf.Variable`` keeps ``trainable=True`` with ON_READ (only TF 1's ``get_variable``
    refuses it), and so does jaxmirror.

    Args:
        trainable: what ``Variable`` was given (``None``, or a bool).
        sync: the ``VariableSynchronization``.
        name: the variable's name.

    Returns:
        A bool.

    Example:
        >>> checked_trainable(None, Sync.ON_READ, "v"), checked_trainable(True, Sync.ON_READ, "v")
        (False, True)
    """
    del name
    if trainable is None:
        return sync is not Sync.ON_READ
    return bool(trainable)


class CreatedInRun(RuntimeError):
    """A variable created inside ``run`` (``call_for_each_replica`` then creates it eagerly)."""


def checked_owner(sync, name: str):
    """The strategy that owns a variable created here; raises where none may be created.

    Raises:
        CreatedInRun: inside ``run``.
        ValueError: for ``synchronization=NONE`` in a strategy's scope (TF's message).
    """
    if context.current().in_run:
        raise CreatedInRun(
            f"Variable: {name!r} was created inside `run`, whose function is traced once for "
            f"every replica and compiled (a variable made there would exist only in that "
            f"trace); create variables before the step (inside `strategy.scope()`, or with "
            f"`strategy.extended.call_for_each_replica` outside `run`) and use them in it by "
            f"argument or closure."
        )
    strategy = owning_strategy()
    if strategy is not None and sync is Sync.NONE:
        raise ValueError(  # TF's wording, on purpose
            f"`NONE` variable synchronization mode is not supported with {type(strategy).__name__}. "
            f"Please change the `synchronization` for variable: {name}"
        )
    return strategy


def initial_array(initial_value, dtype, name: str):
    """The new variable's value as a fresh array it owns.

    Args:
        initial_value: what ``Variable`` was given: an array, a number, a variable, a
            distributed value, or a callable returning one.
        dtype: the dtype asked for, or ``None``.
        name: the variable's name, for errors.

    Returns:
        A ``jax.Array`` with a strong dtype, copied (TF copies too), so donating the initial
        array elsewhere cannot delete the variable's value.

    Raises:
        ValueError: for a missing or traced initial value.
    """
    if initial_value is None:
        raise ValueError(f"Variable: initial_value must be specified (variable {name!r}); give "
                         f"an array, a number or a callable returning one.")
    if callable(initial_value) and not isinstance(initial_value, (jax.Array, ArrayOperators)):
        initial_value = initial_value()
    value = host_value(initial_value)
    if _compat.is_tracer(value):
        raise ValueError(f"Variable: initial_value of {name!r} is a traced value; create "
                         f"variables outside jax.jit and `run`.")
    value = jnp.asarray(value)
    return jnp.array(value, dtype=dtype or value.dtype, copy=True)


def host_value(x):
    """An initial value as one array: a variable's value, a PerReplica's component 0.

    Args:
        x: what ``Variable(initial_value)`` was given (after calling a callable).

    Returns:
        The value every component starts from.
    """
    if isinstance(x, ArrayOperators):
        return x.read_value()
    if isinstance(x, PerReplica):
        return components(x.stacked)[0]  # every component starts from replica 0's value
    if isinstance(x, Mirrored):
        return x.value
    return x
