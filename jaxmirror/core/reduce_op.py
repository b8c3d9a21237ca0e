"""How values are combined: ``ReduceOp``, ``VariableAggregation``, ``VariableSynchronization``."""

from __future__ import annotations

import enum

import jax.numpy as jnp


class _NamedEnum(enum.Enum):
    # TF accepts any case; an unknown name falls through to Enum's own
    # "'MAX' is not a valid ReduceOp" ValueError, which is TF's message too.
    @classmethod
    def _missing_(cls, value):
        if isinstance(value, str):
            return cls.__members__.get(value.upper())
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class ReduceOp(_NamedEnum):
    """How to combine values from several replicas, as ``tf.distribute.ReduceOp``.

    ``SUM`` adds the replicas' values; ``MEAN`` averages them. Wherever jaxmirror takes a reduce op
    it also takes the names as strings, in any case (``"sum"``, ``"Mean"``).

    Example:
        >>> import jaxmirror
        >>> jaxmirror.ReduceOp("sum") is jaxmirror.ReduceOp.SUM
        True
        >>> jaxmirror.ReduceOp.MEAN.value
        'MEAN'
    """

    SUM = "SUM"
    MEAN = "MEAN"


def as_reduce_op(op) -> ReduceOp:
    """``op`` (a ``ReduceOp`` or its name in any case) as a ``ReduceOp``; ValueError otherwise."""
    if isinstance(op, ReduceOp):
        return op
    return ReduceOp(op)


class VariableAggregation(_NamedEnum):
    """How a variable combines the values replicas assign to it (``tf.VariableAggregation``).

    ``NONE``: no combining (a mirrored variable's replicas each write their own component; a
    sync-on-read variable cannot be read in cross-replica context). ``SUM`` and ``MEAN`` add or
    average the replicas' values; ``ONLY_FIRST_REPLICA`` takes replica 0's. Names are accepted as
    strings in any case too.

    Example:
        >>> import jaxmirror
        >>> jaxmirror.VariableAggregation("mean") is jaxmirror.VariableAggregation.MEAN
        True
    """

    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3


class VariableSynchronization(_NamedEnum):
    """When a distributed variable's components are kept in step (``tf.VariableSynchronization``).

    ``AUTO`` and ``ON_WRITE`` make a mirrored variable (every write reaches every replica);
    ``ON_READ`` a sync-on-read variable (replicas write their own component, a cross-replica read
    aggregates them); ``NONE`` is refused inside a strategy's scope.

    Example:
        >>> import jaxmirror
        >>> jaxmirror.VariableSynchronization("on_read")
        VariableSynchronization.ON_READ
    """

    AUTO = 0
    NONE = 1
    ON_WRITE = 2
    ON_READ = 3


def as_aggregation(value, name: str = "aggregation") -> VariableAggregation:
    """``value`` as a ``VariableAggregation``; ValueError naming ``name`` otherwise."""
    try:
        return value if isinstance(value, VariableAggregation) else VariableAggregation(value)
    except ValueError:
        # TF's wording, on purpose (and for synchronization below), with what is accepted.
        raise ValueError(f"Invalid variable aggregation mode: {value!r} for `{name}`; expected one "
                         f"of {[m.name for m in VariableAggregation]}.") from None


def as_synchronization(value, name: str = "synchronization") -> VariableSynchronization:
    """``value`` as a ``VariableSynchronization``; ValueError naming ``name`` otherwise."""
    try:
        if isinstance(value, VariableSynchronization):
            return value
        return VariableSynchronization(value)
    except ValueError:
        raise ValueError(f"Invalid variable synchronization mode: {value!r} for `{name}`; expected "
                         f"one of {[m.name for m in VariableSynchronization]}.") from None


def reduce_op_of(op) -> ReduceOp:
    """A ``ReduceOp`` from a reduce op or a SUM/MEAN ``VariableAggregation`` (``reduce_to`` takes both)."""
    if isinstance(op, VariableAggregation):
        if op is VariableAggregation.SUM:
            return ReduceOp.SUM
        if op is VariableAggregation.MEAN:
            return ReduceOp.MEAN
        # TF's wording, on purpose.
        raise ValueError(f"Could not convert from `VariableAggregation` {op} to `ReduceOp` type; "
                         f"only SUM and MEAN reduce across replicas.")
    return as_reduce_op(op)


def as_float(x):
    """``x`` as the floats a MEAN divides: TF returns floats for an integer MEAN.

    Args:
        x: an array or a number.

    Returns:
        ``x`` as an array, cast to JAX's default float unless it is already inexact.

    Example:
        >>> as_float(3).dtype
        dtype('float32')
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        x = x.astype(jnp.result_type(float))
    return x
