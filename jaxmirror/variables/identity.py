"""What TF code asks of a variable besides its value: ``name``, ``shape``, ``dtype``,
``trainable``, ``synchronization``, ``aggregation``, ``v.ref()`` (a hashable key) and ``v.device``.

A ``tf.Variable`` is not hashable, so TF code keys dicts and sets by ``v.ref()``; jaxmirror's
variables hash by identity already, and ``ref()`` gives TF's spelling of the same thing.
"""

from __future__ import annotations

from jaxmirror.core.devices import tf_name
from jaxmirror.core.reduce_op import VariableAggregation, VariableSynchronization


class Reference:
    """A hashable reference to a variable (``tf.Variable.ref()``); ``deref()`` gives it back.

    Two references are equal exactly when they refer to the same variable.

    Args:
        variable: the variable referred to.

    Example:
        >>> import jaxmirror
        >>> v = jaxmirror.Variable(1.0)
        >>> r = v.ref()
        >>> r == v.ref(), r.deref() is v, {r: "v"}[v.ref()]
        (True, True, 'v')
    """

    __slots__ = ("_variable",)

    def __init__(self, variable):
        self._variable = variable

    def deref(self):
        """The variable this refers to.

        Returns:
            The variable.
        """
        return self._variable

    def __eq__(self, other) -> bool:
        return isinstance(other, Reference) and other._variable is self._variable

    def __hash__(self) -> int:
        return id(self._variable)

    def __repr__(self) -> str:
        return f"<Reference to {self._variable!r}>"


class Identity:
    """The metadata properties, ``ref()``, ``experimental_ref()`` and ``device`` of jaxmirror's
    variables and variable handles (which set ``_name``, ``_shape``, ``_dtype``, ``_trainable``,
    ``_synchronization`` and ``_aggregation``).

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with s.scope():
        ...     v = jaxmirror.Variable(1.0)
        >>> v.device
        '/job:localhost/replica:0/task:0/device:CPU:0'
    """

    __slots__ = ()

    @property
    def name(self) -> str:
        """The variable's name."""
        return self._name

    @property
    def shape(self) -> tuple:
        """The shape of the value (of each component of a distributed variable)."""
        return self._shape

    @property
    def dtype(self):
        """The dtype of the value."""
        return self._dtype

    @property
    def trainable(self) -> bool:
        """Whether training should update this variable."""
        return self._trainable

    @property
    def synchronization(self) -> VariableSynchronization:
        """When the components are kept in step (ON_WRITE/AUTO, ON_READ, NONE)."""
        return self._synchronization

    @property
    def aggregation(self) -> VariableAggregation:
        """How replica-context assignments are combined."""
        return self._aggregation

    def ref(self) -> Reference:
        """A hashable reference to this variable, as TF's ``Variable.ref()``.

        Returns:
            A ``Reference``; ``ref().deref()`` is this variable.

        Example:
            >>> import jaxmirror
            >>> v = jaxmirror.Variable(0.0)
            >>> v.ref() in {v.ref()}
            True
        """
        return Reference(self)

    def experimental_ref(self) -> Reference:
        """TF's older name of ``ref()``.

        Returns:
            A ``Reference``.

        Example:
            >>> import jaxmirror
            >>> v = jaxmirror.Variable(0.0)
            >>> v.experimental_ref() == v.ref()
            True
        """
        return self.ref()

    @property
    def device(self) -> str:
        """The TF name of the device of the first component (replica 0's, as TF's
        ``MirroredVariable.device`` gives its primary's)."""
        return tf_name(self.distribute_strategy.extended.placement.devices[0])
