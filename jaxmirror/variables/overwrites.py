"""``OverwriteWatch``: telling a variable's overwrites (``assign``) from its increments.

A parameter server applies a worker's ``assign_add``/``assign_sub`` to its current value, so
increments from several workers add up, but an ``assign`` as an overwrite. The worker's local
copy of the variable learns which it got from a flag variable that every ``assign`` sets. Inside
a compiled step the flag's assignment is part of the same program, so it happens on every call,
not only on the call that traced the step.
"""

from __future__ import annotations

import contextlib


class OverwriteWatch:
    """Mixin of ``jaxmirror.Variable``: an optional flag that every ``assign`` sets to 1.

    Example:
        >>> import jaxmirror
        >>> v, flag = jaxmirror.Variable(1.0), jaxmirror.Variable(0)
        >>> v.watch_overwrites(flag)
        >>> _ = v.assign_add(1.0); int(flag.numpy())
        0
        >>> _ = v.assign(5.0); int(flag.numpy())
        1
    """

    __slots__ = ()
    _overwrite_flag = None  # a class default: copies and unpickled variables watch nothing

    def watch_overwrites(self, flag) -> None:
        """Make every ``assign`` of this variable also assign 1 to ``flag``.

        Args:
            flag: a scalar int32 ``Variable`` of the same strategy, or ``None`` to stop.

        Returns:
            ``None``.

        Example:
            >>> import jaxmirror
            >>> v, flag = jaxmirror.Variable([1.0]), jaxmirror.Variable(0)
            >>> v.watch_overwrites(flag)
            >>> _ = v.assign([2.0]); int(flag.numpy())
            1
        """
        self._overwrite_flag = flag

    def note_assignment(self, method: str) -> None:
        """Called by each assignment before it writes: sets the flag for an ``assign``.

        Args:
            method: ``"assign"``, ``"assign_add"`` or ``"assign_sub"``.

        Returns:
            ``None``.

        Example:
            >>> import jaxmirror
            >>> v, flag = jaxmirror.Variable(1.0), jaxmirror.Variable(0)
            >>> v.watch_overwrites(flag); v.note_assignment("assign_sub"); int(flag.numpy())
            0
        """
        if method == "assign" and self._overwrite_flag is not None:
            self._overwrite_flag.assign(1, read_value=False)

    @contextlib.contextmanager
    def overwrites_unwatched(self):
        """A context in which this variable's assignments do not set its flag.

        For writes that are not the closure's own overwrites: loading values into the copy, or
        copying an object's state into it (then sent as a difference, as increments are).

        Returns:
            A context manager.

        Example:
            >>> import jaxmirror
            >>> v, flag = jaxmirror.Variable(1.0), jaxmirror.Variable(0)
            >>> v.watch_overwrites(flag)
            >>> with v.overwrites_unwatched():
            ...     _ = v.assign(4.0)
            >>> int(flag.numpy()), float(v.numpy())
            (0, 4.0)
        """
        flag, self._overwrite_flag = self._overwrite_flag, None
        try:
            yield
        finally:
            self._overwrite_flag = flag
