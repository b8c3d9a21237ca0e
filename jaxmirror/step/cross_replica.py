"""Cross-replica results: local results, ``reduce``, ``gather``, and the sums a step makes.

Each rule works on the global, replica-stacked form of a value with ``jnp``, so the same code
serves the host (after ``run``) and a ``merge_fn`` traced inside the program. A leaf is
``PerReplica`` (components stacked along axis 0), mirrored (a ``Mirrored`` wrapper, or an array
replicated over exactly the strategy's devices), or plain (not distributed: TF's rules for those
apply). A distributed variable counts as the value it holds (``distributed_view``). Inside a
``merge_fn`` a per-replica value is a ``GatheredPerReplica``: reducing it is one all-reduce.

In-step sums: TF's loop reduces the loss right after the step (``strategy.reduce("SUM", loss,
axis=None)``), which as a program of its own costs a dispatch and a collective per step. So the
step's program also sums its small floating per-replica results (``reductions_in_step``: one
all-reduce per dtype), the sums ride on the returned ``PerReplica`` values
(``core.values.attach_sum``), and ``reduce`` answers from them (``attached_reduction``) with the
same numbers. ``summand`` and ``reduced_from_sum`` are the rules both share.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np

from jaxmirror.core import _compat, context
from jaxmirror.core.bits import as_bits, from_bits
from jaxmirror.core.reduce_op import ReduceOp, as_float, as_reduce_op
from jaxmirror.core.stateful import Stateful
from jaxmirror.core.values import (GatheredPerReplica, Mirrored, PerReplica, attach_sum,
                                   attached_sum, host_counts, is_distributed)
from jaxmirror.runtime import ledger


def views(value):
    """``value`` with every variable replaced by the distributed value it holds."""
    return jax.tree.map(lambda x: x.distributed_view() if isinstance(x, Stateful) else x, value,
                        is_leaf=is_distributed)

PER_REPLICA, MIRRORED, PLAIN = "per_replica", "mirrored", "plain"


def kind(strategy, x, method: str = "reduce") -> str:
    if isinstance(x, PerReplica):
        n = strategy.num_replicas_in_sync
        if (not isinstance(x, GatheredPerReplica) and x.stacked is not None
                and jnp.ndim(x.stacked) and jnp.shape(x.stacked)[0] != n):
            raise ValueError(
                f"{method}: got a PerReplica with {jnp.shape(x.stacked)[0]} components, but "
                f"this strategy has {n} replicas; a value from another strategy: reduce, "
                f"gather or read it with the strategy that made it.")
        return PER_REPLICA
    if isinstance(x, Mirrored):
        return MIRRORED
    if (isinstance(x, jax.Array) and not _compat.is_tracer(x)
            and x.sharding == strategy.extended.placement.replica_sharding):
        raise _storage_error(x, method)
    placement = strategy.extended.placement
    if (isinstance(x, jax.Array) and not _compat.is_tracer(x) and strategy.num_replicas_in_sync > 1
            and ((x.sharding.is_fully_replicated and x.sharding.device_set == placement.device_set)
                 or (placement.central and x.committed
                     and x.sharding == placement.storage_sharding))):
        # Central storage: the copy placed on the parameter device stands for every replica's
        # (an array merely created there, uncommitted, is a plain value).
        return MIRRORED
    return PLAIN


def _storage_error(x, method: str) -> TypeError:
    # jax.tree.map(f, tree) hands f the arrays inside a PerReplica (it is a pytree); answering
    # as for a plain array would return the components unreduced, silently.
    return TypeError(
        f"{method}: got a plain jax.Array of shape {tuple(x.shape)} laid out one row per "
        f"replica: the storage of a PerReplica (`.stacked`), not a PerReplica; this happens "
        f"when jax.tree.map unwraps PerReplica values, which are pytrees. {method} takes "
        f"nests: call it on the whole tree, or map with "
        f"is_leaf=lambda x: isinstance(x, jaxmirror.PerReplica); to treat the array's rows as "
        f"the replicas' components, wrap it: jaxmirror.PerReplica(x)."
    )


def _mirrored_value(x):
    return x.value if isinstance(x, Mirrored) else x


def require_cross_replica(strategy, method: str) -> None:
    entry = context.current()
    if entry.replica_context is not None and entry.strategy is not context.default_strategy():
        other = "all_reduce" if method in ("reduce", "reduce_to", "batch_reduce_to") else "all_gather"
        raise RuntimeError(
            f"{method}: called in a replica context (inside `run`), but it is a cross-replica "
            f"method; use get_replica_context().{other}() to combine values across replicas "
            f"inside the step, or, as TF says, \"Method requires being in cross-replica "
            f"context, use get_replica_context().merge_call()\"."
        )


def _norm_axis(axis, rank: int, method: str) -> int:
    if not isinstance(axis, int) or isinstance(axis, bool) or not -rank <= axis < rank:
        raise ValueError(
            f"{method}: `axis` must be an int in [{-rank}, {rank}) for values of rank {rank}; "
            f"got {axis!r}."
        )
    return axis % rank


def local_results(strategy, value) -> tuple:
    """``experimental_local_results``: a tuple of this process's per-replica values.

    A central-storage variable (``single_copy``) is no distributed value in TF: it is its own
    one local result, as a plain value is."""
    leaves, tree = jax.tree.flatten(value, is_leaf=is_distributed)
    single = [isinstance(x, Stateful) and getattr(x, "single_copy", False) for x in leaves]
    leaves = [x if one else views(x) for x, one in zip(leaves, single)]
    kinds = [PLAIN if one else kind(strategy, x, "experimental_local_results")
             for x, one in zip(leaves, single)]
    if all(k == PLAIN for k in kinds):
        return (jax.tree.unflatten(tree, leaves),)
    n = strategy.extended.placement.num_local_replicas
    columns = []
    for x, k in zip(leaves, kinds):
        if k == PER_REPLICA:
            columns.append(x.values)
        elif k == MIRRORED:
            columns.append(Mirrored(_mirrored_value(x), n).values)
        else:
            columns.append((x,) * n)
    return tuple(jax.tree.unflatten(tree, list(row)) for row in zip(*columns))


def _partial(strategy, op: ReduceOp, x, axis):
    """How a leaf reduces: ``("sum", partial, count, inside)`` when its replicas' partials
    must be summed across replicas (then divided by ``count`` for MEAN), else ``("done",
    value)``. ``inside``: the partial is this replica's, inside a ``merge_fn``."""
    n = strategy.num_replicas_in_sync
    if isinstance(x, GatheredPerReplica):
        local = jnp.asarray(x.local)
        count = n
        if axis is not None:
            ax = _norm_axis(axis, local.ndim, "reduce")
            count = n * local.shape[ax]
            local = local.sum(ax)
        return ("sum", local, count, True)
    k = kind(strategy, x)
    if k == PER_REPLICA:
        stacked = _real_rows(x, axis, "reduce")
        if isinstance(stacked, _Uneven):  # axis 0: each replica sums its real rows
            masked = jnp.where(_row_mask(jnp.asarray(stacked.stacked), stacked.counts),
                               stacked.stacked, 0)
            return ("sum", masked.sum(axis=1), sum(stacked.counts), False)
        if axis is None:
            return ("sum", stacked, n, False)
        ax = _norm_axis(axis, stacked.ndim - 1, "reduce") + 1
        return ("sum", stacked.sum(axis=ax), n * stacked.shape[ax], False)
    if k == PLAIN and strategy.extended.placement.multi_process and not _compat.is_tracer(x) \
            and not context.current().in_run:
        return _across_workers(strategy, op, x, axis)
    if (k == PLAIN and axis is None and isinstance(x, (np.ndarray, np.generic))
            and np.all(x == 0)):  # TF's shortcut: NumPy zeros reduce to zeros, by any op
        return ("done", np.zeros(x.shape, x.dtype))
    v = jnp.asarray(_mirrored_value(x))
    if axis is not None:
        ax = _norm_axis(axis, v.ndim, "reduce")
        # A mirrored or plain value counts as N copies, one per replica.
        return ("done", n * v.sum(ax) if op is ReduceOp.SUM else v.mean(ax))
    if op is ReduceOp.MEAN:
        return ("done", v)
    if k == PLAIN:
        raise ValueError(  # TF's wording, on purpose
            f"A non-DistributedValues value {x!r} cannot be reduced with the given reduce op "
            f"{op}. Return it from `run`, or reduce it with ReduceOp.MEAN."
        )
    return ("done", n * v)


