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


def _deleted(x) -> bool:
    """Whether ``x`` is a deleted (or donated) array; False for anything else (tracers too)."""
    is_deleted = getattr(x, "is_deleted", None)
    return is_deleted is not None and not _compat.is_tracer(x) and is_deleted()


def forget_donated(args, donate_argnums: tuple) -> None:
    """Delete the arrays a donating call took, so that a later call raises instead of crashing.

    Only arrays JAX already marks deleted (their buffers were donated) are deleted: an array
    JAX did not donate (no output of its shape) stays usable.

    Args:
        args: the positional arguments of the call that just returned.
        donate_argnums: the positions it donated.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> x, y = jnp.ones(2), jnp.ones(2)
        >>> x.delete()
        >>> forget_donated((x, y), (0, 1)); y.is_deleted()
        False
    """
    if not _compat.trace_state_clean():  # inside an outer jax.jit: nothing was donated
        return
    for i in donate_argnums:
        if i < len(args):
            for x in jax.tree.leaves(args[i]):
                is_deleted = getattr(x, "is_deleted", None)
                if is_deleted is not None and is_deleted():
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
        ValueError: naming the argument and the deleted array's path in it.

    Example:
        >>> import jax.numpy as jnp
        >>> w = jnp.ones(2)
        >>> check_alive(({"w": w},), {}, "step")  # alive: nothing happens
        >>> w.delete()
        >>> check_alive(({"b": jnp.ones(2), "w": w},), {}, "step")
        Traceback (most recent call last):
        ...
        ValueError: step: argument 0 holds arrays an earlier call donated or deleted: args[0]['w'] is deleted; ...
    """
    pairs = jax.tree_util.tree_flatten_with_path((tuple(args), dict(kwargs or {})),
                                                 is_leaf=is_distributed)[0]
    for path, x in pairs:
        if any(map(_deleted, jax.tree.leaves(x))):  # a distributed value's arrays too
            head, rest = path[1], path[2:]
            if path[0].idx == 0:
                which = head.idx + first
                where = f"args[{which}]" + jax.tree_util.keystr(rest)
            else:
                which = repr(head.key)
                where = "kwargs" + jax.tree_util.keystr(path[1:])
            raise ValueError(
                f"{api}: argument {which} holds arrays an earlier call donated or deleted: "
                f"{where} is deleted; pass that call's results instead, e.g. `params, "
                f"opt_state, loss = step(params, opt_state, batch)` (in a notebook: re-run "
                f"the cell that made them, not only the one that calls the step).") from None


__all__ = ["check_alive", "forget_donated"]
