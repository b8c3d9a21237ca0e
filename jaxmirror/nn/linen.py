"""``SyncBatchNorm`` for flax Linen: ``linen.BatchNorm`` with statistics over every replica's real rows."""

from __future__ import annotations

import jax.numpy as jnp
from flax import linen

from jaxmirror.nn.statistics import batch_statistics, canonical_axes, moving_average, normalize

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(linen.BatchNorm):
    """``flax.linen.BatchNorm`` whose batch statistics are those of the whole global batch.

    Inside ``strategy.run`` the mean and variance are computed over the real rows of every
    replica's batch: rows padding an uneven split or a partial last batch are left out, rows
    masked out by ``mask`` too, and every real row counts once, whichever replica holds it.
    The statistics, the running averages and the outputs of the real rows are those of
    ``linen.BatchNorm`` on one device fed the unpadded global batch. The replica axis comes
    from the replica context: no ``axis_name`` is needed. Outside any strategy it is
    ``linen.BatchNorm``.

    The fields are ``linen.BatchNorm``'s and so are the variables: ``scale`` and ``bias`` in
    ``params``, ``mean`` and ``var`` in ``batch_stats`` (update them with
    ``apply(..., mutable=["batch_stats"])``). An unnamed submodule is auto-named
    ``SyncBatchNorm_<i>``; pass ``name="BatchNorm_0"`` to keep a ``linen.BatchNorm``'s
    checkpoint paths.

    Args:
        use_running_average: use the stored running averages instead of the batch's
            statistics (and do not update them).
        axis: the feature axis (or axes) of the input; axis 0 is the batch.
        momentum: the decay rate of the running averages.
        epsilon: added to the variance.
        dtype: the result's dtype (default: inferred from the input and the parameters).
        param_dtype: the parameters' dtype.
        use_bias: add a learned bias.
        use_scale: multiply by a learned scale.
        bias_init, scale_init: the parameters' initializers.
        axis_name: ``None`` (the current replica context's axis), or a named axis of your own
            ``jax.shard_map``/``pmap`` to reduce over instead.
        axis_index_groups: groups within ``axis_name``, as for ``jax.lax.psum``.
        use_fast_variance: ``var = E[x^2] - E[x]^2`` in one all-reduce (as flax); False for
            ``E[(x - E[x])^2]`` in two.
        force_float32_reductions: compute the statistics in at least float32 (as flax).

    Example:
        >>> import jax, numpy as np, jaxmirror
        >>> from jaxmirror.nn.linen import SyncBatchNorm
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> model = SyncBatchNorm(use_running_average=False, momentum=0.0)
        >>> variables = model.init(jax.random.key(0), np.zeros((1, 1), np.float32))
        >>> @s.run
        ... def step(variables, x):
        ...     return model.apply(variables, x, mutable=["batch_stats"])
        >>> batch = next(iter(s.experimental_distribute_dataset([np.array([[1.0], [2.0], [6.0]])])))
        >>> y, updates = step(variables, batch)  # 2 rows on replica 0, 1 (and a padded one) on 1
        >>> float(updates["batch_stats"]["mean"][0]), float(updates["batch_stats"]["var"][0])
        (3.0, 4.666...)
    """

    @linen.compact
    def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
        """Normalize ``x`` with its batch statistics (updating ``batch_stats``) or the averages.

        During initialization the averages are not updated and the statistics are this
        replica's alone, as for ``linen.BatchNorm``.

        Args:
            x: the input, with the batch on axis 0.
            use_running_average: overrides the field of the same name when given.
            mask: ``None``, or a binary array broadcastable to ``x``: the entries the
                statistics are computed on (padded rows are left out as well).

        Returns:
            The normalized input, of ``x``'s shape.

        Example:
            >>> import jax, jax.numpy as jnp
            >>> from jaxmirror.nn.linen import SyncBatchNorm
            >>> x = jnp.array([[1.0], [3.0], [9.0]])
            >>> mask = jnp.array([[True], [True], [False]])
            >>> model = SyncBatchNorm(use_running_average=False)
            >>> variables = model.init(jax.random.key(0), x)
            >>> y, _ = model.apply(variables, x, mask=mask, mutable=["batch_stats"])
            >>> y[:2].tolist()
            [[-0.99999...], [0.99999...]]
        """
        use_running_average = linen.merge_param(
            "use_running_average", self.use_running_average, use_running_average)
        feature_axes = canonical_axes(x.ndim, self.axis)
        reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
        feature_shape = [x.shape[axis] for axis in feature_axes]
        stat_dtype = jnp.float32 if self.force_float32_reductions else self.param_dtype
        ra_mean = self.variable("batch_stats", "mean",
                                lambda s: jnp.zeros(s, stat_dtype), feature_shape)
        ra_var = self.variable("batch_stats", "var", lambda s: jnp.ones(s, stat_dtype),
                               feature_shape)
        if use_running_average:
            mean, var = ra_mean.value, ra_var.value
            if not self.force_float32_reductions:
                mean, var = (jnp.asarray(v, self.param_dtype) for v in (mean, var))
        else:
            initializing = self.is_initializing()
            # As linen.BatchNorm: `init` may run where the replicas' axis does not exist.
            mean, var = batch_statistics(
                x, reduction_axes, dtype=self.dtype, mask=mask,
                use_fast_variance=self.use_fast_variance,
                force_float32_reductions=self.force_float32_reductions,
                axis_name=self.axis_name, axis_index_groups=self.axis_index_groups,
                synchronize=not initializing)
            if not initializing:
                ra_mean.value = moving_average(ra_mean.value, mean, self.momentum)
                ra_var.value = moving_average(ra_var.value, var, self.momentum)
        scale = bias = None
        if self.use_scale:
            scale = self.param("scale", self.scale_init, feature_shape, self.param_dtype)
        if self.use_bias:
            bias = self.param("bias", self.bias_init, feature_shape, self.param_dtype)
        return normalize(x, mean, var, scale, bias, reduction_axes, feature_axes, self.dtype,
                         self.epsilon)

