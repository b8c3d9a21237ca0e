"""A strategy's compiled programs, each kept exactly as long as its function lives.

``strategy.run(fn, args)`` must find ``fn``'s program again on every call, so the strategy keeps
it; but that must not keep ``fn`` alive, nor what ``fn`` reaches (its variables, their strategy,
arrays in its closure), once the user has let go of it: re-running a notebook cell makes new
functions every time, and each compiled program costs native memory. So programs are found
through weak references: a function's programs go when the function goes, a bound method's
when its object goes (a new bound method object for the same object and function finds the
same program). Programs never hold their function strongly (``Program(weak=True)``).
Callables that cannot be weakly referenced are kept, with their programs, in a small LRU.
"""

from __future__ import annotations

import collections
import types
import weakref

from jaxmirror.step.program import Program

# Programs of callables that cannot be weakly referenced: the most recently used are kept.
MAX_STRONG = 256


class ProgramCache:
    """``fn``'s ``Program`` for each ``donate_argnums``, alive while ``fn`` (or its object) is.

    Args:
        strategy: the strategy the programs run on.

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> cache = ProgramCache(s)
        >>> f = lambda x: x
        >>> cache.get(f, ()) is cache.get(f, ()), len(cache)
        (True, 1)
        >>> del f
        >>> len(cache)
        0
    """

    def __init__(self, strategy):
        self._strategy = strategy
        self._weak: dict = {}  # id(owner) -> (weakref to owner, {subkey: Program})
        self._strong: collections.OrderedDict = collections.OrderedDict()  # LRU

    def get(self, fn, donate_argnums: tuple) -> Program:
        """The program of ``fn`` with ``donate_argnums``, made on first use.

        Args:
            fn: the per-replica function (any callable).
            donate_argnums: a tuple of positional argument indices.

        Returns:
            The ``Program``.
        """
        if isinstance(fn, types.MethodType):
            owner, subkey = fn.__self__, (fn.__func__, donate_argnums)
        else:
            owner, subkey = fn, donate_argnums
        entry = self._weak.get(id(owner))
        if entry is None or entry[0]() is not owner:
            try:
                ref = weakref.ref(owner, _forgetter(self._weak, id(owner)))
            except TypeError:  # cannot be weakly referenced
                return self._get_strong(fn, donate_argnums)
            entry = self._weak[id(owner)] = (ref, {})
        programs = entry[1]
        program = programs.get(subkey)
        if program is None:
            program = programs[subkey] = Program(self._strategy, fn, donate_argnums)
        return program

    def _get_strong(self, fn, donate_argnums: tuple) -> Program:
        key = (id(fn), donate_argnums)  # ``fn`` is kept with its program, so its id stays its own
        hit = self._strong.get(key)
        if hit is not None:
            self._strong.move_to_end(key)  # in use: the last to be evicted
            return hit[1]
        program = Program(self._strategy, fn, donate_argnums, weak=False)
        self._strong[key] = (fn, program)
        if len(self._strong) > MAX_STRONG:
            self._strong.popitem(last=False)
        return program

    def programs(self) -> list:
        """Every program alive in the cache (for tests and diagnostics).

        Returns:
            A list of ``Program``s.
        """
        alive = [p for _, table in list(self._weak.values()) for p in table.values()]
        return alive + [p for _, p in self._strong.values()]

    def __len__(self) -> int:
        return len(self.programs())


def _forgetter(table: dict, key: int):
    """A weakref callback dropping ``table[key]`` when its owner dies (and holding no cache)."""
    def forget(ref):
        entry = table.get(key)
        if entry is not None and entry[0] is ref:
            del table[key]
    return forget


__all__ = ["MAX_STRONG", "ProgramCache"]
