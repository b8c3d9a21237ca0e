"""Getting host data onto the replicas: ``ValueContext``, distributed values and datasets."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxmirror import context
from jaxmirror.values import PerReplica


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
    stacked = [strategy.extended._stack_components(col) for col in columns]
    return jax.tree.unflatten(tree, stacked)


def distribute_values_from_function(strategy, value_fn):
    """``Strategy.experimental_distribute_values_from_function``."""
    n = strategy.num_replicas_in_sync
    values = [value_fn(ValueContext(i, n)) for i in range(n)]
    if n == 1:
        return jax.device_put(values[0], strategy.extended.devices[0])
    return _stack_leaves(strategy, values, "experimental_distribute_values_from_function")


def _split_batch(strategy, batch):
    """One global host batch as a nest of PerReplica values (each replica a contiguous slice)."""
    n = strategy.num_replicas_in_sync
    leaves, tree = jax.tree.flatten(batch)
    arrays = [np.asarray(x) for x in leaves]
    sizes = {a.shape[0] if a.ndim else None for a in arrays}
    if None in sizes:
        raise ValueError("experimental_distribute_dataset: every element must be batched (rank "
                         ">= 1, the batch along axis 0); got a scalar leaf.")
    if len(sizes) > 1:
        raise ValueError(f"experimental_distribute_dataset: the leaves of one element disagree on "
                         f"the batch size: {sorted(sizes)}.")
    if n == 1:
        return jax.device_put(batch, strategy.extended.devices[0])
    (g,) = sizes
    if g % n:
        raise ValueError(f"experimental_distribute_dataset: the global batch size {g} is not "
                         f"divisible by num_replicas_in_sync {n}.")
    split = [a.reshape((n, g // n) + a.shape[1:]) for a in arrays]
    placed = jax.device_put(split, strategy.extended.replica_sharding)
    return jax.tree.unflatten(tree, [PerReplica(x) for x in placed])


class DistributedIterator:
    """An iterator over a ``DistributedDataset`` (``tf.distribute.DistributedIterator``).

    Example:
        >>> import numpy as np, jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> it = iter(s.experimental_distribute_dataset([np.arange(2), np.arange(2, 4)]))
        >>> [x.tolist() for x in s.experimental_local_results(it.get_next())]
        [[0], [1]]
    """

    def __init__(self, strategy, iterator):
        self._strategy = strategy
        self._iterator = iterator

    def __iter__(self):
        return self

    def __next__(self):
        if context.current().in_run:
            raise ValueError("next() of a distributed iterator was called inside `run`; fetch the "
                             "batch outside and pass it to `run` as an argument.")
        return _split_batch(self._strategy, next(self._iterator))

    def get_next(self):
        """The next element, a nest of ``PerReplica`` values; ``StopIteration`` at the end."""
        return next(self)


class DistributedDataset:
    """A dataset whose elements are split over the replicas (``tf.distribute.DistributedDataset``).

    Args:
        strategy: the strategy to distribute over.
        dataset: a re-iterable of global host batches.
        options: reserved for ``InputOptions``.

    Example:
        >>> import numpy as np, jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> ds = s.experimental_distribute_dataset([np.ones((4, 3))] * 3)
        >>> sum(1 for _ in ds)
        3
    """

    def __init__(self, strategy, dataset, options=None):
        if not hasattr(dataset, "__iter__"):
            raise ValueError(f"experimental_distribute_dataset: `dataset` must be a re-iterable of "
                             f"batches; got {type(dataset).__name__}.")
        self._strategy = strategy
        self._dataset = dataset
        self._options = options

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(self._strategy, iter(self._dataset))
