"""Which results of a step hold the rows of a padded batch (so they show only the real ones).

A batch from a distributed dataset is padded to a static number of rows per replica. A result
computed row by row from it (``x * 2``, a model's predictions, per-example losses) has padded
rows too, and must carry the batch's row counts out of ``run`` so that local results, ``reduce``
along axis 0 and ``gather`` see TF's unpadded values. Shapes cannot tell (a weight gradient may
have as many rows as the batch); the data flow can. This walks the per-replica jaxpr and tracks,
for every value, which padded batch's rows lie along which of its axes, by the rules below:
elementwise ops keep them, ``dot_general``/``transpose``/``broadcast_in_dim``/
``reshape``/reductions move them, contracting or reducing over them (or a collective) ends them.
A primitive without a rule ends them: a result then shows its padded rows rather than hiding
real data. Loops end them too (a scan body sees one row at a time).
"""

from __future__ import annotations

import math

from jax import lax

from jaxmirror.core import _compat
from jaxmirror.step.analysis.jaxpr_walk import Analysis

# (batch index, axis): the value's ``axis`` holds that padded batch's rows, in order.
Tag = tuple

ELEMENTWISE = (
    lax.abs_p, lax.acos_p, lax.acosh_p, lax.add_p, lax.and_p, lax.asin_p, lax.asinh_p,
    lax.atan_p, lax.atan2_p, lax.atanh_p, lax.bitcast_convert_type_p, lax.cbrt_p, lax.ceil_p,
    lax.clamp_p, lax.conj_p,
    lax.convert_element_type_p, lax.copy_p, lax.cos_p, lax.cosh_p, lax.div_p, lax.eq_p,
    lax.erf_p, lax.erf_inv_p, lax.erfc_p, lax.exp_p, lax.exp2_p, lax.expm1_p, lax.floor_p,
    lax.ge_p, lax.gt_p, lax.imag_p, lax.integer_pow_p, lax.is_finite_p, lax.le_p, lax.lgamma_p,
    lax.digamma_p, lax.log_p, lax.log1p_p, lax.logistic_p, lax.lt_p, lax.max_p, lax.min_p,
    lax.mul_p, lax.ne_p, lax.neg_p, lax.nextafter_p, lax.not_p, lax.or_p, lax.pow_p, lax.real_p,
    lax.reduce_precision_p, lax.rem_p, lax.round_p, lax.rsqrt_p, lax.select_n_p, lax.sign_p,
    lax.sin_p, lax.sinh_p, lax.sqrt_p, lax.square_p, lax.stop_gradient_p, lax.sub_p, lax.tan_p,
    lax.tanh_p, lax.xor_p,
)
REDUCTIONS = (lax.reduce_sum_p, lax.reduce_max_p, lax.reduce_min_p, lax.reduce_prod_p,
              lax.reduce_and_p, lax.reduce_or_p, lax.reduce_xor_p, lax.argmax_p, lax.argmin_p)
CUMULATIVE = (lax.cumsum_p, lax.cumprod_p, lax.cummax_p, lax.cummin_p, lax.cumlogsumexp_p)
SCATTERS = (lax.scatter_p, lax.scatter_add_p, lax.scatter_mul_p, lax.scatter_min_p,
            lax.scatter_max_p)


def _none(eqn, tags):
    return [None] * len(eqn.outvars)


ANALYSIS = Analysis(constant=None, unknown=_none)


def _shape(v):
    return tuple(v.aval.shape)


@ANALYSIS.register(*ELEMENTWISE)
def _elementwise(eqn, tags):
    # Operands of equal rank broadcast size-1 axes into the output (``i[:, None] == arange``):
    # rows survive when the row axis itself is not broadcast.
    out = _shape(eqn.outvars[0])
    for v, t in zip(eqn.invars, tags):
        shape = _shape(v)
        if t is not None and len(shape) == len(out) and shape[t[1]] == out[t[1]]:
            return [t] * len(eqn.outvars)
    return [None] * len(eqn.outvars)


def _moved(t, axis):
    return None if axis is None else (t[0], axis)


