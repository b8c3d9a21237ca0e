"""``SyncBatchNorm``: flax NNX's ``BatchNorm`` with statistics over every replica's real rows."""

from __future__ import annotations

from flax import nnx

from jaxmirror.nn.statistics import batch_statistics, canonical_axes, moving_average, normalize


class SyncBatchNorm(nnx.BatchNorm):
    """``flax.nnx.BatchNorm`` whose batch statistics are those of the whole global batch.

    Inside ``strategy.run`` the mean and variance are computed over the real rows of every
    replica's batch (``tf.keras.layers.BatchNormalization(synchronized=True)``): rows padding an
    uneven split or a partial last batch are left out, rows masked out by ``mask`` too, and
    every real row counts once, whichever replica holds it. The statistics, the running
    averages and the outputs of the real rows are those of flax's ``BatchNorm`` on one device
    fed the unpadded global batch. The replica axis comes from the replica context: no
    ``axis_name`` is needed. Outside any strategy it is flax's ``BatchNorm``.

    The variables are ``nnx.BatchNorm``'s (``Param`` ``scale`` and ``bias``, ``BatchStat``
    ``mean`` and ``var``), so optimizers, filters and checkpoints treat both alike, and
    ``train()``, ``eval()`` and ``nnx.view`` set ``use_running_average`` as for it.

    Args:
        num_features: the number of input features.
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
        promote_dtype, rngs, bias_metadata, scale_metadata: as for ``nnx.BatchNorm``.

    Example:
        >>> import jax, numpy as np, jaxmirror
        >>> from flax import nnx
        >>> from jaxmirror.nn import SyncBatchNorm
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> graphdef, state = nnx.split(SyncBatchNorm(1, momentum=0.0, rngs=nnx.Rngs(0)))
        >>> @s.run
        ... def step(state, x):
        ...     model = nnx.merge(graphdef, state)
        ...     y = model(x)
        ...     return y, nnx.split(model)[1]
        >>> batch = next(iter(s.experimental_distribute_dataset([np.array([[1.0], [2.0], [6.0]])])))
        >>> y, state = step(state, batch)     # 2 rows on replica 0, 1 (and a padded one) on 1
        >>> float(state["mean"][...][0]), float(state["var"][...][0])
        (3.0, 4.666...)
    """

    def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
        """Normalize ``x`` with its batch statistics (updating the averages) or the averages.

        Args:
            x: the input, with the batch on axis 0.
            use_running_average: overrides the attribute of the same name when given.
            mask: ``None``, or a binary array broadcastable to ``x``: the entries the
                statistics are computed on (padded rows are left out as well).

        Returns:
            The normalized input, of ``x``'s shape.

        Example:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> from jaxmirror.nn import SyncBatchNorm
            >>> layer = SyncBatchNorm(1, rngs=nnx.Rngs(0))
            >>> layer(jnp.array([[1.0], [3.0], [9.0]]), mask=jnp.array([[True], [True], [False]]))[:2].tolist()
            [[-0.99999...], [0.99999...]]
        """
        if use_running_average is None:
            use_running_average = self.use_running_average
        if use_running_average is None:
            raise ValueError("SyncBatchNorm: `use_running_average` is None; pass it to the "
                             "constructor or the call, or set it with `train()`, `eval()` or "
                             "`nnx.view`.")
        feature_axes = canonical_axes(x.ndim, self.axis)
        reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        x, mean, var, scale, bias = self.promote_dtype(
            (x, self.mean[...], self.var[...], scale, bias), dtype=self.dtype)
        if not use_running_average:
            mean, var = batch_statistics(
                x, reduction_axes, dtype=self.dtype, mask=mask,
                use_fast_variance=self.use_fast_variance, axis_name=self.axis_name,
                axis_index_groups=self.axis_index_groups)
            self.mean[...] = moving_average(self.mean[...], mean, self.momentum)
            self.var[...] = moving_average(self.var[...], var, self.momentum)
        return normalize(x, mean, var, scale, bias, reduction_axes, feature_axes, self.dtype,
                         self.epsilon)
