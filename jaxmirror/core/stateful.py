"""``Stateful``: what a compiled step needs from a value with state (jaxmirror's variables).

A step is a pure function, but TF code reads and assigns variables in it. The step layer binds
every stateful value the step touches to a traced stand-in (``core.binding``) and writes the
new values back after the call; for that it needs only the members below, which the variables
layer implements. Neither ``core`` nor the step layer knows the variable classes themselves.
"""

from __future__ import annotations

from jaxmirror.core.values import DistributedValues


class Stateful:
    """Base class of values a compiled step reads and writes through traced stand-ins.

    Subclasses (``jaxmirror.Variable``) implement every member.

    Example:
        >>> import jaxmirror
        >>> from jaxmirror.core.stateful import Stateful
        >>> v = jaxmirror.Variable(1.0)
        >>> isinstance(v, Stateful), v.stored_per_replica, float(v.distributed_view())
        (True, False, 1.0)
    """

    __slots__ = ()

    @property
    def shape(self) -> tuple:
        """The shape of the value (of each component)."""
        raise NotImplementedError

    @property
    def dtype(self):
        """The dtype of the value."""
        raise NotImplementedError

    @property
    def stored_per_replica(self) -> bool:
        """Whether the state holds one component per replica, stacked (a ``PerReplica``)."""
        raise NotImplementedError

    @property
    def always_per_replica(self) -> bool:
        """Whether the components stay one per replica even when they agree (sync-on-read), so
        a step returns them per replica whatever its analysis says."""
        raise NotImplementedError

    def check_usable_in(self, strategy) -> None:
        """Raise ``ValueError`` unless a step of ``strategy`` may use this value.

        Args:
            strategy: the strategy whose step met the value.
        """
        raise NotImplementedError

    def distributed_view(self):
        """The value as ``reduce``, ``gather`` and local results see it in this context.

        Returns:
            A distributed value (``PerReplica``, ``Mirrored``) or an array.
        """
        raise NotImplementedError


def is_opaque(x) -> bool:
    """Leaves that tree maps hand over whole: distributed values and stateful values.

    Args:
        x: a pytree node.

    Returns:
        A bool, for ``jax.tree.map(..., is_leaf=is_opaque)``.
    """
    return isinstance(x, (DistributedValues, Stateful))
