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

    def stack(self, first: HostBatch, k: int):
        """A ``HostStack`` for up to ``k`` batches shaped as ``first`` (with it added), or
        ``None`` when batches cannot be stacked here (host batches, several processes): then
        each is placed alone.

        Args:
            first: the first batch.
            k: the most batches the stack holds.
        """
        if not self._fetch or self._multi_process:
            return None
        return HostStack(self, first, k)

    def place_host_stack(self, tree, arrays: list, counts: list, single: bool = False):
        """Stacked blocks as one transfer (see ``HostStack.place``)."""
        placement = self._placement
        if single:  # one replica: plain arrays on its device, the steps along axis 0
            placed = _compat.put_host_arrays(arrays, [placement.mirrored_sharding] * len(arrays))
            return jax.tree.unflatten(tree, placed), tuple(None for _ in placed)
        shardings = [placement.replica_sharding] * len(arrays)
        if counts[0] is not None:  # in the same transfer: their patterns vary call to call
            arrays = arrays + [np.asarray(counts, np.int32)]
            shardings.append(placement.replicated_sharding)
        placed = _compat.put_host_arrays(arrays, shardings)
        placed_counts = placed.pop() if counts[0] is not None else None
        element = jax.tree.unflatten(tree, [PerReplica(x) for x in placed])
        return element, tuple(placed_counts for _ in placed)

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


class HostStack:
    """Host batches of one shape, each copied into one array per leaf as it is taken (so a
    source that refills its buffers for the next batch does not change the ones taken), for a
    fused step: moved to the devices in one transfer.

    Args:
        placer: the dataset's ``Placer``.
        first: the first batch (added).
        k: the most batches the stack holds.
    """

    def __init__(self, placer: Placer, first: HostBatch, k: int):
        self._placer = placer
        self._tree = first.tree
        self._padded = first.counts is not None
        self._single = first.single
        # The step axis: after the replica axis of blocks; first for one replica's leaves.
        self._axis = 0 if first.single else 1
        self._arrays = [np.empty(b.shape[:self._axis] + (k,) + b.shape[self._axis:],
                                 np.asarray(b).dtype) for b in first.blocks]
        # What every batch's blocks must be (shape, dtype), and where batch i goes in each.
        self._specs = [(a.shape[:self._axis] + a.shape[self._axis + 1:], a.dtype)
                       for a in self._arrays]
        self._slots = [(slice(None),) * self._axis + (i,) for i in range(k)]
        self._counts = []
        self.add(first)

    def add(self, batch: HostBatch) -> bool:
        """Copy ``batch`` in; False (and nothing copied) when it does not fit the stack."""
        arrays = self._arrays
        if (batch.single != self._single or batch.tree != self._tree
                or (batch.counts is not None) != self._padded
                or len(self._counts) == len(self._slots)
                or not all(type(b) is np.ndarray and b.shape == shape and b.dtype == dtype
                           or np.shape(b) == shape and np.asarray(b).dtype == dtype
                           for b, (shape, dtype) in zip(batch.blocks, self._specs))):
            return False
        slot = self._slots[len(self._counts)]
        for a, b in zip(arrays, batch.blocks):
            a[slot] = b
        self._counts.append(batch.counts)
        return True

    def place(self):
        """``(element, counts)``: a nest of ``PerReplica`` whose components have a leading axis
        of the batches added (one replica: plain arrays with it), and per leaf their
        ``(batches, replicas)`` row counts (or ``None``)."""
        n, ax = len(self._counts), self._axis
        arrays = [a if a.shape[ax] == n else np.ascontiguousarray(a[(slice(None),) * ax + (
            slice(0, n),)]) for a in self._arrays]
        return self._placer.place_host_stack(self._tree, arrays, self._counts, self._single)

    def batches(self) -> list:
        """The ``HostBatch``es added, in order, read back from the stack's own copies (what a
        failed fused step puts back in its iterator)."""
        ax = self._axis
        return [HostBatch(self._tree, [a[(slice(None),) * ax + (i,)] for a in self._arrays],
                          counts, self._single) for i, counts in enumerate(self._counts)]
