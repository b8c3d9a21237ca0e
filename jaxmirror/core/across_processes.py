"""Placing values on the devices of several processes (a multi-worker strategy's mesh).

``jax.device_put`` of host data onto a sharding that spans processes checks that every process
gave the same value, with a collective of its own (``multihost_utils.assert_equal``): a worker
that calls it alone (TF's build-on-the-chief habit) hangs, and with one device per worker it
refuses arrays committed to the worker's own devices. TF instead broadcasts a variable's
initial value from the chief. So here each worker gives its own copy, the workers compare a
digest of them first (through the ledger the runtime registers, ``runtime/ledger.py``, which
names a worker that does not make the same call), and when the copies differ the chief's is
broadcast to every worker, bit for bit. Values that already span the workers are resharded by
a program.

Example:
    >>> import numpy as np
    >>> digest([np.arange(3.0)]) == digest([np.arange(3.0)]), digest([np.zeros(2)])[:8]
    (True, 'a450cd3f')
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxmirror.core import _compat

# How the workers agree on a digest: set by the runtime when this process joins a cluster;
# called as agree(description, digest) and returns every worker's digest.
_agreement = {"agree": None}


def agree_with(agree) -> None:
    """Register how the workers agree on what each places (the runtime's ledger).

    Args:
        agree: ``agree(description, digest) -> [digest of every worker]``, or ``None``.
    """
    _agreement["agree"] = agree


def digest(arrays: list) -> str:
    """A digest of host arrays' dtypes, shapes and bytes.

    Args:
        arrays: NumPy arrays.

    Returns:
        A hex string.
    """
    h = hashlib.sha1()
    for a in arrays:
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def put(value, sharding, replicated: bool, reshard):
    """``value`` (a nest) placed at ``sharding``, which spans several processes.

    Args:
        value: a nest of arrays, NumPy arrays and numbers.
        sharding: the target sharding.
        replicated: whether every device holds the whole value (then the workers agree on it,
            and the chief's copy wins where they differ).
        reshard: a function moving an array that spans the workers onto ``sharding``.

    Returns:
        The same nest, as ``jax.Array``s.
    """
    leaves, tree = jax.tree.flatten(value)
    out, host = list(leaves), {}
    for i, x in enumerate(leaves):
        if _compat.is_tracer(x):
            out[i] = jax.device_put(x, sharding)
        elif isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
            out[i] = x
        elif isinstance(x, jax.Array) and not x.is_fully_addressable:
            out[i] = reshard(x)
        else:
            array = np.asarray(x)
            host[i] = array.astype(jax.dtypes.canonicalize_dtype(array.dtype), copy=False)
    if host and replicated:
        host = _the_chiefs(host)
    for i, array in host.items():
        if isinstance(leaves[i], (bool, int, float, complex)) and replicated:
            out[i] = reshard(leaves[i] if array is None else array.item())  # weakly typed
        else:
            out[i] = jax.make_array_from_callback(array.shape, sharding,
                                                  lambda index, a=array: a[index])
    return jax.tree.unflatten(tree, out)


def _the_chiefs(host: dict) -> dict:
    """``host`` (leaf index -> array), with the chief's arrays where the workers' differ."""
    agree = _agreement["agree"]
    if agree is None:
        return host
    arrays = list(host.values())
    shapes = ", ".join(f"{a.dtype.name}{list(a.shape)}" for a in arrays[:8])
    shapes += ", ..." if len(arrays) > 8 else ""
    digests = agree(f"a value placed on every worker's devices ({shapes})", digest(arrays))
    if len(set(digests)) == 1:
        return host
    # Bit for bit: the bytes travel (a sum with the other workers' zeros), not the values.
    as_bytes = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]
    chiefs = multihost_utils.broadcast_one_to_all(as_bytes)
    return {i: np.asarray(b, np.uint8).view(a.dtype).reshape(a.shape)
            for (i, a), b in zip(host.items(), chiefs)}


__all__ = ["agree_with", "digest", "put"]
