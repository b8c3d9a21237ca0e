"""flax NNX objects (modules, optimizers, anything with ``nnx.Variable``s) as arguments of ``run``.

NNX objects are mutable: ``nnx.jit`` splits them into a static graph definition and an
``nnx.State`` of arrays, runs the function on objects merged back from them, and updates the
caller's objects with the state they end with. A step does the same (``split_arguments``,
``merged_call``, ``update``): updates a step makes (an optimizer's ``update``, BatchNorm's
statistics, an RNG's count) are visible afterwards, as with ``nnx.jit``. The state's arrays go
in replicated (placed once here, so a model built on one device neither fails nor compiles
twice) and come back Mirrored, or ``PerReplica`` where the replicas made them differ.

Splitting walks the objects' graph on every call, as ``nnx.jit`` does; a step that takes
``nnx.State`` (``graphdef, state = nnx.split(model)`` once, ``nnx.merge`` inside) skips that.
"""

from __future__ import annotations

import jax
from flax import nnx
from flax.nnx import graphlib

from jaxmirror.core import _compat, context
from jaxmirror.core.values import is_distributed


class GraphArguments(Exception):
    """Raised out of a trace that met NNX objects among the step's arguments; ``run`` then
    passes them as graph definition and state (``split_arguments``) from that call on."""


def is_graph_node(x) -> bool:
    """Whether ``x`` is an NNX object (a module, an optimizer, ``nnx.Rngs``...).

    Args:
        x: anything.

    Returns:
        True for flax NNX graph nodes other than a bare ``nnx.Variable`` (an ``nnx.State``
        holds those: a step takes them as the pytrees they are).

    Example:
        >>> from flax import nnx
        >>> is_graph_node(nnx.Linear(2, 1, rngs=nnx.Rngs(0))), is_graph_node({"w": 1})
        (True, False)
    """
    return graphlib.is_graph_node(x) and not isinstance(x, nnx.Variable)


def _graph_or_distributed(x) -> bool:
    return is_distributed(x) or is_graph_node(x)


def has_graph_nodes(tree) -> bool:
    """Whether ``tree`` holds NNX objects (checked once per traced signature)."""
    return any(map(is_graph_node, jax.tree.leaves(tree, is_leaf=_graph_or_distributed)))


def split_arguments(args, kwargs, placement):
    """The arguments as ``(key, state, nodes, others)``: NNX objects split together.

    Args:
        args: the step's positional arguments.
        kwargs: its keyword arguments.
        placement: the strategy's ``Placement``; state arrays not on all its devices are
            replicated onto them.

    Returns:
        ``key``: ``(structure, positions of the NNX objects, their GraphDef)`` (hashable);
        ``state``: their ``nnx.State``; ``nodes``: the objects; ``others``: the other leaves.
    """
    leaves, tree = jax.tree.flatten((args, kwargs), is_leaf=_graph_or_distributed)
    positions = tuple(i for i, x in enumerate(leaves) if is_graph_node(x))
    nodes = [leaves[i] for i in positions]
    if not _compat.trace_state_clean():  # the objects could not be updated out of that trace
        raise RuntimeError(
            "a step given flax NNX objects was called inside jax.jit, nnx.jit or another JAX "
            "transformation (TF's @tf.function around a distributed step): the step is "
            "compiled already, and the objects' updates cannot leave the outer trace; call the "
            "step directly (drop the outer jit), or pass nnx.state(...) arrays instead.")
    graphdef, state = nnx.split(nodes)  # one split: objects shared between arguments stay shared
    state = jax.tree.map(lambda x: _on_devices(x, placement), state, is_leaf=is_distributed)
    taken = set(positions)
    others = [x for i, x in enumerate(leaves) if i not in taken]
    return (tree, positions, graphdef), state, nodes, others


def _on_devices(x, placement):
    if isinstance(x, jax.Array) and x.sharding.device_set != placement.device_set:
        return placement.replicate(x)
    return x


def merged_call(fn, key, state, others):
    """``fn`` called on NNX objects merged from ``state`` (inside the step's trace).

    Each replica draws its own random numbers (dropout masks differ across replicas, as the
    rows of one device's batch would): the replica id is folded into every ``nnx.Rngs`` key for
    the call, and the stored keys stay the same on every replica.

    Args:
        fn: the user's step function.
        key: as ``split_arguments`` gave it.
        state: the (traced) state.
        others: the other (traced) leaves.

    Returns:
        ``(fn's result, the objects' state after the call)``.

    Raises:
        ValueError: when ``fn`` changed the objects' structure or static attributes
            (``model.eval()``), which a step cannot carry out of its program.
    """
    tree, positions, graphdef = key
    nodes = nnx.merge(graphdef, state)
    leaves, rest = [], iter(others)
    slots = dict(zip(positions, nodes))
    for i in range(len(positions) + len(others)):
        leaves.append(slots[i] if i in slots else next(rest))
    args, kwargs = jax.tree.unflatten(tree, leaves)
    ctx = context.current().replica_context
    keys = [v for _, v in nnx.iter_graph(nodes) if isinstance(v, nnx.RngKey)]
    stored = [v[...] for v in keys]
    if ctx is not None and ctx.num_replicas_in_sync > 1:
        for v, k in zip(keys, stored):
            v.set_value(jax.random.fold_in(k, ctx.replica_id_in_sync_group))
    out = fn(*args, **kwargs)
    for v, k in zip(keys, stored):
        v.set_value(k)  # the count moved on; the key stays the one every replica shares
    new_graphdef, new_state = nnx.split(nodes)
    if new_graphdef != graphdef and not _carried_by_update(graphdef, state, new_graphdef,
                                                           new_state):
        raise ValueError(
            "run: the step changed the NNX objects passed to it beyond their state (a static "
            "attribute such as `model.eval()`/`model.train()` set, or a submodule added or "
            "removed); a compiled step carries only their state out; do that outside the "
            "step, before calling it."
        )
    return out, new_state


def _carried_by_update(graphdef, state, new_graphdef, new_state) -> bool:
    # New variables (``sow``n intermediates) reach the caller's objects through nnx.update;
    # static attributes (``model.eval()``) do not. Tried once, at trace time, on a copy.
    probe = nnx.merge(graphdef, state)
    nnx.update(probe, new_state)
    return nnx.graphdef(probe) == new_graphdef


def update(nodes, state) -> None:
    """Write the state a step ended with into the caller's NNX objects (``nnx.update``).

    Args:
        nodes: the objects ``split_arguments`` split.
        state: the step's new state for them.
    """
    nnx.update(nodes, state)


__all__ = ["GraphArguments", "has_graph_nodes", "is_graph_node", "merged_call",
           "split_arguments", "update"]
