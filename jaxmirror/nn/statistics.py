"""Batch statistics over the real rows of every replica, shared by the NNX and Linen layers.

flax's ``BatchNorm(axis_name=...)`` averages each replica's mean (``pmean``): with padded
batches it counts the padding, and with ``mask=`` it weighs every replica alike however many
rows it masked in. Here each replica sums its weighted rows and counts them, and one all-reduce
of the sums gives the statistics of the whole global batch's real rows, which is what one
device computes on the unpadded batch.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from jaxmirror.core import _compat
from jaxmirror.core.context import get_replica_context
from jaxmirror.core.reduce_op import ReduceOp
from jaxmirror.step.replica_context import row_mask


def canonical_axes(rank: int, axes) -> tuple:
    """``axes`` as sorted, deduplicated non-negative ints for an array of rank ``rank``.

    Args:
        rank: the array's rank.
        axes: an int or an iterable of ints, negative ones counting from the end.

    Returns:
        A tuple of ints.

    Example:
        >>> from jaxmirror.nn.statistics import canonical_axes
        >>> canonical_axes(4, (-1, 1, 3))
        (1, 3)
    """
    if isinstance(axes, int):
        axes = (axes,)
    return tuple(sorted({a % rank for a in axes}))


def _abs_sq(x):
    if jnp.iscomplexobj(x):
        return lax.square(lax.real(x)) + lax.square(lax.imag(x))
    return lax.square(x)


def _weights(x, axes, mask):
    """The bool mask of the entries that count: the real rows of a padded batch and ``mask``."""
    ctx = get_replica_context()
    # Axis 0 holds the batch's rows only when it is reduced (not a feature axis).
    rows = row_mask(ctx, x.shape[0]) if ctx is not None and 0 in axes else None
    if rows is not None:
        rows = rows.reshape(rows.shape + (1,) * (x.ndim - 1))
        mask = rows if mask is None else jnp.logical_and(rows, jnp.asarray(mask, bool))
    return None if mask is None else jnp.broadcast_to(jnp.asarray(mask, bool), x.shape)


def _sum_over_replicas(axis_name, axis_index_groups):
    if axis_name is not None:
        return lambda v: lax.psum(v, axis_name, axis_index_groups=axis_index_groups)
    ctx = get_replica_context()
    if ctx is None:  # cross-replica context (a strategy's scope): there is one batch, this one
        return lambda v: v
    # The default replica context returns `v` unchanged; a `run` step sums over its replicas.
    return lambda v: ctx.all_reduce(ReduceOp.SUM, v)


def batch_statistics(x, reduction_axes, *, dtype=None, mask=None, use_fast_variance=True,
                     force_float32_reductions=True, axis_name=None, axis_index_groups=None,
                     synchronize=True) -> tuple:
    """The mean and variance of ``x``'s real entries over the reduction axes and all replicas.

    Inside ``strategy.run`` an entry counts when its row of the padded batch is real
    (``row_mask`` on ``x``'s axis 0) and ``mask`` is True there; the sums and counts of every
    replica are added, so the result is what one device computes on the unpadded global
    batch. Elsewhere it is flax's ``BatchNorm`` statistics of ``x`` (with ``mask``).

    Args:
        x: the input; axis 0 is the batch.
        reduction_axes: the axes to reduce (an int or a tuple of ints).
        dtype: the minimal dtype to compute in (default: ``x``'s).
        mask: ``None``, or a binary array broadcastable to ``x``: the entries that count.
        use_fast_variance: ``var = E[|x|^2] - |E[x]|^2`` in one all-reduce (flax's default);
            False for ``E[|x - E[x]|^2]`` in two.
        force_float32_reductions: compute in at least float32 (as flax).
        axis_name: reduce over this named axis instead of the replica context's axis (for
            ``jax.shard_map`` or ``pmap`` of your own).
        axis_index_groups: groups within ``axis_name``, as for ``jax.lax.psum``.
        synchronize: False computes this replica's statistics alone (Linen's initialization).

    Returns:
        ``(mean, var)``, with the shape of ``x`` without the reduction axes.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxmirror.nn.statistics import batch_statistics
        >>> x = jnp.array([[1.0], [3.0], [100.0]])
        >>> mean, var = batch_statistics(x, 0, mask=jnp.array([[True], [True], [False]]))
        >>> float(mean[0]), float(var[0])
        (2.0, 1.0)
    """
    if dtype is None:
        dtype = jnp.result_type(x)
    if force_float32_reductions:
        # At least float32 (half precision sums lose the statistics); double/complex are kept.
        dtype = jnp.promote_types(dtype, jnp.float32)
    elif not jnp.issubdtype(dtype, jnp.inexact):
        dtype = jnp.promote_types(dtype, float)
    x = jnp.asarray(x, dtype)
    axes = canonical_axes(x.ndim, reduction_axes)
    weights = _weights(x, axes, mask)
    total = _sum_over_replicas(axis_name, axis_index_groups) if synchronize else (lambda v: v)

    def masked_sum(v):
        return jnp.sum(v if weights is None else jnp.where(weights, v, 0), axes)

    count_dtype = jnp.finfo(dtype).dtype  # float32 for complex64: a count is real
    if weights is None:
        reduced = [n for a, n in enumerate(x.shape) if a not in axes]
        count = jnp.full(reduced, math.prod(x.shape[a] for a in axes), count_dtype)
    else:
        count = jnp.sum(weights, axes).astype(count_dtype)
    if use_fast_variance:
        # One all-reduce carries all three sums (as flax stacks its means).
        sums = total(jnp.stack([masked_sum(x), masked_sum(_abs_sq(x)).astype(x.dtype),
                                count.astype(x.dtype)]))
        n = jnp.real(sums[2])
        mean = sums[0] / n
        var = jnp.maximum(0.0, jnp.real(sums[1]) / n - _abs_sq(mean))
    else:
        sums = total(jnp.stack([masked_sum(x), count.astype(x.dtype)]))
        n = jnp.real(sums[1])
        mean = sums[0] / n
        var = total(masked_sum(_abs_sq(x - jnp.expand_dims(mean, axes)))) / n
    return mean, var


def normalize(x, mean, var, scale, bias, reduction_axes, feature_axes, dtype, epsilon):
    """``(x - mean) / sqrt(var + epsilon) * scale + bias``, as flax's BatchNorm computes it.

    Args:
        x: the input.
        mean, var: the statistics, shaped as ``x`` without ``reduction_axes``.
        scale, bias: ``None`` or arrays of the feature axes' shape.
        reduction_axes: the reduced axes of ``x``.
        feature_axes: the feature axes of ``x``.
        dtype: the result's dtype, or ``None`` to infer it from ``x``, ``scale`` and ``bias``.
        epsilon: added to ``var``.

    Returns:
        The normalized array, of ``x``'s shape.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxmirror.nn.statistics import normalize
        >>> x = jnp.array([[1.0], [3.0]])
        >>> normalize(x, jnp.array([2.0]), jnp.array([1.0]), None, jnp.array([0.5]), (0,), (1,),
        ...           None, 0.0).tolist()
        [[-0.5], [1.5]]
    """
    reduction_axes = canonical_axes(x.ndim, reduction_axes)
    feature_axes = canonical_axes(x.ndim, feature_axes)
    feature_shape = [1] * x.ndim
    for axis in feature_axes:
        feature_shape[axis] = x.shape[axis]
    y = x - jnp.expand_dims(mean, reduction_axes)
    mul = lax.rsqrt(jnp.expand_dims(var, reduction_axes) + epsilon)
    args = [x]
    if scale is not None:
        mul *= scale.reshape(feature_shape)
        args.append(scale)
    y *= mul
    if bias is not None:
        y += bias.reshape(feature_shape)
        args.append(bias)
    return jnp.asarray(y, _compat.layer_dtype(*args, dtype=dtype))


def moving_average(average, statistic, momentum):
    """flax's running-average update, ``momentum * average + (1 - momentum) * statistic``.

    The statistic is a constant to the gradient: running averages are bookkeeping, not a path
    the loss is differentiated through.

    Args:
        average: the stored running average.
        statistic: this batch's statistic.
        momentum: the decay rate.

    Returns:
        The new running average.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxmirror.nn.statistics import moving_average
        >>> float(moving_average(jnp.float32(0.0), jnp.float32(1.0), 0.75))
        0.25
    """
    return lax.stop_gradient(momentum * average + (1 - momentum) * statistic)
