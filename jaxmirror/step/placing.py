"""Putting user trees on a strategy's devices: replicated once, built there, or moved on demand.

``run`` takes Mirrored values as arrays replicated over the strategy's devices. Arrays made
elsewhere (a model initialized on the default device, a checkpoint restored outside a scope,
an optimizer's ``count``) either make ``jax.jit`` refuse the call (committed to other devices)
or cost a second compilation once the step's replicated outputs come back in their place.
``replicate`` places a tree once; ``build_replicated`` builds it straight on the devices (no copy
on one device first); ``mirror_misplaced`` is what ``run`` does, as TF does, with arrays it
was given on other devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmirror.core.values import PerReplica, is_distributed
from jaxmirror.step.graphs import is_graph_node


def _misplaced(x, placement) -> bool:
    # Uncommitted arrays (made without a device) go wherever jax.jit puts them.
    return (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.committed
            and x.sharding.device_set != placement.device_set)


def replicate(placement, tree):
    """``tree`` with every array replicated over the strategy's devices.

    NNX objects in it are updated in place (their ``nnx.Variable``s get the placed arrays) and
    returned; other arrays are returned placed; distributed values are left as they are. The
    placed arrays never share a buffer with the given ones, so donating them to a step leaves
    the caller's arrays alive.

    Args:
        placement: the strategy's ``Placement``.
        tree: a pytree of arrays and NNX objects.

    Returns:
        The same structure, placed.
    """
    def place(x):
        if is_graph_node(x):
            nnx.update(x, placement.store(nnx.state(x), owned=True))
            return x
        if isinstance(x, jax.Array) or (hasattr(x, "__array__") and not is_distributed(x)):
            return placement.store(x, owned=True)
        return x

    return jax.tree.map(place, tree, is_leaf=lambda x: is_graph_node(x) or is_distributed(x))


def build_replicated(placement, fn, args, kwargs):
    """``fn(*args, **kwargs)`` computed by one program whose outputs are replicated over the
    strategy's devices (NNX objects it returns come back built on them).

    Args:
        placement: the strategy's ``Placement``.
        fn: builds the tree (a model, an optimizer, their state).
        args: positional arguments of ``fn`` (arrays or static Python values).
        kwargs: keyword arguments of ``fn``.

    Returns:
        What ``fn`` returns, placed.
    """
    built = {}

    def pure():
        out = fn(*args, **kwargs)
        leaves, tree = jax.tree.flatten(out, is_leaf=is_graph_node)
        positions = tuple(i for i, x in enumerate(leaves) if is_graph_node(x))
        graphdef, state = nnx.split([leaves[i] for i in positions])
        built.update(tree=tree, positions=positions, graphdef=graphdef, n=len(leaves))
        return state, [x for i, x in enumerate(leaves) if i not in positions]

    state, others = jax.jit(pure, out_shardings=placement.storage_sharding)()
    nodes = dict(zip(built["positions"], nnx.merge(built["graphdef"], state)))
    rest = iter(others)
    leaves = [nodes[i] if i in nodes else next(rest) for i in range(built["n"])]
    return jax.tree.unflatten(built["tree"], leaves)


def mirror_misplaced(placement, args, kwargs, donate_argnums: tuple = ()):
    """The arguments with arrays on other devices than the strategy's replicated over them.

    A copy that a step donates is made in new buffers: ``jax.device_put`` would reuse the
    buffer the array already has on one of the strategy's devices, and donating the copy would
    delete the caller's array too.

    Args:
        placement: the strategy's ``Placement``.
        args: a step's positional arguments.
        kwargs: its keyword arguments.
        donate_argnums: the positions of ``args`` the step donates.

    Returns:
        ``(args, kwargs, names)``: ``names`` lists the arguments moved (empty: nothing was).

    Raises:
        ValueError: for a ``PerReplica`` of another strategy (its components elsewhere).
    """
    pairs, tree = jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=is_distributed)
    names, leaves = [], []
    for path, x in pairs:
        if isinstance(x, PerReplica):
            _check_components(x, placement, _argument(path))
        elif _misplaced(x, placement):
            names.append(_argument(path))
            donated = path[0].idx == 0 and path[1].idx in donate_argnums
            x = placement.replicate(jnp.copy(x) if donated else x)
        leaves.append(x)
    args, kwargs = jax.tree.unflatten(tree, leaves)
    return args, kwargs, names


def _check_components(x, placement, name: str) -> None:
    stacked = x.stacked
    if isinstance(stacked, jax.core.Tracer) or not isinstance(stacked, jax.Array):
        return
    if (stacked.shape[0] != placement.num_replicas
            or stacked.sharding.device_set != placement.device_set):
        raise ValueError(
            f"run: {name} is a PerReplica with {stacked.shape[0]} components on "
            f"{sorted(d.id for d in stacked.sharding.device_set)}, but this strategy has "
            f"{placement.num_replicas} replicas on devices "
            f"{sorted(d.id for d in placement.device_set)}: a value of another strategy; make "
            f"it with this strategy (its experimental_distribute_dataset or "
            f"experimental_distribute_values_from_function), or reduce it there first."
        )


def _argument(path) -> str:
    head, rest = path[0], path[1:]
    return ("args" if head.idx == 0 else "kwargs") + jax.tree_util.keystr(rest)


__all__ = ["build_replicated", "mirror_misplaced", "replicate"]
