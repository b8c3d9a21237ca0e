"""How a metric's state variables are added to, read and zeroed, in every context.

A metric's variables are sync-on-read with SUM aggregation: inside a step each replica adds to
its own component, and a cross-replica read sums them. Outside ``run`` TF refuses
``assign_add`` on such a variable (there is no one component to add to), so an eager update
adds the whole amount to replica 0's component with ``extended.update``: every component
stays a partial sum and the aggregate stays exact.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from jaxmirror.core import _compat, context
from jaxmirror.variables import state
from jaxmirror.variables.distributed import SyncOnReadVariable


def _on_replica_zero(deltas, value_context):
    if value_context.replica_id_in_sync_group == 0:
        return list(deltas)
    return [jnp.zeros_like(d) for d in deltas]


def _add_each(first, variables, deltas):
    del first  # also in `variables`; `update` needs one variable to go by
    for v, d in zip(variables, deltas):
        v.assign_add(d)


def add_to(api: str, variables, deltas) -> None:
    """Add ``deltas[i]`` to ``variables[i]``: in a step to this replica's component, else eagerly.

    Args:
        api: the API name errors start with.
        variables: the metric's variables (all of one strategy).
        deltas: arrays of the variables' shapes, computed in the current context.

    Returns:
        None.

    Raises:
        RuntimeError: inside a ``merge_fn``, or on traced values outside ``run``.
    """
    entry = context.current()
    if entry.in_run:
        if entry.replica_context is None:
            raise RuntimeError(
                f"{api}: called in cross-replica context inside `run` (in a merge_fn); call it "
                f"in the step function itself, where each replica adds its own examples."
            )
        for v, d in zip(variables, deltas):
            v.assign_add(d)
        return
    if any(map(_compat.is_tracer, deltas)):
        raise RuntimeError(
            f"{api}: called on traced values outside `strategy.run` (inside your own jax.jit, "
            f"jax.grad or lax loop?), where the metric's update would be lost; call it in the "
            f"step `run` runs, or eagerly on arrays."
        )
    first = variables[0]
    strategy = first.distribute_strategy
    if isinstance(first, SyncOnReadVariable):
        deltas = strategy.experimental_distribute_values_from_function(
            functools.partial(_on_replica_zero, deltas))
    # One `update` for all the variables: one atomic read-modify-write, as a step's is.
    strategy.extended.update(first, _add_each, args=(list(variables), list(deltas)))


def read_totals(variables) -> list:
    """The variables' values summed over the replicas, in any context.

    Outside ``run`` (and in a ``merge_fn``) a sync-on-read variable's read is already the sum
    of its components; in a step's replica context it is this replica's component, so it is
    all-reduced, giving every replica the running totals with this step's updates.

    Args:
        variables: the metric's variables.

    Returns:
        One array per variable.
    """
    entry = context.current()
    values = [v.read_value() for v in variables]
    ctx = entry.replica_context
    if entry.in_run and ctx is not None:
        values = [ctx.all_reduce("sum", x) if isinstance(v, SyncOnReadVariable) else x
                  for v, x in zip(variables, values)]
    return values


def zero(variables) -> None:
    """Assign zeros to every component of each variable, in any context.

    Args:
        variables: the metric's variables.

    Returns:
        None.
    """
    if context.current().in_run:
        for v in variables:
            v.assign(jnp.zeros(v.shape, v.dtype))
        return
    # Hold the variables' lock so that no step runs between two of the assignments.
    with state.lock:
        for v in variables:
            v.assign(jnp.zeros(v.shape, v.dtype))
