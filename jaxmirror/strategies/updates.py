"""``StrategyExtended.reduce_to``, ``batch_reduce_to`` and ``update``.

The TF recipe for updating a distributed variable: reduce the per-replica updates to the
variable's devices (``reduce_to``), then apply a function to each of its components
(``update``). Both work eagerly and inside a ``merge_fn`` (traced in the step's program); in a
replica context ``update`` goes through ``merge_call`` first, as in TF.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxmirror.core import _compat, binding, context
from jaxmirror.core import devices as devices_lib
from jaxmirror.core.reduce_op import reduce_op_of
from jaxmirror.core.stateful import is_opaque
from jaxmirror.core.values import (DistributedValues, GatheredPerReplica, Mirrored, PerReplica,
                                   components, is_distributed)
from jaxmirror.step import cross_replica
from jaxmirror.step.replica_context import this_replica
from jaxmirror.variables.trees import read_values
from jaxmirror.variables import state as states
from jaxmirror.variables.state import state_of, write_back
from jaxmirror.variables.variable import Variable, state_from_components


# -- reduce_to / batch_reduce_to ------------------------------------------------------------------
def _check_destinations(destinations) -> None:
    if destinations is None or (isinstance(destinations, (str, tuple, list)) and not destinations):
        # TF's wording, on purpose.
        raise ValueError(f"destinations can not be empty; got {destinations!r}. Pass a variable, "
                         f"a distributed value, an array or a device string.")
    if not isinstance(destinations, (Variable, DistributedValues, jax.Array, str, jax.Device)):
        raise ValueError(f"reduce_to: `destinations` must be a variable, a distributed value, an "
                         f"array or a device string; got {type(destinations).__name__}.")


def _placement(strategy, destinations):
    """The sharding a reduced value takes at ``destinations`` (eager only)."""
    ext = strategy.extended
    if isinstance(destinations, Variable):
        destinations.check_usable_in(strategy)
        state = state_of(destinations)
        if isinstance(state, PerReplica):
            return ext.replicated_sharding
        if is_distributed(destinations) and strategy.num_replicas_in_sync > 1:
            return ext.placement.storage_sharding  # replicated, or the parameter device
        return state.sharding if isinstance(state, jax.Array) else None
    if isinstance(destinations, DistributedValues):
        return ext.replicated_sharding if strategy.num_replicas_in_sync > 1 else ext.devices[0]
    if isinstance(destinations, jax.Array):
        return destinations.sharding
    return devices_lib.resolve(destinations, "reduce_to", "destinations")


def reduce_to(strategy, reduce_op, value, destinations, options=None):
    """``StrategyExtended.reduce_to`` (see there)."""
    return batch_reduce_to(strategy, reduce_op, [(value, destinations)], options,
                           method="reduce_to")[0]


def batch_reduce_to(strategy, reduce_op, value_destination_pairs, options=None,
                    method: str = "batch_reduce_to"):
    """``StrategyExtended.batch_reduce_to`` (see there): every pair's sums in one program."""
    if not isinstance(value_destination_pairs, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 for p in value_destination_pairs):
        raise ValueError(f"batch_reduce_to: `value_destination_pairs` must be a list or tuple of "
                         f"(value, destinations) pairs; got {value_destination_pairs!r}.")
    op = reduce_op_of(reduce_op)
    for _, destinations in value_destination_pairs:
        _check_destinations(destinations)
    results = cross_replica.reduce(strategy, op, [v for v, _ in value_destination_pairs], None,
                                   method=method, options=options)
    if any(_compat.is_tracer(x) for x in jax.tree.leaves(results)):
        return results  # inside a merge_fn: every replica holds the results already
    return [_placed_at(result, _placement(strategy, destinations))
            for result, (_, destinations) in zip(results, value_destination_pairs)]


def _placed_at(tree, target):
    """``tree`` put at ``target`` (a sharding or a device; ``None``: where it is)."""
    if target is None:
        return tree

    def leaf(x):
        if isinstance(target, jax.Device) and isinstance(x, jax.Array) and x.is_fully_replicated:
            # A copy is already there; across processes the whole array is not this
            # process's to move, but its copy on a local device is.
            for shard in x.addressable_shards:
                if shard.device == target:
                    return shard.data
        return jax.device_put(x, target)

    return jax.tree.map(leaf, tree)


def broadcast_to(strategy, tensor, destinations):
    """``StrategyExtended.broadcast_to`` (see there)."""
    _check_destinations(destinations)
    return _placed_at(jax.numpy.asarray(tensor), _placement(strategy, destinations))


# -- update -----------------------------------------------------------------------------------
def _check_update_args(strategy, var, fn, args, kwargs):
    if not isinstance(var, Variable):
        raise ValueError(f"update: `var` must be a jaxmirror Variable; got {type(var).__name__}.")
    var.check_usable_in(strategy)
    if not callable(fn):
        raise TypeError(f"update: `fn` must be callable; got {fn!r}.")
    if not isinstance(args, (list, tuple)):
        raise ValueError(f"update: positional args must be a list or tuple, got {type(args)}.")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(f"update: kwargs must be a dict, got {type(kwargs)}.")
    if var.single_copy and any(isinstance(x, (PerReplica, GatheredPerReplica)) for x in
                               jax.tree.leaves((args, kwargs), is_leaf=is_opaque)):
        raise ValueError(
            f"update: {var.name!r} is stored once, on the parameter device, so it cannot take "
            f"per-replica values (one per replica); reduce them first, e.g. "
            f"strategy.extended.reduce_to('mean', value, destinations=var).")


