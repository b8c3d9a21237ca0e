"""``compute_average_loss``: per-example losses to a loss scaled for the global batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmirror.core import _compat, context
from jaxmirror.step.replica_context import padded_batch, row_mask


def _match_rank(weight, rank: int):
    """TF's squeeze_or_expand_dimensions: a (B, 1) weight for (B,) losses, a (B,) one for (B, T)."""
    if weight.ndim == rank + 1 and weight.shape[-1] == 1:
        return jnp.squeeze(weight, -1)
    if weight.ndim == rank - 1 and weight.ndim > 0:
        return weight[..., None]
    return weight


def _check_global_batch_size(global_batch_size) -> None:
    traced = _compat.is_tracer(global_batch_size)
    # np, not jnp: inside `run` jnp.asarray(10) would be traced and could not be compared.
    gbs = jax.typeof(global_batch_size) if traced else np.asarray(global_batch_size)
    if gbs.ndim != 0 or gbs.dtype == bool or not np.issubdtype(gbs.dtype, np.integer):
        raise ValueError(f"compute_average_loss: `global_batch_size` must be a scalar integer; "
                         f"got {global_batch_size!r}.")
    if not traced and int(gbs) <= 0:
        raise ValueError(f"compute_average_loss: `global_batch_size` must be positive; got "
                         f"{global_batch_size}.")


def compute_average_loss(per_example_loss, sample_weight=None, global_batch_size=None):
    """Scale per-example losses by the global batch size (``tf.nn.compute_average_loss``).

    Inside ``run`` this is the replica's sum of (weighted) losses divided by the *global* batch
    size, so that summing the gradients over replicas gives the gradient of the global mean.
    Outside any strategy it is the sum divided by the batch size.

    On a batch from a distributed dataset, whose components are padded to a static size (an
    uneven split, a partial last batch), padded rows are left out, and the default global batch
    size is the number of real rows over all replicas: training on such batches equals
    single-device training on the unpadded ones. The padded batch is recognised by
    ``per_example_loss``'s axis 0 having its padded size, so pass losses with one entry per
    example along axis 0 (not flattened per token, say).

    Args:
        per_example_loss: an array of rank >= 1 whose axis 0 is the replica's batch.
        sample_weight: ``None``, or weights broadcastable to ``per_example_loss`` (one rank more
            or less is matched as TF does: a ``(B, 1)`` weight for ``(B,)`` losses).
        global_batch_size: a positive int; by default the replica's batch size times
            ``num_replicas_in_sync`` (TF's default), except on a padded batch from a
            distributed dataset, where it is the number of real rows over all replicas (TF's
            default would count the padding; see above).

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
        # TF's wording, on purpose (and below, for a call in cross-replica context).
        raise ValueError("Invalid value passed for `per_example_loss`. Expected a tensor with at "
                         f"least rank 1, received shape {loss.shape}.")
    dtype = loss.dtype
    if sample_weight is not None:
        loss = (loss * _match_rank(jnp.asarray(sample_weight), loss.ndim)).astype(dtype)
    entry = context.current()
    ctx = entry.replica_context
    mask = row_mask(ctx, loss.shape[0]) if ctx is not None else None
    if mask is not None:
        # Rows padding a partial or uneven batch are not examples: leave them out of the sum
        # and, by default, out of the global batch size (jnp.where: no 0 * NaN).
        loss = jnp.where(mask.reshape(mask.shape + (1,) * (loss.ndim - 1)), loss, 0)
    if global_batch_size is None:
        if ctx is None and entry.strategy is not context.default_strategy():
            raise RuntimeError("You are calling `compute_average_loss` in cross replica context, "
                               "while it was expected to be called in replica context.")
        if mask is not None:
            global_batch_size = jnp.sum(padded_batch(ctx, loss.shape[0])[1])
        else:
            global_batch_size = loss.shape[0] * entry.strategy.num_replicas_in_sync
    else:
        _check_global_batch_size(global_batch_size)
    return jnp.sum(loss) / jnp.asarray(global_batch_size).astype(dtype)
