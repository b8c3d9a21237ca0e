"""Splitting host batches over replicas: TF's row rule, padding to a static size, worker shares.

Everything here is host-side NumPy on one batch; ``datasets.py`` drives it and ``placer.py``
places the result. TF's rule: a batch of ``G`` rows over ``N`` replicas gives the first ``G mod N``
replicas ``ceil(G/N)`` rows and the rest ``floor(G/N)``, in order (6 -> 3/3, 3 -> 2/1,
1 -> 1/0). jaxmirror pads every replica to one static size ``S`` with copies of a real row and
keeps the real counts, so one compiled program serves the whole epoch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np


def split_counts(rows: int, parts: int) -> tuple:
    """TF's split of ``rows`` rows over ``parts`` replicas: the first ``rows % parts`` get one more.

    Args:
        rows: the global batch size of this batch.
        parts: how many replicas share it.

    Returns:
        A tuple of ``parts`` row counts summing to ``rows``.

    Example:
        >>> split_counts(3, 2), split_counts(1, 2), split_counts(14, 4)
        ((2, 1), (1, 0), (4, 4, 3, 3))
    """
    base, extra = divmod(rows, parts)
    return tuple(base + (i < extra) for i in range(parts))


def padded_size(rows: int, parts: int) -> int:
    """The static rows per replica for batches of up to ``rows`` rows over ``parts`` replicas.

    Args:
        rows: the largest global batch size.
        parts: how many replicas share a batch.

    Returns:
        ``ceil(rows / parts)``.

    Example:
        >>> padded_size(14, 4), padded_size(8, 8)
        (4, 1)
    """
    return -(-rows // parts)


class Share(NamedTuple):
    """Which rows of one global batch this process's replicas hold.

    ``counts`` are every replica's real rows (all workers', replica order; row counts are
    replicated), ``local`` the replicas this process feeds, ``starts`` where each local
    replica's rows begin in the batch.
    """

    counts: tuple
    local: range
    starts: tuple


class Topology(NamedTuple):
    """The replicas of a strategy as the input pipeline sees them.

    ``num_replicas`` in all; this worker (``worker_index`` of ``num_workers``) feeds the
    contiguous replicas ``local``.
    """

    num_replicas: int
    num_workers: int
    worker_index: int
    local: range


def topology(strategy) -> Topology:
    """The replicas of ``strategy`` as this worker's input pipeline sees them.

    Raises:
        ValueError: when this worker's replicas are not contiguous in replica order.
    """
    ext = strategy.extended
    me = jax.process_index()
    local = [i for i, d in enumerate(ext.devices) if d.process_index == me]
    if local != list(range(local[0], local[-1] + 1)):
        raise ValueError(f"DistributedDataset: this worker's replicas {local} of {strategy!r} "
                         f"are not contiguous in replica order, as distributing a dataset "
                         f"needs; list each worker's devices together.")
    return Topology(ext.placement.num_replicas, jax.process_count(), me,
                    range(local[0], local[-1] + 1))


def share(rows: int, topology: Topology, policy_off: bool) -> Share:
    """Where one global batch's rows go.

    With sharding (DATA), the batch is split over all replicas and this worker keeps its
    replicas' block. With ``policy_off`` every worker splits the whole batch over its own
    replicas (the same counts repeat for each worker).

    Args:
        rows: the batch's number of rows.
        topology: the strategy's replicas and this worker.
        policy_off: ``AutoShardPolicy.OFF`` with several workers.

    Returns:
        A ``Share``.

    Example:
        >>> topo = Topology(4, 2, 1, range(2, 4))
        >>> share(6, topo, policy_off=False)
        Share(counts=(2, 2, 1, 1), local=range(2, 4), starts=(4, 5))
        >>> share(6, topo, policy_off=True)
        Share(counts=(3, 3, 3, 3), local=range(2, 4), starts=(0, 3))
    """
    local = topology.local
    if policy_off and topology.num_workers > 1:
        per_worker = split_counts(rows, len(local))
        counts = per_worker * topology.num_workers
        starts = tuple(np.cumsum((0,) + per_worker[:-1]).tolist())
    else:
        counts = split_counts(rows, topology.num_replicas)
        offsets = np.cumsum((0,) + counts[:-1]).tolist()
        starts = tuple(offsets[i] for i in local)
    return Share(counts, local, starts)


def padded_positions(start: int, count: int, size: int) -> np.ndarray:
    """Row positions filling ``size`` slots from ``count`` real rows that begin at ``start``.

    Padding repeats the last real row (the row before ``start`` when there is none), so padded
    rows hold real, finite data: their losses are masked, never NaN.

    Args:
        start: the first real row's position.
        count: how many real rows there are (may be 0).
        size: the static number of slots.

    Returns:
        An int array of ``size`` positions.

    Example:
        >>> padded_positions(4, 2, 3).tolist(), padded_positions(6, 0, 2).tolist()
        ([4, 5, 5], [5, 5])
    """
    if count:
        return start + np.minimum(np.arange(size), count - 1)
    return np.full(size, max(start - 1, 0))


def row_index(sh: Share, size: int) -> np.ndarray | None:
    """Rows of the global batch for each local replica's ``size`` slots.

    Args:
        sh: where the batch's rows go.
        size: the static rows per replica.

    Returns:
        ``None`` when the local replicas' rows are one contiguous run of ``len(local) * size``
        rows (no padding: a reshape is enough), else an int array ``(len(local), size)``.
    """
    local_counts = [sh.counts[i] for i in sh.local]
    if all(c == size for c in local_counts) and all(
            b - a == size for a, b in zip(sh.starts, sh.starts[1:])):
        return None
    return np.stack([padded_positions(start, count, size)
                     for start, count in zip(sh.starts, local_counts)])


def local_block(array: np.ndarray, sh: Share, size: int, index) -> np.ndarray:
    """This process's replicas' rows of one leaf.

    Args:
        array: the leaf of the global batch.
        sh: where the batch's rows go.
        size: the static rows per replica.
        index: ``row_index(sh, size)``.

    Returns:
        An array ``(local replicas, size, ...)`` (a view when ``index`` is None).
    """
    if index is None:
        start = sh.starts[0]
        block = array[start:start + len(sh.local) * size]
        return block.reshape((len(sh.local), size) + array.shape[1:])
    return np.take(array, index, axis=0)


def check_element(element, position: int, what: str):
    """A host batch as NumPy leaves, checked: batched, not ragged, one batch size.

    The common case costs one flatten and a look at each leaf's shape; a bad batch is
    examined again, leaf by leaf with its path, to say what is wrong.

    Args:
        element: one element of the dataset (a nest of arrays batched along axis 0).
        position: its index in the epoch, for error messages.
        what: the API name, for error messages.

    Returns:
        ``(leaves, treedef, rows)``.

    Raises:
        ValueError: as ``explain_element``.
    """
    leaves, tree = jax.tree.flatten(element)
    arrays, rows = [], None
    for leaf in leaves:
        array = leaf if type(leaf) is np.ndarray else None
        if array is None:
            try:
                array = np.asarray(leaf)
            except ValueError:
                break
        if array.dtype == object or array.ndim == 0 or (rows is not None
                                                        and array.shape[0] != rows):
            break
        rows = array.shape[0]
        arrays.append(array)
    else:
        if arrays and rows:
            return arrays, tree, rows
    return explain_element(element, position, what)


def explain_element(element, position: int, what: str):
    """``check_element`` done slowly, leaf by leaf with paths, to name what is wrong.

    Args:
        element: one element of the dataset (a nest of arrays batched along axis 0).
        position: its index in the epoch, for error messages.
        what: the API name, for error messages.

    Returns:
        ``(leaves, treedef, rows)``.

    Raises:
        ValueError: for a scalar (unbatched) leaf, a ragged or non-numeric leaf, an empty
            element, or leaves that disagree on the batch size.
    """
    with_paths, tree = jax.tree_util.tree_flatten_with_path(element)
    if not with_paths:
        raise ValueError(f"{what}: element {position} of the dataset has no arrays (got "
                         f"{element!r}); give nests of arrays batched along axis 0.")
    leaves, sizes = [], {}
    for path, leaf in with_paths:
        where = jax.tree_util.keystr(path) or "(the whole element)"
        try:
            array = np.asarray(leaf)
        except ValueError as err:  # NumPy refuses ragged nests ("inhomogeneous shape")
            raise ValueError(f"{what}: leaf {where} of element {position} is ragged (its rows "
                             f"have different shapes); pad it to one shape first.") from err
        if array.dtype == object:
            raise ValueError(f"{what}: leaf {where} of element {position} is ragged or not "
                             f"numeric (NumPy made an object array of it); give arrays of "
                             f"numbers with one shape per leaf.")
        if array.ndim == 0:
            lists = any(isinstance(k, jax.tree_util.SequenceKey) for k in path)
            raise ValueError(
                f"{what}: leaf {where} of element {position} is a scalar: the dataset looks "
                f"unbatched; batch it by the global batch size (axis 0 is the batch), e.g. "
                f"yield arrays of shape (global_batch_size, ...)."
                + (" Python lists and tuples are nests (structure) here, not arrays: make "
                   "each leaf a NumPy array (a ragged list cannot be one)." if lists else "")
            )
        leaves.append(array)
        sizes.setdefault(array.shape[0], where)
    if len(sizes) > 1:
        described = ", ".join(f"{n} at {w}" for n, w in sizes.items())
        raise ValueError(f"{what}: the leaves of element {position} disagree on the batch size "
                         f"(axis 0): {described}; every leaf of a batch must have the same "
                         f"number of rows.")
    (rows,) = sizes
    if rows == 0:
        raise ValueError(f"{what}: element {position} has 0 rows; leave empty batches out of the "
                         f"dataset.")
    return leaves, tree, rows


def check_same_spec(leaves, tree, first, position: int, what: str) -> None:
    """Refuse an element whose structure, dtypes or row shapes differ from the first one's.

    Args:
        leaves: this element's NumPy leaves.
        tree: its structure.
        first: ``(treedef, [(dtype, row shape), ...])`` of the first element.
        position: its index, for messages.
        what: the API name, for messages.

    Raises:
        ValueError: naming the first difference.
    """
    first_tree, first_specs = first
    # TF's `from_tensor_slices((x, y)).batch(G)` habit: `(x, y)` itself is read as two batches.
    hint = (" (Given whole arrays `(x, y)`? The dataset is read as a sequence of global "
            "batches, so x and y were taken as two batches; batch them first, e.g. "
            "`[(x[i:i + G], y[i:i + G]) for i in range(0, len(x), G)]`.)" if position == 1
            else "")
    if tree != first_tree:
        raise ValueError(f"{what}: element {position} has structure {tree}, the first element "
                         f"had {first_tree}; every element must have the same structure.{hint}")
    for i, (array, (dtype, shape)) in enumerate(zip(leaves, first_specs)):
        if array.dtype != dtype or array.shape[1:] != shape:
            raise ValueError(
                f"{what}: leaf {i} of element {position} is {array.dtype}{list(array.shape)} "
                f"but the first element's was {dtype}[rows, {', '.join(map(str, shape))}]; "
                f"only the number of rows may change between batches.{hint}"
            )
