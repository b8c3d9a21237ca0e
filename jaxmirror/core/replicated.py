"""``mark_replicated``: tell ``run``'s replication analysis a value is the same on every replica.

The analysis (``step/replication.py``) sees collectives one at a time: a reduce-scatter within
groups, or a collective-permute, makes values vary. A hierarchical or one-device all-reduce
composes such collectives into a result that is the same everywhere, which only its author
knows. ``mark_replicated`` is an identity primitive (it compiles to nothing) that records it.
"""

from __future__ import annotations

import jax
from jax.interpreters import ad, batching, mlir

replicated_p = jax.extend.core.Primitive("jaxmirror_replicated")
replicated_p.def_impl(lambda x: x)
replicated_p.def_abstract_eval(lambda x: x)
mlir.register_lowering(replicated_p, mlir.lower_fun(lambda x: x, multiple_results=False))
ad.deflinear2(replicated_p, lambda ct, x: [ct])
batching.primitive_batchers[replicated_p] = lambda args, dims: (replicated_p.bind(*args),
                                                                  dims[0])


def mark_replicated(x):
    """``x``, marked as identical on every replica (use only where that is true by construction).

    Args:
        x: an array (inside the replicas' program).

    Returns:
        ``x`` itself.

    Example:
        >>> import jax.numpy as jnp
        >>> float(mark_replicated(jnp.float32(2.0)))
        2.0
    """
    return replicated_p.bind(x)
