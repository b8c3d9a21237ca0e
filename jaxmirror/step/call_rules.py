"""When ``run`` may be called, and how ``run(fn)`` without arguments is read."""

from __future__ import annotations

import inspect

from jaxmirror.core import context


def wants_arguments(fn) -> bool:
    """True when ``fn`` has a required positional parameter (then ``run(fn)`` decorates)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               for p in params)


def check_can_run(strategy) -> None:
    """Refuse a ``run`` of ``strategy`` here, before any device work, as TF does.

    ``run`` inside a step that ``run`` is tracing raises, and so does a strategy's ``run`` inside
    another strategy's scope.

    Args:
        strategy: the strategy whose ``run`` is called.

    Raises:
        RuntimeError: in those two cases.
    """
    entry = context.current()
    if entry.in_run:
        where = ("; inside a merge_fn, run a function on every replica with "
                 "`strategy.extended.call_for_each_replica(fn, args)`" if entry.merging else "")
        raise RuntimeError(
            "run: called inside a function that `run` is already running; call the inner "
            "function directly, or, as TF says, \"Method requires being in cross-replica "
            f"context, use get_replica_context().merge_call()\"{where}."
        )
    if entry.strategy is not strategy and entry.strategy is not context.default_strategy():
        raise context.mixing_error(entry.strategy, strategy)
