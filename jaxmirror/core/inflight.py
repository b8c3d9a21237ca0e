"""A bound on steps queued on CPU devices without waiting.

XLA's CPU collectives abort (rendezvous termination, SIGABRT) when ~32 or more collective steps
are queued and nobody waits. TF users never had to sync in their loops, so neither do ours: on
CPU, once ``MAX_IN_FLIGHT`` steps are queued, ``run`` waits for the oldest before returning
(and so do ``reduce`` and ``gather``, which run collectives too). GPU runtimes queue safely and
are left alone; one device has no collectives to deadlock.
"""

from __future__ import annotations

import collections

import jax

from jaxmirror.core import _compat

MAX_IN_FLIGHT = 8
_queue: collections.deque = collections.deque()
# Other outputs of the last step tracked (the sums ``reduce`` returns of its results,
# ``track_array``'s ``also``): counting one of them again would count that step twice.
_also: tuple = ()


def needs_bound(devices) -> bool:
    """Whether steps on ``devices`` must be bounded: several devices, some of them CPUs.

    Args:
        devices: a strategy's devices.

    Returns:
        A bool.

    Example:
        >>> import jax
        >>> needs_bound(jax.devices("cpu")[:2]), needs_bound(jax.devices("cpu")[:1])
        (True, False)
    """
    return len(devices) > 1 and any(d.platform == "cpu" for d in devices)


def track_array(x, also: tuple = ()) -> None:
    """Remember one output array of a step just dispatched; wait on the oldest past the bound.

    One array per step is enough: an XLA CPU execution makes all its outputs ready at once.

    Args:
        x: an output array of the step, or ``None`` (nothing dispatched).
        also: other outputs of the same step that ``tracked`` may be given next (the sums
            ``strategy.reduce`` returns of its small results): not counted again.
    """
    global _also
    if x is None or isinstance(x, _compat.Tracer):  # on the hot path: no call
        return  # no array, or a step traced inside the user's own jit/scan: nothing dispatched
    _also = also
    _queue.append(x)
    if len(_queue) > MAX_IN_FLIGHT:
        _wait(_queue.popleft())


def tracked(placement, outputs):
    """``outputs``, counted against the bound when ``placement`` needs one (its last array leaf).

    Args:
        placement: the strategy's ``Placement``.
        outputs: what a cross-replica computation returned (host values are ignored).

    Returns:
        ``outputs``.
    """
    if not placement.bound_in_flight:
        return outputs
    if isinstance(outputs, jax.Array):  # one array (a reduce): no flattening
        last = outputs
    else:
        leaves = [x for x in jax.tree.leaves(outputs) if isinstance(x, jax.Array)]
        last = leaves[-1] if leaves else None
    if last is None:
        return outputs
    for x in _also:  # the last step's own output (a sum made in the step): counted with it
        if last is x:
            return outputs
    track_array(last)
    return outputs


def queued() -> tuple:
    """The arrays tracked now, oldest first: one per step in flight (for tests and diagnostics).

    Returns:
        A tuple of at most ``MAX_IN_FLIGHT`` arrays.

    Example:
        >>> import jax.numpy as jnp
        >>> drain()
        >>> x = jnp.ones(2)
        >>> track_array(x)
        >>> queued() == (x,)
        True
        >>> drain()
        >>> queued()
        ()
    """
    return tuple(_queue)


def drain() -> None:
    """Wait for every tracked step (tests and benchmarks start from an empty queue)."""
    global _also
    _also = ()
    while _queue:
        _wait(_queue.popleft())


def _wait(x) -> None:
    """Wait for a tracked step; its failure is not this caller's to raise.

    A step that failed at run time reports its error through its own results (and its writes
    are rolled back by the variables' state); raising it here would raise it from a later,
    unrelated call.
    """
    if x.is_deleted():  # donated into a later step, which ran after it
        return
    try:
        x.block_until_ready()
    except Exception:  # noqa: BLE001 - see the docstring
        pass