def _across_workers(strategy, op: ReduceOp, x, axis):
    """A plain (host) value of each worker, all-reduced across the workers as TF does: it
    stands for this worker's replicas, each holding it (one replica per worker in TF)."""
    placement = strategy.extended.placement
    v, n, k = np.asarray(x), placement.num_replicas, placement.num_local_replicas
    count = n
    if axis is not None:
        ax = _norm_axis(axis, v.ndim, "reduce")
        v, count = v.sum(ax), n * v.shape[ax]
    elif op is ReduceOp.SUM and k > 1:
        raise ValueError(  # TF's wording (as on one worker), on purpose, and what to do
            f"A non-DistributedValues value {x!r} cannot be reduced with the given reduce op "
            f"{op}: it stands for this worker's {k} replicas, identical copies whose sum TF "
            f"does not define. Reduce it with ReduceOp.MEAN, or pass each replica's part as a "
            f"PerReplica (strategy.experimental_distribute_values_from_function).")
    return ("sum", placement.place_stacked(np.broadcast_to(v, (n,) + v.shape)), count, False)


def reduce_leaves(strategy, op: ReduceOp, leaves: list, axis, options=None,
                  method: str = "reduce") -> list:
    """Every leaf reduced across the replicas, the cross-replica sums by the strategy's
    ``cross_device_ops``: one program for all leaves outside a step, one all-reduce (per pack)
    inside a ``merge_fn``.

    Args:
        strategy: the strategy (more than one replica).
        op: SUM or MEAN.
        leaves: distributed values, variables' views, arrays.
        axis: as ``Strategy.reduce``.
        options: ``CommunicationOptions`` for the sums, or ``None``.
        method: the caller (``"reduce"``, ``"reduce_to"``...), for the workers' agreement.

    Returns:
        The reduced leaves.
    """
    extended = strategy.extended
    plans = [_partial(strategy, op, x, axis) for x in leaves]
    out = [p[1] if p[0] == "done" else None for p in plans]
    # A narrower wire must carry the mean, not a sum that may not fit it: divide first.
    divide_first = op is ReduceOp.MEAN and options is not None and options.wire_dtype is not None
    # Integers of such a MEAN are summed as float32 on a wire of their own, never narrowed.
    exact = [divide_first and p[0] == "sum" and not _inexact(p[1]) for p in plans]
    for inside, whole in ((False, False), (True, False), (False, True), (True, True)):
        chosen = [i for i, p in enumerate(plans)
                  if p[0] == "sum" and p[3] is inside and exact[i] is whole]
        if not chosen:
            continue
        wire, first = (None, False) if whole else (options, divide_first)
        parts = [summand(op, plans[i][1], plans[i][2], first) for i in chosen]
        ops = extended.cross_device_ops
        if inside:
            sums = ops.all_reduce_in_program(ReduceOp.SUM, parts, extended.axis_name,
                                             extended.devices, wire)
        elif context.current().in_run:
            # A concrete PerReplica met inside a step (a merge_fn reducing one it closed
            # over): a constant there, summed as such, not by a program of its own.
            sums = [x.sum(0) for x in parts]
        else:
            if extended.placement.multi_process:  # a program that every worker must run
                ledger.agree(_API_NAMES.get(method, method),
                             f"{op.name} of {_shapes(parts, range(len(parts)))}")
            sums = ops.sum_components(parts, extended.placement, wire)
        for i, total in zip(chosen, sums):
            out[i] = reduced_from_sum(op, total, plans[i][2], first)
    return out


