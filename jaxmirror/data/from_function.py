"""``DistributedDatasetsFromFunction``: per-replica batches from ``dataset_fn(InputContext)``."""

from __future__ import annotations

import jax
import numpy as np

from jaxmirror.data import batching, sources
from jaxmirror.data.datasets import END, DistributedDataset
from jaxmirror.data.options import InputContext, InputReplicationMode


class DistributedDatasetsFromFunction(DistributedDataset):
    """The dataset ``strategy.distribute_datasets_from_function`` returns.

    ``dataset_fn(InputContext)`` is called once per worker (``PER_WORKER``) or once per replica
    (``PER_REPLICA``) and returns a re-iterable of *per-replica* batches. Each step every
    replica takes the next batch of its pipeline; a replica whose pipeline has run out gets
    zero rows, and the iteration ends when every replica's has. Batches are padded to the
    first one's size, with row counts, as in ``DistributedDataset``. A dataset of unbatched
    elements (the first has a scalar leaf) gives each replica one element per step, as it is
    (TF's way); its pipelines must then end together (an element cannot be padded).

    Args:
        strategy: the strategy to distribute over.
        dataset_fn: called with an ``InputContext``; returns a dataset of per-replica batches.
        options: an ``InputOptions``.

    Raises:
        ValueError: for a non-callable ``dataset_fn`` or bad options.

    Example:
        >>> import numpy as np, jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> options = jaxmirror.InputOptions(
        ...     experimental_replication_mode=jaxmirror.InputReplicationMode.PER_REPLICA)
        >>> ds = s.distribute_datasets_from_function(
        ...     lambda ctx: [np.full(2, ctx.input_pipeline_id)], options)
        >>> [[c.tolist() for c in s.experimental_local_results(b)] for b in ds]
        [[[0, 0], [1, 1]]]
    """

    _what = "distribute_datasets_from_function"

    def __init__(self, strategy, dataset_fn, options=None):
        super().__init__(strategy, options)
        what = self._what
        if not callable(dataset_fn):
            raise ValueError(f"{what}: `dataset_fn` must be a function taking an InputContext; "
                             f"got {type(dataset_fn).__name__}.")
        topo = self._topology
        self._per_replica = (self._options.experimental_replication_mode
                             is InputReplicationMode.PER_REPLICA)
        n = topo.num_replicas
        if self._per_replica:
            contexts = [InputContext(n, i, n) for i in topo.local]
        else:
            contexts = [InputContext(topo.num_workers, topo.worker_index, n)]
        self._factories = [sources.epoch_factory(dataset_fn(ctx), what) for ctx in contexts]
        self._unbatched = None  # whether elements are unbatched (decided by the first one)

    def _check(self, element, position: int):
        """As ``DistributedDataset._check``; an unbatched element is checked as one row."""
        if self._unbatched is None:
            self._unbatched = any(np.ndim(x) == 0 for x in jax.tree.leaves(element))
        if self._unbatched:
            element = jax.tree.map(lambda x: np.asarray(x)[None], element)
        return super()._check(element, position)

    @property
    def element_spec(self):
        """As ``DistributedDataset.element_spec``; an unbatched dataset's are its elements'.

        Example:
            >>> import numpy as np, jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> s.distribute_datasets_from_function(lambda ctx: [np.float32(1)]).element_spec
            ShapeDtypeStruct(shape=(), dtype=float32)
        """
        spec = super().element_spec
        if not self._unbatched:
            return spec
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), spec)

    @property
    def _parts(self) -> int:
        return 1

    def _peek(self) -> None:
        self._factories[0] = sources.peeked(self._factories[0], self._read_first, self._what)

    @property
    def restorable(self) -> bool:
        return not any(isinstance(f, sources.OneShot) for f in self._factories)

    @property
    def input_pipelines(self) -> tuple:
        if self._per_replica:
            return self._topology.num_replicas, True
        return self._topology.num_workers, True  # dataset_fn makes each worker's own

    def _epoch(self, rounds, skip: int):
        first, *rest = [f() for f in self._factories]
        return self._steps([self._read_first(first)] + [iter(r) for r in rest], rounds, skip)

    def _steps(self, iterators, rounds, skip: int):
        """Per step, one batch per local replica."""
        if self._per_replica:
            pulls = [lambda it=it: next(it, None) for it in iterators]
        else:
            (shared,) = iterators
            pulls = [lambda: next(shared, None)] * len(self._topology.local)
        position = 0

        def read_one():
            nonlocal position
            while True:
                elements = [pull() for pull in pulls]
                if all(e is None for e in elements):
                    return END
                checked = []
                for element in elements:
                    if element is not None:
                        leaves, _, rows = self._check(element, position)
                        element = (leaves, rows)
                        position += 1
                    checked.append(element)
                counts = [0 if c is None else c[1] for c in checked]
                if not (self._options.drop_remainder and min(counts) < self._rows):
                    return checked, counts

        self._skip(read_one, skip)
        if rounds is None:
            for item in iter(read_one, END):
                yield self._stack(*item)
            return
        for item, steps in self._in_rounds(rounds, read_one, lambda item: item[1]):
            counts = [c for s, n in steps for c in (s if s is not None else [0] * n)]
            if self._options.drop_remainder and min(counts) < self._rows:
                continue
            yield self._stack(item[0] if item else [None] * len(pulls), counts)

    def _agreed_size(self, infos) -> None:
        """Every worker pads to the same size: the largest batch anywhere (this round's)."""
        with self._lock:
            self._rows = max([self._rows or 0] + [c for counts in infos for c in counts])

    def _stack(self, checked, counts):
        tree = self._first[0]
        if self._unbatched:
            return self._stack_unbatched(tree, checked, counts)
        if self._topology.num_replicas == 1:
            return self._placer.place_single(tree, checked[0][0])
        size = self._rows
        padded = self._padding(any(c != size for c in counts))
        some = next((c[0] for c in checked if c is not None), None)  # rows to copy as padding
        if some is None:  # this worker's data has ended, others' has not: padding only
            some = [block[0] for block in self._blank_blocks(size, 1)]
        mine = counts[self._topology.local.start:self._topology.local.stop]
        blocks = []
        for j in range(len(some)):
            parts = [np.take(some[j] if c is None else c[0][j],
                             batching.padded_positions(0, count, size), axis=0)
                     for c, count in zip(checked, mine)]
            blocks.append(np.stack(parts))
        return self._placer.place(tree, blocks, counts if padded else None)

    def _stack_unbatched(self, tree, checked, counts):
        """Unbatched elements: each replica's one element, as it is (no rows, no padding)."""
        if min(counts) == 0:
            ended = [i for i, c in enumerate(counts) if c == 0]
            raise ValueError(
                f"{self._what}: the datasets are unbatched (each replica takes one element per "
                f"step), and in this step replica(s) {ended} got none while the others got one; "
                f"an unbatched element cannot be padded, so give every replica as many elements "
                f"(with one dataset per worker: a multiple of its {len(counts)} replicas), or "
                f"batch them (then a replica left short gets zero rows).")
        if self._topology.num_replicas == 1:
            return self._placer.place_single(tree, [a[0] for a in checked[0][0]])
        return self._placer.place(tree, [np.stack([c[0][j][0] for c in checked])
                                         for j in range(len(checked[0][0]))], None)