@ANALYSIS.register(lax.broadcast_in_dim_p)
def _broadcast_in_dim(eqn, tags):
    t = tags[0]
    if t is None:
        return [None]
    b = _compat.broadcast_dimensions(eqn)[t[1]]
    same = _shape(eqn.invars[0])[t[1]] == _shape(eqn.outvars[0])[b]
    return [_moved(t, b if same else None)]


@ANALYSIS.register(lax.reshape_p)
def _reshape(eqn, tags):
    t = tags[0]
    if t is None:
        return [None]
    old, new = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    before = math.prod(old[:t[1]])
    for b in range(len(new)):
        if math.prod(new[:b]) == before and new[b] == old[t[1]]:
            return [_moved(t, b)]
    return [None]


@ANALYSIS.register(lax.transpose_p)
def _transpose(eqn, tags):
    t = tags[0]
    if t is None:
        return [None]
    return [_moved(t, _compat.transpose_permutation(eqn).index(t[1]))]


@ANALYSIS.register(lax.squeeze_p)
def _squeeze(eqn, tags):
    t = tags[0]
    dims = _compat.op_axes(eqn)
    if t is None or t[1] in dims:
        return [None]
    return [_moved(t, t[1] - sum(d < t[1] for d in dims))]


@ANALYSIS.register(*REDUCTIONS)
def _reduction(eqn, tags):
    t = tags[0]
    axes = _compat.op_axes(eqn)
    if t is None or t[1] in axes:
        return [None] * len(eqn.outvars)
    return [_moved(t, t[1] - sum(a < t[1] for a in axes))] * len(eqn.outvars)


@ANALYSIS.register(*CUMULATIVE)
def _cumulative(eqn, tags):
    t = tags[0]
    # Along the rows, real row i depends only on rows <= i, all real (padding comes last).
    if t is not None and t[1] in _compat.op_axes(eqn) and _compat.cumulative_reverse(eqn):
        return [None]
    return [t]


@ANALYSIS.register(lax.dot_general_p)
def _dot_general(eqn, tags):
    (lc, rc), (lb, rb) = _compat.dot_dimensions(eqn)
    lhs_rank, rhs_rank = len(_shape(eqn.invars[0])), len(_shape(eqn.invars[1]))
    lhs_free = [d for d in range(lhs_rank) if d not in lc and d not in lb]
    rhs_free = [d for d in range(rhs_rank) if d not in rc and d not in rb]
    for t, contract, batch, free, offset in ((tags[0], lc, lb, lhs_free, len(lb)),
                                              (tags[1], rc, rb, rhs_free,
                                               len(lb) + len(lhs_free))):
        if t is None or t[1] in contract:
            continue
        if t[1] in batch:
            return [_moved(t, list(batch).index(t[1]))]
        return [_moved(t, offset + free.index(t[1]))]
    return [None]


def _whole_axis(eqn, tags, axis_kept):
    t = tags[0]
    return [t if t is not None and axis_kept(t[1]) else None]


@ANALYSIS.register(lax.slice_p)
def _slice(eqn, tags):
    (start, limit, strides), shape = _compat.slice_bounds(eqn), _shape(eqn.invars[0])
    return _whole_axis(eqn, tags, lambda a: start[a] == 0 and limit[a] == shape[a]
                       and (strides is None or strides[a] == 1))


@ANALYSIS.register(lax.dynamic_slice_p)
def _dynamic_slice(eqn, tags):
    shape = _shape(eqn.invars[0])
    return _whole_axis(eqn, tags, lambda a: _compat.slice_sizes(eqn)[a] == shape[a])


@ANALYSIS.register(lax.pad_p)
def _pad(eqn, tags):
    return _whole_axis(eqn, tags, lambda a: _compat.padding_config(eqn)[a] == (0, 0, 0))


@ANALYSIS.register(lax.concatenate_p)
def _concatenate(eqn, tags):
    (dim,) = _compat.op_axes(eqn)
    for t in tags:
        if t is not None:
            return [t if t[1] != dim else None]
    return [None]