def _inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


class _Uneven:
    """A padded value whose components have different numbers of real rows."""

    def __init__(self, stacked, counts):
        self.stacked, self.counts = stacked, counts


def _real_rows(x: PerReplica, axis, method: str):
    """``x.stacked`` cut to its real rows; ``_Uneven`` when only a row-axis reduction can say.

    A padded batch's components all have the static number of rows; TF's would have their
    real counts. Equal counts: slice and every rule applies. Unequal counts: the components
    only combine along the row axis (TF fails on the shape mismatch otherwise; so do we).
    """
    counts = x.row_counts
    stacked = x.stacked
    if counts is None:
        return stacked
    counts = host_counts(counts)
    if len(set(counts)) == 1:
        return stacked[:, :counts[0]]
    if axis is None or _norm_axis(axis, stacked.ndim - 1, method) != 0:
        raise ValueError(
            f"{method}: the components of this value have different numbers of rows "
            f"{list(counts)} (an uneven or partial batch), so they can only be combined along "
            f"axis 0, the batch axis; got axis={axis!r}."
        )
    return _Uneven(stacked, counts)


def _row_mask(stacked, counts):
    rows = jnp.arange(stacked.shape[1])
    mask = rows[None, :] < jnp.asarray(counts)[:, None]
    return mask.reshape(mask.shape + (1,) * (stacked.ndim - 2))


