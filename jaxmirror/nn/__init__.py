"""Layers whose statistics span the replicas' real rows: flax NNX here, flax Linen in ``linen``.

Modules:
    ``batch_norm``: ``SyncBatchNorm``: flax NNX's ``BatchNorm`` over the global batch's real rows.
    ``linen``: the same layer as a ``flax.linen.BatchNorm``.
    ``statistics``: the masked, all-reduced mean and variance both layers share.

Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxmirror import nn
    >>> layer = nn.SyncBatchNorm(2, rngs=nnx.Rngs(0))
    >>> layer(jnp.array([[0.0, 1.0], [2.0, 3.0]])).round(3).tolist()
    [[-1.0, -1.0], [1.0, 1.0]]
"""

from jaxmirror.nn import linen
from jaxmirror.nn.batch_norm import SyncBatchNorm

__all__ = ["SyncBatchNorm", "linen"]