@ANALYSIS.register(lax.gather_p)
def _gather(eqn, tags):
    """Row-wise indexing (``take_along_axis``, an embedding lookup by per-row ids) keeps rows."""
    dn = _compat.gather_dimensions(eqn)
    out_rank = len(_shape(eqn.outvars[0]))
    batch_out = [d for d in range(out_rank) if d not in dn.offset_dims]
    index_rank = len(_shape(eqn.invars[1]))
    index_dims = list(range(index_rank - 1))  # the last axis holds the index vectors
    operand, indices = tags
    if indices is not None and indices[1] in index_dims:
        return [_moved(indices, batch_out[index_dims.index(indices[1])])]
    if operand is not None and operand[1] in dn.operand_batching_dims:
        j = dn.start_indices_batching_dims[list(dn.operand_batching_dims).index(operand[1])]
        return [_moved(operand, batch_out[index_dims.index(j)])]
    if operand is not None:  # x[:, idx]: every row, some columns
        return [_gather_offset(eqn, operand)]
    return [None]


def _first_tag(tags):
    return next((t for t in tags if t is not None), None)


@ANALYSIS.register(lax.stack_p)
def _stack(eqn, tags):
    t, (axis,) = _first_tag(tags), _compat.op_axes(eqn)
    return [None if t is None else _moved(t, t[1] + (t[1] >= axis))]


def _along(eqn, tags):
    """Ops working along one axis (or several): rows survive unless it is the row axis."""
    t = _first_tag(tags)
    return [None if t is None or t[1] in _compat.op_axes(eqn) else t] * len(eqn.outvars)


def _gather_offset(eqn, operand):
    """A row axis the gather keeps whole (a slice of every row): its place among offset_dims."""
    dn = _compat.gather_dimensions(eqn)
    a = operand[1]
    full = _compat.slice_sizes(eqn)[a] == _shape(eqn.invars[0])[a]
    if not full or a in dn.collapsed_slice_dims or a in dn.operand_batching_dims:
        return None
    kept = [d for d in range(len(_shape(eqn.invars[0])))
            if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    return _moved(operand, dn.offset_dims[kept.index(a)])


@ANALYSIS.register(*SCATTERS)
def _scatter(eqn, tags):
    t = tags[0]
    dn = _compat.scatter_dimensions(eqn)
    if t is None or t[1] in dn.scatter_dims_to_operand_dims:
        return [None]
    return [t]  # rows of the operand written elsewhere along other axes: still its rows


@ANALYSIS.register(lax.cond_p)
def _cond(eqn, tags):
    per_branch = [analyse(b, tags[1:]) for b in _compat.cond_branches(eqn)]
    return [col[0] if all(c == col[0] for c in col) else None for col in zip(*per_branch)]


ANALYSIS.register(lax.split_p, lax.sort_p, lax.top_k_p, lax.rev_p)(_along)
# Loops are not calls: a scan body sees one row at a time, a while body the carry.
ANALYSIS.register(lax.scan_p, lax.while_p)(_none)


def analyse(jaxpr, in_tags: list) -> list:
    """For each output of ``jaxpr``, which padded batch's rows lie along which of its axes.

    Args:
        jaxpr: an open per-replica jaxpr.
        in_tags: per invar, ``None`` or ``(batch index, axis)``.

    Returns:
        One ``None`` or ``(batch index, axis)`` per outvar.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> jaxpr = jax.make_jaxpr(lambda x, w: (x @ w, (x @ w).sum()))(
        ...     jnp.zeros((4, 3)), jnp.zeros((3, 2))).jaxpr
        >>> analyse(jaxpr, [(0, 0), None])
        [(0, 0), None]
    """
    return ANALYSIS.analyse(jaxpr, in_tags)


def row_sources(traced, padded: tuple) -> list:
    """Per output of a traced step, the padded batch (an index into ``padded``) it holds rows of.

    Args:
        traced: the step's closed jaxpr: one ``shard_map`` fed by constants and the flat inputs.
        padded: the flat input positions of the padded batches.

    Returns:
        One ``None`` or batch index per output of the ``shard_map`` body.
    """
    outer = _compat.open_jaxpr(traced)
    (eqn,) = outer.eqns
    inner = _compat.shard_map_body(eqn)
    if not padded:
        return [None] * len(inner.outvars)
    batch_of = {outer.invars[pos]: k for k, pos in enumerate(padded)}
    tags = [None if isinstance(v, _compat.Literal) or v not in batch_of else (batch_of[v], 0)
            for v in eqn.invars]
    return [None if t is None or t[1] != 0 else t[0] for t in analyse(inner, tags)]
