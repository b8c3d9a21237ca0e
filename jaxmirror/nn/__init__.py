"""Layers whose statistics span the replicas' real rows: flax NNX here, flax Linen in ``linen``.

* ``batch_norm``: ``SyncBatchNorm``, a ``flax.nnx.BatchNorm`` whose batch statistics are those
  of the real rows of the whole global batch inside ``strategy.run``;
* ``linen``: the same layer as a ``flax.linen.BatchNorm``;
* ``statistics``: the masked, all-reduced mean and variance both share.

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
