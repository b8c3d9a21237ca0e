"""Deleted arrays among a step's arguments: an error that names them, never a crash.

JAX 0.10 kills the process (a segfault: a notebook's kernel dies) when an array whose buffers
a call *donated* reaches a program over several devices on ``jax.jit``'s C++ fast path, but
raises ``RuntimeError("Array has been deleted ...")`` for an array deleted with
``.delete()``. So a step that donates turns the arrays JAX took into deleted ones after each
call (``forget_donated``: one pass over the donated arguments' leaves), and any step whose
call fails looks for a deleted array among its arguments and names it (``check_alive``: only
then). A step that donates nothing does no work per leaf.

An array donated by the user's own ``jax.jit(..., donate_argnums=...)`` is not seen here: on
one device JAX's error is named, on several devices JAX's fast path still crashes.
"""

from __future__ import annotations

import jax

from jaxmirror.core import _compat
from jaxmirror.core.values import is_distributed


class DeletedArrayError(ValueError):
    """An argument holds an array an earlier call donated, or one deleted by hand."""


def _deleted(x) -> bool:
    """Whether ``x`` is a deleted (or donated) array; False for anything else (tracers too)."""
    is_deleted = getattr(x, "is_deleted", None)
    return is_deleted is not None and not _compat.is_tracer(x) and is_deleted()


def donated_arrays(args, kwargs, donate_argnums: tuple, api: str) -> list:
    """The arrays a donating call is about to donate; refuses one also given elsewhere in the
    call (JAX 0.10 crashes the process on a buffer donated and read in one call).

    Args:
        args: the call's positional arguments.
        kwargs: its keyword arguments (a dict, or None).
        donate_argnums: the positions it donates.
        api: the step's name, which starts the message.

    Returns:
        The donated arguments' array leaves, for ``forget_donated`` after the call.

    Raises:
        ValueError: naming both places of an array given twice.

    Example:
        >>> import jax.numpy as jnp
        >>> w = jnp.ones(2)
        >>> len(donated_arrays(({"w": w}, jnp.ones(2)), {}, (0,), "step"))
        1
        >>> donated_arrays(({"w": w}, w), {}, (0,), "step")
        Traceback (most recent call last):
        ...
        ValueError: step: args[0]['w'] and args[1] are the same array, and argument 0 is donated; ...
    """
    donated = [x for i in donate_argnums if i < len(args)
               for x in jax.tree.leaves(args[i]) if isinstance(x, jax.Array)]
    ids = set(map(id, donated))
    if len(ids) == len(donated):
        others = [x for i, a in enumerate(args) if i not in donate_argnums
                  for x in jax.tree.leaves(a)] + jax.tree.leaves(dict(kwargs or {}))
        if not any(id(x) in ids for x in others):
            return donated
    _refuse_twice(args, kwargs, donate_argnums, api)


def _refuse_twice(args, kwargs, donate_argnums: tuple, api: str) -> None:
    pairs = jax.tree_util.tree_flatten_with_path((tuple(args), dict(kwargs or {})))[0]
    first = {}
    for path, x in pairs:
        if not isinstance(x, jax.Array):
            continue
        where = _where(path, 0)[1]
        if id(x) in first:
            raise ValueError(
                f"{api}: {first[id(x)]} and {where} are the same array, and argument"
                f"{'s' if len(donate_argnums) > 1 else ''} "
                f"{', '.join(map(str, donate_argnums))} {'are' if len(donate_argnums) > 1 else 'is'} "
                f"donated; JAX cannot donate a buffer that the same call also reads (it would "
                f"crash the process); pass a copy for one of them, e.g. "
                f"`ema = jax.tree.map(jnp.copy, params)`.")
        first[id(x)] = where


def forget_donated(donated: list) -> None:
    """Delete the arrays a donating call took, so that a later call raises instead of crashing.

    Only arrays JAX already marks deleted (their buffers were donated) are deleted: an array
    JAX did not donate (no output of its shape) stays usable.

    Args:
        donated: the arrays the call donated (``donated_arrays``), after it returned.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> x, y = jnp.ones(2), jnp.ones(2)
        >>> x.delete()
        >>> forget_donated([x, y]); y.is_deleted()
        False
    """
    if not _compat.trace_state_clean():  # inside an outer jax.jit: nothing was donated
        return
    for x in donated:
        if not _compat.is_tracer(x) and x.is_deleted():
            x.delete()


def check_alive(args, kwargs, api: str, first: int = 0) -> None:
    """Refuse arguments holding a deleted array, naming the first by its path.

    Called when a step's call failed (not before every call): it walks the arguments once.

    Args:
        args: the step's positional arguments.
        kwargs: its keyword arguments (a dict, or None).
        api: the step's name, which starts the message.
        first: the position the user's call gives ``args[0]`` (a fused step's program takes
            its iterator's elements first).

    Raises:
        DeletedArrayError (a ``ValueError``): naming the argument and the deleted array's path.

    Example:
        >>> import jax.numpy as jnp
        >>> w = jnp.ones(2)
        >>> check_alive(({"w": w},), {}, "step")  # alive: nothing happens
        >>> w.delete()
        >>> check_alive(({"b": jnp.ones(2), "w": w},), {}, "step")
        Traceback (most recent call last):
        ...
        jaxmirror.step.deleted.DeletedArrayError: step: argument 0 holds arrays an earlier call donated or deleted: args[0]['w'] is deleted; ...
    """
    pairs = jax.tree_util.tree_flatten_with_path((tuple(args), dict(kwargs or {})),
                                                 is_leaf=is_distributed)[0]
    for path, x in pairs:
        if any(map(_deleted, jax.tree.leaves(x))):  # a distributed value's arrays too
            which, where = _where(path, first)
            raise DeletedArrayError(
                f"{api}: argument {which} holds arrays an earlier call donated or deleted: "
                f"{where} is deleted; pass that call's results instead, e.g. `params, "
                f"opt_state, loss = step(params, opt_state, batch)` (in a notebook: re-run "
                f"the cell that made them, not only the one that calls the step).") from None


def _where(path, first: int) -> tuple:
    """``(argument, path as the caller wrote it)`` of a leaf of ``(args, kwargs)``."""
    head, rest = path[1], path[2:]
    if path[0].idx == 0:
        return head.idx + first, f"args[{head.idx + first}]" + jax.tree_util.keystr(rest)
    return repr(head.key), "kwargs" + jax.tree_util.keystr(path[1:])


__all__ = ["DeletedArrayError", "check_alive", "donated_arrays", "forget_donated"]
