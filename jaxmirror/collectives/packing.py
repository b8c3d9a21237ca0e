"""Packs: a nest's leaves as a few flat buffers, so that one collective moves many leaves.

A gradient pytree holds many small leaves; each collective has a fixed cost (a launch on GPUs,
a round trip between CPU processes with gloo: 12.5 ms for a 4-scalar tuple against 1.1 ms for
one scalar, measured on 2 workers x 2 devices). Packing concatenates the leaves of one dtype
and cuts the result into ``num_packs`` chunks (TF's ``num_packs``), or groups whole leaves into
packs of about ``bytes_per_pack`` bytes (TF's ``bytes_per_pack``). Each pack is then one
collective; unpacking restores every leaf, element for element.
"""

from __future__ import annotations

import jax.numpy as jnp


def leaf_groups(sizes: list, bytes_per_pack: int) -> list:
    """Leaves (by their sizes in bytes, in order) grouped into packs of about ``bytes_per_pack``.

    Leaves are never split: a pack takes leaves until it holds at least ``bytes_per_pack``
    bytes (the last pack may hold less), as TF's ``bytes_per_pack`` does.

    Args:
        sizes: each leaf's size in bytes.
        bytes_per_pack: the size a pack reaches before the next one starts.

    Returns:
        A list of packs, each a list of leaf positions.

    Example:
        >>> leaf_groups([28, 12, 16, 4], 20)
        [[0], [1, 2], [3]]
    """
    groups, current, held = [], [], 0
    for i, size in enumerate(sizes):
        current.append(i)
        held += size
        if held >= bytes_per_pack:
            groups.append(current)
            current, held = [], 0
    if current:
        groups.append(current)
    return groups


def packed_apply(leaves: list, combine, num_packs: int, bytes_per_pack: int = 0,
                 multiple_of: int = 1, pack_leaves_under: int = 0) -> list:
    """``combine`` applied to the leaves through packs: ``[combine_leaf(x) for x in leaves]``.

    Leaves are grouped by dtype (in order). With ``bytes_per_pack`` each group's leaves are
    packed whole into packs of about that many bytes (``leaf_groups``); otherwise each group
    is concatenated into one flat buffer and cut into ``num_packs`` chunks of (nearly) equal
    length, at most one per element; ``num_packs=0`` gives every leaf its own buffer, except
    that leaves of fewer than ``pack_leaves_under`` bytes share one (per dtype).
    ``combine`` gets each buffer flat, padded with zeros to a multiple of ``multiple_of``
    elements (reduce-scatters need that); empty buffers are not combined (a sum of nothing is
    nothing).

    Args:
        leaves: arrays (inside the replicas' program).
        combine: maps a flat 1-D buffer to a flat buffer of the same length and dtype.
        num_packs: chunks per dtype; 0 for no packing.
        bytes_per_pack: packs of about this many bytes when positive (whole leaves).
        multiple_of: pad every buffer ``combine`` gets to a multiple of this many elements.
        pack_leaves_under: with ``num_packs=0`` (and no ``bytes_per_pack``), leaves smaller
            than this many bytes are concatenated into one buffer per dtype.

    Returns:
        The combined leaves, with the leaves' shapes and dtypes.

    Example:
        >>> out = packed_apply([jnp.ones((2, 2)), jnp.arange(3.0)], lambda b: b * 2, num_packs=1)
        >>> out[0].tolist(), out[1].tolist()
        ([[2.0, 2.0], [2.0, 2.0]], [0.0, 2.0, 4.0])
    """
    leaves = [jnp.asarray(x) for x in leaves]
    groups: dict = {}
    for i, x in enumerate(leaves):
        groups.setdefault(x.dtype, []).append(i)
    out = [None] * len(leaves)
    for dtype, members in groups.items():
        if bytes_per_pack > 0:
            itemsize = jnp.dtype(dtype).itemsize
            packs = [[members[j] for j in group] for group in
                     leaf_groups([leaves[i].size * itemsize for i in members], bytes_per_pack)]
        elif num_packs == 0:
            packs = _small_leaves_together([leaves[i].size * jnp.dtype(dtype).itemsize
                                            for i in members], members, pack_leaves_under)
        else:
            packs = [members]
        for pack in packs:
            flat = _concatenated([leaves[i] for i in pack])
            if bytes_per_pack > 0 or num_packs == 0:
                flat = _padded_call(combine, flat, multiple_of)
            else:
                flat = _in_chunks(combine, flat, num_packs, multiple_of)
            start = 0
            for i in pack:
                x = leaves[i]
                out[i] = flat[start:start + x.size].reshape(x.shape)
                start += x.size
    return out


def _small_leaves_together(sizes: list, members: list, under: int) -> list:
    """Every leaf its own pack, except leaves of fewer than ``under`` bytes: one pack, placed
    where the first of them is."""
    packs, small = [], None
    for i, size in zip(members, sizes):
        if size >= under:
            packs.append([i])
        elif small is None:
            small = [i]
            packs.append(small)
        else:
            small.append(i)
    return packs


def _concatenated(leaves: list):
    if len(leaves) == 1:
        return leaves[0].ravel()
    return jnp.concatenate([x.ravel() for x in leaves])


def _in_chunks(combine, flat, chunks: int, multiple_of: int):
    total = flat.shape[0]
    chunks = min(chunks, max(total, 1))  # no empty packs
    bounds = [k * total // chunks for k in range(chunks + 1)]
    pieces = [_padded_call(combine, flat[bounds[k]:bounds[k + 1]], multiple_of)
              for k in range(chunks)]
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)


def _padded_call(combine, buf, multiple_of: int):
    size = buf.shape[0]
    if size == 0:
        return buf
    pad = -size % multiple_of
    if pad:
        buf = jnp.concatenate([buf, jnp.zeros((pad,), buf.dtype)])
    out = combine(buf)
    return out[:size] if pad else out
