"""What TF code asks of a variable's identity: ``v.ref()`` (a hashable key) and ``v.device``.

A ``tf.Variable`` is not hashable, so TF code keys dicts and sets by ``v.ref()``; jaxmirror's
variables hash by identity already, and ``ref()`` gives TF's spelling of the same thing.
"""

from __future__ import annotations

from jaxmirror.core.devices import tf_name


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
    """``ref()``, ``experimental_ref()`` and ``device`` for jaxmirror's variables.

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with s.scope():
        ...     v = jaxmirror.Variable(1.0)
        >>> v.device
        '/job:localhost/replica:0/task:0/device:CPU:0'
    """

    __slots__ = ()

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
