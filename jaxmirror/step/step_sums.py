"""A step's small per-replica results summed over the replicas in the step's own program.

TF's loop reduces the step's loss right after the step (``strategy.reduce("SUM", loss,
axis=None)``); as a program of its own that costs a dispatch and a collective per step. So the
step's program also sums its small floating per-replica results (``reductions_in_step``: one
all-reduce per dtype, with the strategy's cross-device ops), the sums ride on the returned
``PerReplica`` values (``core.values.attach_sum``), and ``reduce`` answers from them
(``attached_reduction``) with the numbers its own program would give. Here too are the rules
both share: what each replica adds into a sum (``summand``) and how a reduction comes from the
sum (``reduced_from_sum``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmirror.core import _compat
from jaxmirror.core.reduce_op import ReduceOp, as_float
from jaxmirror.core.values import PerReplica, attach_sum, attached_sum
from jaxmirror.step.trace import getters

# The largest per-replica result (elements) a step sums in its own program, in case `reduce`
# asks: a loss, metrics, a few counts. Larger ones are not worth the collective every step.
REDUCED_IN_STEP_MAX_SIZE = 1024


def summand(op: ReduceOp, x, count: int, divide_first: bool):
    """What a replica puts into the cross-replica sum of ``op`` for its component ``x``.

    Args:
        op: SUM or MEAN.
        x: the component (or the replica-stacked components).
        count: what a MEAN divides by.
        divide_first: a MEAN over a narrow wire divides before it sums.

    Returns:
        The summand: small integers widened as ``jnp.sum`` widens them; floats for a MEAN.

    Example:
        >>> import jax.numpy as jnp
        >>> summand(ReduceOp.SUM, jnp.int8(3), 2, False).dtype
        dtype('int32')
    """
    if op is ReduceOp.MEAN:
        return as_float(x) / count if divide_first else as_float(x)
    return x.astype(_sum_dtype(x.dtype))  # the ops count booleans themselves


def reduced_from_sum(op: ReduceOp, total, count: int, divide_first: bool):
    """The reduction ``op`` from the cross-replica sum of its summands.

    Args:
        op: SUM or MEAN.
        total: the sum.
        count: what a MEAN divides by.
        divide_first: the summands were divided already.

    Returns:
        The reduced value.

    Example:
        >>> import jax.numpy as jnp
        >>> float(reduced_from_sum(ReduceOp.MEAN, jnp.float32(6.0), 3, False))
        2.0
    """
    return total if op is ReduceOp.SUM or divide_first else total / count


def _sum_dtype(dtype):
    """The dtype ``jnp.sum`` gives for an integer or float ``dtype``: small integers widen."""
    if jnp.issubdtype(dtype, jnp.integer) and jnp.dtype(dtype).itemsize < 4:
        return jnp.dtype(jnp.uint32 if jnp.issubdtype(dtype, jnp.unsignedinteger)
                         else jnp.int32)
    return jnp.dtype(dtype)


def reducible_in_step(aval) -> bool:
    """Whether a step sums a per-replica result of this shape and dtype in its program.

    Not under ``jax_debug_nans``/``jax_debug_infs``: a sum nobody asked for may overflow (or
    meet +inf and -inf) and fail a step whose own results are fine.

    Args:
        aval: the result's per-replica shape and dtype.

    Returns:
        A bool.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> reducible_in_step(jax.ShapeDtypeStruct((), jnp.float32))
        True
    """
    return (aval.size <= REDUCED_IN_STEP_MAX_SIZE and jnp.issubdtype(aval.dtype, jnp.floating)
            and not (jax.config.jax_debug_nans or jax.config.jax_debug_infs))


def reductions_in_step(strategy, components: list) -> list:
    """``strategy.reduce("SUM", ..., axis=None)`` of per-replica results, inside the step's SPMD
    program, by ``reduce``'s rules and the strategy's cross-device ops and options.

    The results of one dtype are summed as one buffer (one collective, not one per metric);
    the sums come back one per result. A MEAN divides them later, as ``reduce`` does.

    Args:
        strategy: the strategy (more than one replica) whose step is being traced.
        components: each result's component on the tracing replica (see
            ``reducible_in_step``).

    Returns:
        One sum per component, replicated.
    """
    extended = strategy.extended
    ops, options = extended.cross_device_ops, extended.options_for(None, "reduce")
    parts = [summand(ReduceOp.SUM, x, 0, False) for x in components]
    by_dtype = {}
    for i, x in enumerate(parts):
        by_dtype.setdefault(x.dtype, []).append(i)
    sums = [None] * len(parts)
    for indices in by_dtype.values():
        flat = jnp.concatenate([parts[i].reshape(-1) for i in indices])
        (total,) = ops.all_reduce_in_program(ReduceOp.SUM, [flat], extended.axis_name,
                                             extended.devices, options)
        start = 0
        for i in indices:
            size = parts[i].size
            sums[i] = total[start:start + size].reshape(parts[i].shape)
            start += size
    return sums


def sum_paths(out_tree, n_results: int, summed) -> tuple:
    """Where the summed results sit in a step's output: getters for each (see ``attach_sums``).

    Args:
        out_tree: the structure of the step's results.
        n_results: how many results (leaves) it has.
        summed: the indices of the summed ones.

    Returns:
        One tuple of getters per summed result.
    """
    paths = jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(out_tree, range(n_results)))
    return tuple(getters(paths[0][i][0]) for i in summed)


def attach_sums(out, sums, paths: tuple, owner) -> None:
    """Each sum onto its result in ``out``, found by ``paths`` (the last trace's): all checked
    first, since another signature's paths could lead elsewhere (then none is attached, and
    ``reduce`` reduces the components).

    Args:
        out: what the step returned.
        sums: the sums its program computed, in the order of ``paths``.
        paths: from ``sum_paths``.
        owner: a weak reference to the strategy's extended.
    """
    if len(paths) != len(sums):
        return
    found = []
    for path, total in zip(paths, sums):
        value = out
        try:
            for get in path:
                value = get(value)
        except Exception:  # noqa: BLE001 - another signature's structure
            return
        if (type(value) is not PerReplica or value.row_counts is not None
                or value.stacked.shape[1:] != total.shape or value.stacked.dtype != total.dtype):
            return
        found.append(value)
    for value, total in zip(found, sums):
        attach_sum(value, owner, total)


def attached_reduction(strategy, x, op: ReduceOp):
    """``reduce(op, x, axis=None)`` from the sum ``x``'s step computed with it, or ``None``.

    A MEAN divides that sum here, as ``reduce`` divides its own (the same bits: XLA's
    division by a constant inside the step could differ by an ulp); unless the strategy's wire
    carries means, which are divided before they are summed.

    Args:
        strategy: the strategy reducing.
        x: a value (only a ``PerReplica`` a step of ``strategy`` returned has a sum).
        op: SUM or MEAN.

    Returns:
        The reduced array, or ``None`` (then reduce the components).
    """
    total = attached_sum(x, strategy.extended)
    # Traced (the step ran inside jax.grad or a jit of the user's): reduce as before; given
    # away (donated): reduce the components.
    if total is None or _compat.is_tracer(total) or total.is_deleted():
        return None
    if op is ReduceOp.SUM:
        return total
    if strategy.extended.options_for(None, "reduce").wire_dtype is not None:
        return None
    return reduced_from_sum(op, total, strategy.num_replicas_in_sync, False)


__all__ = ["REDUCED_IN_STEP_MAX_SIZE", "attach_sums", "attached_reduction", "reduced_from_sum",
           "reducible_in_step", "reductions_in_step", "sum_paths", "summand"]
