"""``Step``: what ``@strategy.run`` and ``strategy.function`` return, and what users hold."""

from __future__ import annotations


class Step:
    """A step function compiled for every replica of a strategy; call it like the function.

    What ``@strategy.run`` and ``strategy.function`` return. The step holds the function, and
    the strategy keeps the compiled program for exactly as long as the function lives: a step
    (or function) you let go of takes its compiled program with it.

    Args:
        program: the ``Program`` that runs it.
        fn: the user's per-replica function.

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> @s.function
        ... def step(x):
        ...     return x + 1
        >>> float(step(1.0)), step.trace_count
        (2.0, 1)
    """

    def __init__(self, program, fn):
        self._program = program
        self.__wrapped__ = fn
        self.__name__ = program.__name__
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args, **kwargs):
        return self._program(*args, **kwargs)

    def lower(self, *args, **kwargs):
        """The step's program for these arguments, lowered but not run, as ``jax.jit``'s.

        ``.as_text()`` shows what the step emits, ``.compile().as_text()`` the collectives
        XLA runs (e.g. to see a ``cross_device_ops`` choice).

        Args:
            *args: the step's arguments, as for a call.
            **kwargs: its keyword arguments.

        Returns:
            A ``jax.stages.Lowered``.

        Example:
            >>> import jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> @s.function
            ... def step(x):
            ...     return jaxmirror.get_replica_context().all_reduce("sum", x)
            >>> "all-reduce" in step.lower(1.0).compile().as_text()
            True
        """
        return self._program.lower(*args, **kwargs)

    @property
    def program(self):
        """The compiled program (shared with ``strategy.run(fn, args)``)."""
        return self._program

    @property
    def fn(self):
        """The user's per-replica function."""
        return self.__wrapped__

    @property
    def trace_count(self) -> int:
        """How often the user's function was traced."""
        return self._program.trace_count

    @property
    def compile_count(self) -> int:
        """How often a program was built for it (a new placement of the inputs builds one)."""
        return self._program.compile_count

    def __repr__(self) -> str:
        return repr(self._program)
