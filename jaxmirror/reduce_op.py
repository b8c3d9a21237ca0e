"""``ReduceOp``: how values from several replicas are combined (``tf.distribute.ReduceOp``)."""

from __future__ import annotations

import enum


class ReduceOp(enum.Enum):
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

    @classmethod
    def _missing_(cls, value):
        # TF accepts any case; an unknown name falls through to Enum's own
        # "'MAX' is not a valid ReduceOp" ValueError, which is TF's message too.
        if isinstance(value, str):
            return cls.__members__.get(value.upper())
        return None

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"


def as_reduce_op(op) -> ReduceOp:
    """``op`` (a ``ReduceOp`` or its name in any case) as a ``ReduceOp``; ValueError otherwise."""
    if isinstance(op, ReduceOp):
        return op
    return ReduceOp(op)
