"""``experimental_distribute_values_from_function``, and the ``ValueContext`` it passes."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np



@dataclasses.dataclass(frozen=True)
class ValueContext:
    """What ``value_fn`` learns about its replica (``tf.distribute.experimental.ValueContext``).

    Args:
        replica_id_in_sync_group: the replica the value is for.
        num_replicas_in_sync: how many replicas there are.

    Example:
        >>> import jaxmirror
        >>> ctx = jaxmirror.experimental.ValueContext(1, 2)
        >>> ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync
        (1, 2)
    """

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1


def _stack_leaves(strategy, per_replica_trees: list, what: str):
    first, tree = jax.tree.flatten(per_replica_trees[0])
    columns = [[np.asarray(x)] for x in first]
    for i, value in enumerate(per_replica_trees[1:], start=1):
        leaves, other = jax.tree.flatten(value)
        if other != tree:
            raise ValueError(f"{what}: replica {i} gave structure {other}, replica 0 gave {tree}; "
                             f"every replica must give the same structure.")
        for col, x in zip(columns, leaves):
            x = np.asarray(x)
            if x.shape != col[0].shape or x.dtype != col[0].dtype:
                raise ValueError(
                    f"{what}: replica {i} gave a {x.dtype}{list(x.shape)} value where replica 0 "
                    f"gave {col[0].dtype}{list(col[0].shape)}; components must agree in shape and "
                    f"dtype."
                )
            col.append(x)
    stacked = [strategy.extended.placement.stack_components(col) for col in columns]
    return jax.tree.unflatten(tree, stacked)


def distribute_values_from_function(strategy, value_fn):
    """``Strategy.experimental_distribute_values_from_function`` (see there).

    Args:
        strategy: the strategy.
        value_fn: called as ``value_fn(ValueContext)`` once per replica.

    Returns:
        A nest of ``PerReplica`` values (the plain value, on the device, with one replica).
    """
    n = strategy.num_replicas_in_sync
    values = [value_fn(ValueContext(i, n)) for i in range(n)]
    if n == 1:
        return jax.device_put(values[0], strategy.extended.devices[0])
    return _stack_leaves(strategy, values, "experimental_distribute_values_from_function")


__all__ = ["ValueContext", "distribute_values_from_function"]
