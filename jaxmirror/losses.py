"""``compute_average_loss``: per-example losses to a loss scaled for the global batch."""

from __future__ import annotations

import jax.numpy as jnp

from jaxmirror import context


def compute_average_loss(per_example_loss, sample_weight=None, global_batch_size=None):
    """Scale per-example losses by the global batch size (``tf.nn.compute_average_loss``).

    Inside ``run`` this is the replica's sum of (weighted) losses divided by the *global* batch
    size, so that summing the gradients over replicas gives the gradient of the global mean.
    Outside any strategy it is the sum divided by the batch size.

    Args:
        per_example_loss: an array of rank >= 1 whose axis 0 is the replica's batch.
        sample_weight: ``None``, or weights broadcastable to ``per_example_loss``.
        global_batch_size: a positive int; by default the replica's batch size times
            ``num_replicas_in_sync``.

    Returns:
        A scalar of ``per_example_loss``'s dtype.

    Raises:
        ValueError: for a scalar ``per_example_loss`` or a bad ``global_batch_size``.
        RuntimeError: without ``global_batch_size`` in a cross-replica context.

    Example:
        >>> import jax.numpy as jnp, jaxmirror
        >>> float(jaxmirror.compute_average_loss(jnp.array([1.0, 2.0, 3.0])))
        2.0
        >>> float(jaxmirror.compute_average_loss(jnp.array([1.0, 2.0]), global_batch_size=4))
        0.75
    """
    loss = jnp.asarray(per_example_loss)
    if loss.ndim < 1:
        raise ValueError("Invalid value passed for `per_example_loss`. Expected a tensor with at "
                         f"least rank 1, received shape {loss.shape}.")
    dtype = loss.dtype
    if sample_weight is not None:
        loss = (loss * jnp.asarray(sample_weight)).astype(dtype)
    if global_batch_size is None:
        entry = context.current()
        if entry.replica_context is None and entry.strategy is not context.default_strategy():
            raise RuntimeError("You are calling `compute_average_loss` in cross replica context, "
                               "while it was expected to be called in replica context.")
        global_batch_size = loss.shape[0] * entry.strategy.num_replicas_in_sync
    elif isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int):
        gbs = jnp.asarray(global_batch_size)
        if gbs.ndim != 0 or not jnp.issubdtype(gbs.dtype, jnp.integer):
            raise ValueError(f"`global_batch_size` must be a scalar integer; got "
                             f"{global_batch_size!r}.")
    elif global_batch_size <= 0:
        raise ValueError(f"`global_batch_size` must be positive; got {global_batch_size}.")
    return jnp.sum(loss) / jnp.asarray(global_batch_size).astype(dtype)
