"""``VariableHandle``: a variable whose value is not a local array (parameter servers, shards).

``jaxmirror.Variable`` owns an array on the strategy's devices. Parameter-server training keeps
values elsewhere: on a parameter-server process, or split over several variables. Such a value
is reached through a handle with the same reading and assigning methods; checkpoints, operators,
``read_values`` and ``assign_values`` treat handles as they treat variables.
"""

from __future__ import annotations

import numpy as np

from jaxmirror.core import _compat
from jaxmirror.core.reduce_op import VariableAggregation, VariableSynchronization
from jaxmirror.variables.identity import Identity
from jaxmirror.variables.operators import ArrayOperators


class VariableHandle(ArrayOperators, Identity):
    """Base class of variables stored elsewhere: subclasses implement ``read_value`` and
    ``_apply`` (one assignment), and set the attributes below in their constructor.

    Attributes (set by subclasses): ``_name``, ``_shape``, ``_dtype``, ``_trainable``,
    ``_aggregation``, ``_synchronization``.

    Example:
        >>> import jaxmirror
        >>> from jaxmirror.variables.handle import VariableHandle
        >>> v = jaxmirror.experimental.ShardedVariable(
        ...     [jaxmirror.Variable([1.0, 2.0]), jaxmirror.Variable([3.0])])
        >>> isinstance(v, VariableHandle), v.shape
        (True, (3,))
    """

    _trainable = True
    _aggregation = VariableAggregation.NONE
    _synchronization = VariableSynchronization.AUTO

    def read_value(self):
        """The current value (``tf.Variable.read_value``).

        Returns:
            An array.
        """
        raise NotImplementedError

    def _apply(self, method: str, value) -> None:
        raise NotImplementedError

    def _assigned(self, method: str, value, read_value: bool):
        # What assign, assign_add and assign_sub share: the shape check, then one ``_apply``.
        shape = np.shape(value)
        if tuple(shape) != tuple(self._shape) and not (method != "assign" and shape == ()):
            raise ValueError(f"{type(self).__name__}.{method}: {self._name!r} has shape "
                             f"{self._shape}, got a value of shape {tuple(shape)}; give a value "
                             f"of the variable's shape.")
        self._apply(method, value)
        return self if read_value else None

    def assign(self, value, use_locking=None, name=None, read_value=True):
        """Overwrite the value (``tf.Variable.assign``).

        Args:
            value: an array of the variable's shape.
            use_locking, name: accepted for TF compatibility; unused.
            read_value: return the variable (True) or ``None``.

        Returns:
            The variable, or ``None``.
        """
        return self._assigned("assign", value, read_value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        """Add ``delta`` to the value (``tf.Variable.assign_add``).

        Args:
            delta: an array of the variable's shape (or a scalar).
            use_locking, name: accepted for TF compatibility; unused.
            read_value: return the variable (True) or ``None``.

        Returns:
            The variable, or ``None``.
        """
        return self._assigned("assign_add", delta, read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        """Subtract ``delta`` from the value (``tf.Variable.assign_sub``).

        Args:
            delta: an array of the variable's shape (or a scalar).
            use_locking, name: accepted for TF compatibility; unused.
            read_value: return the variable (True) or ``None``.

        Returns:
            The variable, or ``None``.
        """
        return self._assigned("assign_sub", delta, read_value)


# jnp functions and jax.jit take a handle as its value, as they take a Variable.
_compat.register_array_like(VariableHandle, lambda handle: handle.read_value())