def _real_row_concat(u: _Uneven):
    stacked = jnp.asarray(u.stacked)
    n, size = stacked.shape[:2]
    rows = [i * size + r for i in range(n) for r in range(u.counts[i])]
    return _take_bits(stacked.reshape((n * size,) + stacked.shape[2:]),
                      jnp.asarray(rows, jnp.int32))


def _take_bits(x, rows):
    """``x[rows]`` that moves bits and never computes on them.

    On a sharded ``x``, XLA partitions the gather as "each device gathers the rows it holds,
    zeros elsewhere, then an all-reduce (sum)": on CPU the sum flushes subnormal floats to
    zero, turns -0.0 into 0.0 and quiets signalling NaNs. So the rows move as bit patterns
    (``core.bits.as_bits``: unsigned integers, whose sums with zeros are exact).

    Args:
        x: an array (possibly sharded), the rows along axis 0.
        rows: an int array of row indices.

    Returns:
        ``x[rows]``, bit for bit.

    Example:
        >>> import numpy as np, jax.numpy as jnp
        >>> tiny = np.array([1e-45, -0.0], np.float32)
        >>> _take_bits(jnp.asarray(tiny), jnp.array([1, 0])).view(jnp.uint32).tolist()
        [2147483648, 1]
    """
    return from_bits(as_bits(x)[rows], x.dtype)


def reduce(strategy, reduce_op, value, axis, method: str = "reduce", options=None):
    """``Strategy.reduce`` (see there); ``method`` names the caller in errors, ``options``
    are the ``CommunicationOptions`` of the call."""
    op = as_reduce_op(reduce_op)
    require_cross_replica(strategy, method)
    extended = strategy.extended
    # A step's small results come with their sums (reductions_in_step), made with the strategy's own
    # options: no program of their own.
    attached = axis is None and options is None
    if attached and type(value) is PerReplica:
        found = attached_reduction(strategy, value, op)
        if found is not None:
            return found
    options = extended.options_for(options, method)
    value = views(value)
    if strategy.num_replicas_in_sync == 1:
        return reduce_single(strategy, op, value, axis)
    leaves, tree = jax.tree.flatten(value, is_leaf=is_distributed)
    out = [attached_reduction(strategy, x, op) if attached else None for x in leaves]
    todo = [i for i, x in enumerate(out) if x is None]
    for i, x in zip(todo, reduce_leaves(strategy, op, [leaves[i] for i in todo], axis, options,
                                        method) if todo else ()):
        out[i] = x
    return extended.placement.readable_everywhere(jax.tree.unflatten(tree, out))


# The public spelling of each method that reduces, for the workers' agreement.
_API_NAMES = {"reduce": "strategy.reduce", "reduce_to": "strategy.extended.reduce_to",
              "batch_reduce_to": "strategy.extended.batch_reduce_to"}