def update(strategy, var, fn, args=(), kwargs=None, group=True):
    """``StrategyExtended.update`` (see there)."""
    _check_update_args(strategy, var, fn, args, kwargs)
    kwargs = kwargs or {}
    entry = context.current()
    if entry.replica_context is not None and entry.in_run:
        # TF: in a replica context, update is a merge_call that updates in cross-replica context.
        return entry.replica_context.merge_call(
            lambda s, *a, **k: update(s, var, fn, a, k, group), args=args, kwargs=kwargs)
    frame = binding.current()
    if frame is not None and frame.discover:
        return _traced_update(strategy, frame, var, fn, args, kwargs, group)
    with states.lock:  # a read-modify-write of the variables, as a step's is
        return _eager_update(strategy, var, fn, args, kwargs, group)


def _variables_in(tree) -> list:
    found = []
    for x in jax.tree.leaves(tree, is_leaf=is_opaque):
        if isinstance(x, Variable) and all(x is not f for f in found):
            found.append(x)
    return found


def _traced_update(strategy, frame, var, fn, args, kwargs, group):
    """``update`` inside a ``merge_fn``: one SPMD call of ``fn`` updates every component."""
    varying = any(isinstance(x, PerReplica)
                  for x in jax.tree.leaves((args, kwargs), is_leaf=is_opaque))
    args, kwargs = jax.tree.map(lambda x: this_replica(x, frame.axis_name), (tuple(args), kwargs),
                                is_leaf=is_opaque)
    slots = [frame.lookup(v) for v in _variables_in((var, args, kwargs))]
    with binding.updating(slots, mirrored=not varying):
        result = fn(var, *args, **kwargs)
        result = read_values(result)
    n = frame.num_replicas
    if n == 1:
        return result
    same = not varying and all(s.mirrored for s in slots)
    merged = jax.tree.map(
        lambda x: Mirrored(x, n) if same else GatheredPerReplica(x, frame.axis_name), result)
    return merged if group else strategy.experimental_local_results(merged)


def _eager_update(strategy, var, fn, args, kwargs, group):
    """``update`` outside ``run``: ``fn`` on the components, written back if every call succeeds."""
    n = strategy.num_replicas_in_sync if is_distributed(var) else 1
    variables = _variables_in((var, args, kwargs))
    for v in variables:
        states.settle(v)
    per_replica = [x for x in jax.tree.leaves((args, kwargs), is_leaf=is_opaque)
                   if isinstance(x, PerReplica)]
    if n > 1 and (per_replica or any(v.stored_per_replica for v in variables)):
        rounds = range(n)  # components differ: TF's loop over the devices
    else:
        rounds = [None]  # every component is the same: one call covers them all
    written: dict = {}
    results = []
    for i in rounds:
        # A variable ``fn`` reaches by closure is bound too, so its write waits like the others.
        frame = binding.Frame(strategy, None, discover=False,
                              adopt=lambda v, i=i: _component(states.settled(v), i))
        for v in variables:
            state = state_of(v)
            frame.bind(v, components(state.stacked)[i] if isinstance(state, PerReplica) else state,
                       mirrored=i is None)
        a, k = jax.tree.map(lambda x: _component(x, i), (tuple(args), kwargs), is_leaf=is_opaque)
        with binding.pushed(frame), binding.updating(list(frame.slots.values()), mirrored=True):
            out = fn(var, *a, **k)
            results.append(read_values(out))
        for slot in frame.written():
            written.setdefault(id(slot.var), (slot.var, []))[1].append(slot.value)
    for v, values in written.values():
        if any(_compat.is_tracer(x) for x in values):
            raise ValueError(
                f"update: `fn` wrote a traced value to variable {v.name!r}: `update` was called "
                f"inside jax.jit/jax.grad, where its writes would be lost; call it outside, or "
                f"inside `run`'s step."
            )
    # All calls succeeded: now write.
    variables = [v for v, _ in written.values()]
    write_back(variables, {i: state_from_components(v, values)
                           for i, (v, values) in enumerate(written.values())})
    placement = strategy.extended.placement
    if rounds == [None]:
        result = results[0]
        if n > 1 and group:
            return jax.tree.map(lambda x: Mirrored(placement.replicate(x), n), result)
        return result if group else tuple([result] * max(n, 1))
    stacked = jax.tree.map(lambda *xs: placement.stack_components([np.asarray(x) for x in xs]),
                           *results)
    return stacked if group else tuple(results)


def _component(x, i):
    if isinstance(x, PerReplica):
        return components(x.stacked)[0 if i is None else i]
    if isinstance(x, Mirrored):
        return x.value
    return x
