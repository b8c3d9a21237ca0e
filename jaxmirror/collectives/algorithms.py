"""How one flat buffer is summed across the replicas, inside the step's program.

Each function runs in every replica (SPMD, under ``shard_map`` over ``axis_name``) and returns
the sum of every replica's buffer, the same on all of them. They differ in the collectives XLA
runs, which is what ``NcclAllReduce``, ``HierarchicalCopyAllReduce`` and
``ReductionToOneDevice`` choose between:

* ``all_reduce``: one all-reduce over every replica (NCCL's on GPUs).
* ``hierarchical``: the replicas as a 2-D grid of groups: a reduce-scatter within each group
  (each member collects the group's sum of one slice), an all-reduce of those slices across the
  groups, an all-gather back within each group.
* ``to_one_device``: every buffer sent to one replica (collective-permutes), accumulated there,
  and broadcast back along a doubling tree of collective-permutes.

A ``wire`` dtype (e.g. ``bfloat16``) sends each replica's own buffer in that dtype (rounded
once) and everything else in the buffer's own: the first reduce-scatter becomes an all-to-all
followed by a local sum, so no addition happens in the narrow dtype, and the partial sums and
the result travel as they were accumulated, so a sum beyond the wire's range (float16's 65504)
or precision stays exact.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def narrowed(buf, wire):
    """``buf`` as sent: in ``wire`` when that is a narrower float than ``buf``'s dtype.

    Args:
        buf: an array.
        wire: a dtype, or ``None``.

    Returns:
        The array to put on the wire.

    Example:
        >>> narrowed(jnp.ones(2), jnp.bfloat16).dtype
        dtype(bfloat16)
        >>> narrowed(jnp.arange(2), jnp.bfloat16).dtype
        dtype('int32')
    """
    if (wire is None or not jnp.issubdtype(buf.dtype, jnp.floating)
            or jnp.dtype(wire).itemsize >= buf.dtype.itemsize):
        return buf
    return buf.astype(wire)


def _scatter_sum(buf, axis_name, groups, size: int, wire):
    """Reduce-scatter within ``groups`` (of ``size`` members): this member's slice of the sum."""
    sent = narrowed(buf, wire)
    if sent.dtype == buf.dtype:
        return lax.psum_scatter(buf, axis_name, axis_index_groups=groups, tiled=True)
    blocks = lax.all_to_all(sent.reshape(size, -1), axis_name, 0, 0, axis_index_groups=groups,
                            tiled=True)
    return blocks.astype(buf.dtype).sum(0)  # accumulated in the buffer's own dtype


def _gather(buf, axis_name, groups):
    # Sums go back in their own dtype: narrowed, 8 x 40000 would be float16's inf.
    return lax.all_gather(buf, axis_name, axis_index_groups=groups, tiled=True)


def all_reduce(buf, axis_name, num_replicas: int, wire=None):
    """The sum over every replica with one all-reduce (with ``wire``: all-to-all of the narrowed
    buffers, all-gather of the sums in the buffer's dtype).

    Args:
        buf: this replica's flat buffer (length a multiple of ``num_replicas`` when ``wire``
            narrows it).
        axis_name: the replica axis.
        num_replicas: how many replicas.
        wire: the dtype on the wire, or ``None``.

    Returns:
        The sum, on every replica.
    """
    if narrowed(buf, wire).dtype == buf.dtype:
        return lax.psum(buf, axis_name)
    return _gather(_scatter_sum(buf, axis_name, None, num_replicas, wire), axis_name, None)


def grid(num_replicas: int) -> tuple:
    """The 2-D view ``hierarchical`` uses: ``(groups, across)`` as replica-index lists.

    Two groups of ``n / 2`` when ``n`` is even and at least 4 (TF's layout for 8 GPUs: two
    groups of 4), else ``n`` groups of one.

    Args:
        num_replicas: how many replicas.

    Returns:
        ``groups`` (the members of each group) and ``across`` (the members holding the same
        position in every group).

    Example:
        >>> grid(8)[0], grid(8)[1][:2]
        ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5]])
    """
    n = num_replicas
    size = n // 2 if n >= 4 and n % 2 == 0 else 1
    groups = [list(range(g * size, (g + 1) * size)) for g in range(n // size)]
    across = [[g[i] for g in groups] for i in range(size)]
    return groups, across


def hierarchical(buf, axis_name, num_replicas: int, wire=None):
    """The sum in two levels: within groups, across groups, back within groups.

    Args:
        buf: this replica's flat buffer (length a multiple of ``num_replicas``).
        axis_name: the replica axis.
        num_replicas: how many replicas.
        wire: the dtype on the wire, or ``None``.

    Returns:
        The sum, on every replica.
    """
    groups, across = grid(num_replicas)
    size = len(groups[0])
    if size == 1:  # no groups to form: the level across the groups is everything
        return all_reduce(buf, axis_name, num_replicas, wire)
    part = _scatter_sum(buf, axis_name, groups, size, wire)  # only the values go narrowed
    part = lax.psum(part, axis_name, axis_index_groups=across)  # the groups' sums: as they are
    return _gather(part, axis_name, groups)


def _add_all(values):
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total


def to_one_device(buf, axis_name, num_replicas: int, target: int, accumulation_fn=None,
                  wire=None):
    """The sum accumulated on replica ``target``'s device, then broadcast to the others.

    Args:
        buf: this replica's flat buffer.
        axis_name: the replica axis.
        num_replicas: how many replicas.
        target: the replica whose device accumulates.
        accumulation_fn: called with the list of every replica's buffer (in replica order) on
            ``target``; ``None`` adds them in that order.
        wire: the dtype on the wire, or ``None``.

    Returns:
        The accumulated buffer, on every replica.
    """
    n = num_replicas
    sent = narrowed(buf, wire)
    values = [None] * n
    values[target] = sent.astype(buf.dtype)  # its own value rounded too, as everyone's is
    for k in range(1, n):  # every other replica sends its buffer to the target
        source = (target + k) % n
        values[source] = lax.ppermute(sent, axis_name, [(source, target)]).astype(buf.dtype)
    total = (accumulation_fn or _add_all)(values)
    total = jnp.asarray(total, buf.dtype)
    if total.shape != buf.shape:
        raise ValueError(f"ReductionToOneDevice: `accumulation_fn` must return one array of "
                         f"the buffers' shape {buf.shape}; got shape {total.shape}.")
    me = lax.axis_index(axis_name)
    step = 1
    while step < n:  # broadcast: the replicas holding the total send it to as many others
        pairs = [((target + j) % n, (target + j + step) % n) for j in range(step)
                 if j + step < n]
        got = lax.ppermute(total, axis_name, pairs)  # the sum in its own dtype: exact
        receivers = jnp.asarray([dst for _, dst in pairs])
        total = jnp.where(jnp.any(me == receivers), got, total)
        step *= 2
    return total
