"""``Placer``: a batch's host blocks onto the replicas' devices, as ``PerReplica`` values."""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from jaxmirror.core import _compat
from jaxmirror.core.values import PerReplica
from jaxmirror.data.options import InputOptions


class HostBatch(NamedTuple):
    """A batch split and padded on the host, not yet on the devices.

    Attributes:
        tree: the batch's structure.
        blocks: one ``(local replicas, size, ...)`` array per leaf (with one replica: the
            leaves themselves).
        counts: every replica's real rows, or ``None`` for a batch that needs none.
        single: one replica: the leaves go to its device as they are.
    """

    tree: object
    blocks: list
    counts: tuple | None
    single: bool = False


class Placer:
    """Turns host blocks (``(local replicas, rows, ...)`` per leaf) into PerReplica values.

    One ``jax.device_put`` per batch (``make_array_from_process_local_data`` with several
    processes); the row counts of each pattern are placed once and reused.

    Args:
        strategy: the strategy whose replicas get the batches.
        options: the dataset's ``InputOptions`` (``experimental_fetch_to_device``).
    """

    def __init__(self, strategy, options: InputOptions):
        self._placement = strategy.extended.placement
        self._fetch = options.experimental_fetch_to_device
        self._multi_process = jax.process_count() > 1
        # An epoch has one or two row-count patterns: each is placed once, not once per batch
        # (a transfer costs as much as a data leaf's). Each leaf position has its own array, so
        # donating one leaf (in a jax.jit of the user's; run refuses) spares the others'.
        self._counts = {}

    def place_batch(self, batch: HostBatch):
        """``batch`` on the devices: a nest of ``PerReplica`` (plain arrays with one replica)."""
        if batch.single:
            return self.place_single(batch.tree, batch.blocks)
        return self.place(batch.tree, batch.blocks, batch.counts)

    def place_stacked(self, batches: list):
        """Several batches as one transfer, for a fused step: each leaf's blocks stacked along
        a new axis after the replica axis.

        Args:
            batches: ``HostBatch``es of one epoch.

        Returns:
            ``(element, counts)``: a nest of ``PerReplica`` whose components have a leading
            axis of length ``len(batches)``, and per leaf the ``(len(batches), replicas)``
            row counts (or ``None``); ``None`` when the batches differ in structure or shape
            (then each must be placed alone).
        """
        first = batches[0]
        shapes = [b.shape for b in first.blocks]
        if (first.single or not self._fetch or self._multi_process
                or any(b.tree != first.tree or (b.counts is None) != (first.counts is None)
                       or [x.shape for x in b.blocks] != shapes for b in batches[1:])):
            return None
        stacked = [np.stack([b.blocks[j] for b in batches], axis=1) for j in range(len(shapes))]
        placement = self._placement
        placed = _compat.put_host_arrays(stacked, [placement.replica_sharding] * len(stacked))
        counts = None
        if first.counts is not None:
            counts = self._counts_array(tuple(b.counts for b in batches), -1)
        element = jax.tree.unflatten(first.tree, [PerReplica(x) for x in placed])
        return element, tuple(counts for _ in placed)

    def place(self, tree, blocks, counts):
        """The batch as a nest of ``PerReplica`` values.

        Args:
            tree: the batch's structure.
            blocks: one ``(local replicas, size, ...)`` array per leaf.
            counts: every replica's real rows, or ``None`` for a batch that needs none.

        Returns:
            The nest; each leaf's row counts are the array cached for its position.
        """
        placement = self._placement
        counts = None if counts is None else tuple(counts)
        if not self._fetch:
            placed = blocks
        elif self._multi_process:
            placed = [jax.make_array_from_process_local_data(
                placement.replica_sharding, b, (placement.num_replicas,) + b.shape[1:])
                for b in blocks]
        else:  # one transfer for the whole batch
            placed = _compat.put_host_arrays(blocks, [placement.replica_sharding] * len(blocks))
        return jax.tree.unflatten(tree, [
            PerReplica(x, None if counts is None else self._counts_array(counts, j))
            for j, x in enumerate(placed)])

    def _counts_array(self, counts: tuple, leaf: int):
        array = self._counts.get((counts, leaf))
        if array is None or (isinstance(array, jax.Array) and array.is_deleted()):
            host = np.asarray(counts, np.int32)
            placement = self._placement
            if not self._fetch:
                array = host
            elif self._multi_process:
                array = jax.make_array_from_process_local_data(placement.replicated_sharding,
                                                               host, host.shape)
            else:
                array = jax.device_put(host, placement.replicated_sharding)
            self._counts[(counts, leaf)] = array
        return array

    def place_single(self, tree, leaves):
        """One replica: the batch as plain arrays on its device, as TF gives them."""
        if not self._fetch:
            return jax.tree.unflatten(tree, leaves)
        sharding = self._placement.mirrored_sharding  # one replica: its one device
        return jax.tree.unflatten(tree, _compat.put_host_arrays(leaves, [sharding] * len(leaves)))