def _shapes(leaves, chosen) -> str:
    """The chosen leaves' shapes and dtypes, as workers compare them."""
    def one(x):
        x = x.stacked if isinstance(x, PerReplica) else getattr(x, "value", x)
        return f"{jnp.dtype(getattr(x, 'dtype', type(x))).name}{list(jnp.shape(x))}"
    return "[" + ", ".join(one(leaves[i]) for i in chosen) + "]"


def _single_component(strategy, x, method: str):
    if kind(strategy, x, method) == PER_REPLICA:
        return x.stacked[0]
    return _mirrored_value(x)


def reduce_single(strategy, op: ReduceOp, value, axis):
    """One replica: the value itself, reduced along ``axis`` if one is given."""

    def leaf(x):
        v = _single_component(strategy, x, "reduce")
        if axis is None:
            return v
        v = jnp.asarray(v)
        ax = _norm_axis(axis, v.ndim, "reduce")
        return v.sum(ax) if op is ReduceOp.SUM else v.mean(ax)

    return jax.tree.map(leaf, value, is_leaf=is_distributed)


def _gather_leaf(strategy, x, axis):
    n = strategy.num_replicas_in_sync
    if kind(strategy, x, "gather") == PER_REPLICA:
        stacked = _real_rows(x, axis, "gather")
        if isinstance(stacked, _Uneven):  # axis 0: the real rows of every component, in order
            return _real_row_concat(stacked)
    else:
        v = jnp.asarray(_mirrored_value(x))
        stacked = jnp.broadcast_to(v, (n,) + v.shape)
    rank = stacked.ndim - 1
    if rank < 1:
        raise ValueError(
            "gather: the components of `value` must have rank >= 1, but they are scalars; "
            "expand them with x[None] before gathering."
        )
    ax = _norm_axis(axis, rank, "gather")
    moved = jnp.moveaxis(stacked, 0, ax)  # (..., N, s[ax], ...)
    return moved.reshape(moved.shape[:ax] + (-1,) + moved.shape[ax + 2:])


def gather(strategy, value, axis):
    """``Strategy.gather``: each leaf's components concatenated along ``axis``."""
    require_cross_replica(strategy, "gather")
    value = views(value)
    if strategy.extended.placement.multi_process:
        leaves = jax.tree.leaves(value, is_leaf=is_distributed)
        ledger.agree("strategy.gather", f"axis {axis} of {_shapes(leaves, range(len(leaves)))}")
    if strategy.num_replicas_in_sync == 1:
        def leaf(x):
            v = jnp.asarray(_single_component(strategy, x, "gather"))
            if v.ndim < 1:
                raise ValueError("gather: `value` must have rank >= 1, but it is a scalar; "
                                 "expand it with x[None] before gathering.")
            _norm_axis(axis, v.ndim, "gather")
            return v
        return jax.tree.map(leaf, value, is_leaf=is_distributed)
    gathered = jax.tree.map(lambda x: _gather_leaf(strategy, x, axis), value,
                            is_leaf=is_distributed)
    return strategy.extended.placement.readable_everywhere(gathered)


# A step's small per-replica results summed in its own program, for `reduce`.

# The largest per-replica result (elements) a step sums in its own program, in case `reduce`
# asks: a loss, metrics, a few counts. Larger ones are not worth the collective every step.
REDUCED_IN_STEP_MAX_SIZE = 1024


def getters(path) -> tuple:
    """Key path -> getters; a key we cannot follow cheaply gives a path that always falls back."""
    found = []
    for key in path:
        if isinstance(key, jax.tree_util.SequenceKey):
            found.append(operator.itemgetter(key.idx))
        elif isinstance(key, jax.tree_util.DictKey):
            found.append(operator.itemgetter(key.key))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            found.append(operator.attrgetter(key.name))
        else:
            return (_no_path,)
    return tuple(found)


def _no_path(_):
    raise LookupError("no cheap path to an output array")



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


__all__ = ["REDUCED_IN_STEP_MAX_SIZE", "attach_sums", "attached_reduction", "gather", "getters",
           "kind", "local_results", "reduce", "reduce_single", "reduced_from_sum",
           "reducible_in_step", "reductions_in_step", "sum_paths", "summand"]
