"""``Checkpointable``: objects that ``jaxmirror.checkpoint`` saves as one small array of state.

A checkpoint holds one array per leaf. Variables and arrays are their values; some objects are
neither but have a position worth saving with the model, as TF saves a ``tf.data`` iterator
in a ``tf.train.Checkpoint``: a distributed iterator (how many steps it has given) or the
preemption handler's count of ``run`` calls. Such an object subclasses ``Checkpointable``; the
checkpoint code (``variables/``) handles it through these members only, without knowing the
classes, which live in layers above it.
"""

from __future__ import annotations

import numpy as np


class Checkpointable:
    """Base class of objects saved in a checkpoint as a fixed-shape array of their state.

    ``jaxmirror.checkpoint.save`` saves ``checkpoint_state()``; ``restore`` checks every such
    leaf's saved state with ``check_checkpoint_state`` before it assigns anything, and applies
    it with ``restore_checkpoint_state`` once the variables are assigned. The object itself is
    restored in place (as variables are).

    Example:
        >>> import numpy as np
        >>> class Counter(Checkpointable):
        ...     n = 0
        ...     def checkpoint_state(self):
        ...         return np.array([self.n], np.int64)
        ...     def restore_checkpoint_state(self, state):
        ...         self.n = int(state[0])
        >>> c = Counter()
        >>> c.restore_checkpoint_state(np.array([4])); c.checkpoint_state()
        array([4])
        >>> c.checkpoint_shape_dtype()
        ((1,), dtype('int64'))
    """

    __slots__ = ()

    def checkpoint_state(self) -> np.ndarray:
        """This object's state as a NumPy array of a fixed shape and dtype.

        Returns:
            The array to save.
        """
        raise NotImplementedError

    def checkpoint_shape_dtype(self) -> tuple:
        """``(shape, dtype)`` of ``checkpoint_state()`` (what a restore reads).

        Returns:
            A ``(tuple, numpy.dtype)`` pair.
        """
        state = self.checkpoint_state()
        return tuple(state.shape), np.dtype(state.dtype)

    def check_checkpoint_state(self, state: np.ndarray) -> None:
        """Raise ``ValueError`` if ``state`` cannot be restored here (nothing changes).

        Args:
            state: a saved ``checkpoint_state()``.
        """

    def restore_checkpoint_state(self, state: np.ndarray) -> None:
        """Take ``state`` (checked already) in place.

        Args:
            state: a saved ``checkpoint_state()``.
        """
        raise NotImplementedError


__all__ = ["Checkpointable"]
