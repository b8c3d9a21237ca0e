"""``mark_replicated``: tell ``run``'s replication analysis a value is the same on every replica.

The analysis (``step/analysis/replication.py``) sees collectives one at a time: a reduce-scatter
within groups, or a collective-permute, makes values vary. A hierarchical or one-device all-reduce
composes such collectives into a result that is the same everywhere, which only its author
knows. ``mark_replicated`` is an identity primitive (it compiles to nothing) that records it.
Differentiated, such a sum's transpose (the same composition, transposed) ends replicated too:
``mark_gradient_replicated``, put on the sum's inputs, marks the gradient that flows out there.
"""

from __future__ import annotations

from jaxmirror.core import _compat

replicated_p = _compat.identity_primitive("jaxmirror_replicated", lambda ct: ct)
gradient_replicated_p = _compat.identity_primitive("jaxmirror_gradient_replicated",
                                                   lambda ct: replicated_p.bind(ct))


def mark_gradient_replicated(x):
    """``x``, whose cotangent is marked replicated (put it on the inputs of a sum across replicas
    whose transpose is a sum across replicas too).

    Args:
        x: an array (inside the replicas' program).

    Returns:
        ``x`` itself.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> float(jax.grad(lambda x: mark_gradient_replicated(x) * 3.0)(jnp.float32(1.0)))
        3.0
    """
    return gradient_replicated_p.bind(x)


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
