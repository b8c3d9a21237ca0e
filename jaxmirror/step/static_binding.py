"""``StaticBinding``: the static ``jax.jit`` argument naming the variables a step call binds.

Example:
    >>> import jaxmirror
    >>> v = jaxmirror.Variable(1.0)
    >>> b = StaticBinding((0,), (v,), ())
    >>> b.resolve()[1][0] is v, b == StaticBinding((0,), (v,), ())
    (True, False)
"""

from __future__ import annotations

import weakref


class StaticBinding:
    """The static jit argument naming the variables a call binds, without keeping them alive.

    JAX's compilation caches are global and keep a jitted function's static arguments until the
    function is collected; a tuple of variables there would keep the variables, their strategy,
    its programs and so the jitted function itself alive for ever. A ``_Binding`` holds weak
    references and compares by identity: ``Program._binding`` makes one per binding.
    """

    __slots__ = ("_positions", "_arguments", "_captured", "__weakref__")

    def __init__(self, positions: tuple, variables: tuple, captured: tuple):
        self._positions = positions
        self._arguments = tuple(map(weakref.ref, variables))
        self._captured = tuple(map(weakref.ref, captured))

    def resolve(self) -> tuple:
        """``(positions, variables, captured)`` as ``trace.trace_replica`` takes them."""
        return (self._positions, tuple(r() for r in self._arguments),
                tuple(r() for r in self._captured))
