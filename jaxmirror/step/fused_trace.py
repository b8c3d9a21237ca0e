"""Inside a fused step's trace: K steps of the user's function, the state carried between them.

``run_steps`` runs the first step as a plain step would (it finds the variables the step uses)
and the other K - 1 in a ``lax.scan`` whose carry holds those variables' values, the state of
the flax NNX objects among the arguments, the arguments the step returns updated
(``carry_argnums``), and the other arguments unchanged (so that what the step builds from them,
``nnx.merge`` of a passed state for instance, belongs to the scan's own trace).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxmirror.core import binding, context
from jaxmirror.step import graphs
from jaxmirror.step.replica_context import ReplicaContext


def run_steps(strategy, fn, element, counts, args, kwargs, carry_argnums: tuple):
    """The steps of ``fn`` on each entry of ``element``'s leading axis, in order (per replica,
    inside the step's trace).

    Args:
        strategy: the strategy being traced for.
        fn: the user's step function, ``fn(element, *args, **kwargs)``.
        element: this replica's elements, stacked along a new leading axis.
        counts: per element leaf, its ``(steps, replicas)`` row counts or ``None``.
        args: the other positional arguments (``args[i - 1]`` is ``fn``'s argument ``i``).
        kwargs: the keyword arguments.
        carry_argnums: positions of ``fn``'s arguments that it returns updated, as the first
            items of its result tuple, in this order.

    Returns:
        The updated arguments as the last step left them, then every other result stacked
        along a new leading axis (one entry per step); without ``carry_argnums``, ``fn``'s
        results stacked.
    """
    if not jax.tree.leaves(element):
        raise ValueError(f"function: with `steps_per_execution`, the elements must hold "
                         f"arrays (a batch); got {jax.tree.structure(element)}.")
    n_steps = len(jax.tree.leaves(element)[0])
    first = _step(strategy, fn, _entry(element, 0), _entry(counts, 0), args, kwargs,
                  carry_argnums)
    if not carry_argnums:
        _warn_if_state_returned(fn, args, first)
    if n_steps == 1:
        return _stacked_results(first, None, carry_argnums)
    outer = binding.current()
    carried = [s for s in outer.slots.values() if s.used or s.written]
    axis = strategy.extended.placement.axis_name
    # NNX objects among the arguments (merged in this trace, see graphs.merged_call) carry
    # their state from step to step; each step runs on objects merged from it.
    nodes = _graph_nodes((args, kwargs))
    graphdef, nnx_state = nnx.split(nodes) if nodes else (None, None)
    args = _with_updates(args, first, carry_argnums)
    leaves, tree = jax.tree.flatten((args, kwargs), is_leaf=graphs.is_graph_node)
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    slots = []  # the last trace of the body's slots, one per carried variable

    def body(carry, xs):
        values, state, passed = carry
        inner = binding.Frame(strategy, axis, discover=True)
        for s, value in zip(carried, values):
            inner.bind(s.var, value, s.mirrored)
        now = list(leaves)
        for i, x in zip(arrays, passed):
            now[i] = x
        if nodes:
            by_id = {id(old): new for old, new in zip(nodes, nnx.merge(graphdef, state))}
            now = [by_id.get(id(x), x) for x in now]
        a, k = jax.tree.unflatten(tree, now)
        with binding.pushed(inner):
            out = _step(strategy, fn, xs[0], xs[1], a, k, carry_argnums)
        if inner.discovered:
            raise ValueError(
                f"function: with `steps_per_execution`, the step used variable(s) "
                f"{[v.name for v in inner.discovered]} only after its first step; every step "
                f"must use the same variables.")
        slots[:] = [inner.slots[id(s.var)] for s in carried]
        new = [jnp.asarray(slot.value).astype(v.dtype) for slot, v in zip(slots, values)]
        a = _with_updates(a, out, carry_argnums)
        new_leaves = jax.tree.leaves((a, k), is_leaf=graphs.is_graph_node)
        new_passed = [jnp.asarray(new_leaves[i]).astype(x.dtype) for i, x in zip(arrays, passed)]
        new_state = nnx.state([by_id[id(x)] for x in nodes]) if nodes else None
        return (new, new_state, new_passed), (out[len(carry_argnums):] if carry_argnums else out)

    rest = jax.tree.map(lambda x: x[1:], (element, counts))
    init = ([jnp.asarray(s.value) for s in carried], nnx_state, [leaves[i] for i in arrays])
    (final, final_state, passed), ys = lax.scan(body, init, rest)
    for s, slot, value in zip(carried, slots, final):
        if slot.written:
            s.write(value, s.mirrored and slot.mirrored)
    if nodes:
        nnx.update(nodes, final_state)
    now = list(leaves)
    for i, x in zip(arrays, passed):
        now[i] = x
    last = jax.tree.unflatten(tree, now)[0]
    return _stacked_results(first, ys, carry_argnums, last)


def _step(strategy, fn, element, counts, args, kwargs, carry_argnums):
    """``fn`` on one element, in a replica context whose ``batch_mask`` is this element's;
    its results as arrays, checked against ``carry_argnums``."""
    axis = strategy.extended.placement.axis_name
    leaves = jax.tree.leaves(element)
    padded = tuple((leaf.shape[0] if leaf.ndim else None, c)
                   for leaf, c in zip(leaves, counts) if c is not None)
    ctx = ReplicaContext(strategy, axis_name=axis, padded_batches=padded)
    with context.pushed(context.Entry(strategy, ctx, in_run=True)):
        out = jax.tree.map(jnp.asarray, fn(element, *args, **kwargs))
    if carry_argnums:
        _check_carried(fn, args, out, carry_argnums)
        return tuple(out)
    return out


def _check_carried(fn, args, out, carry_argnums) -> None:
    name = getattr(fn, "__name__", "the step")
    if not isinstance(out, (tuple, list)) or len(out) < len(carry_argnums):
        raise ValueError(
            f"{name}: with `carry_argnums={carry_argnums}` the step must return a tuple whose "
            f"first {len(carry_argnums)} items are those arguments updated (e.g. `return "
            f"params, opt_state, loss`); it returned {type(out).__name__}.")
    for j, i in enumerate(carry_argnums):
        want, got = _avals(args[i - 1]), _avals(out[j])
        if got != want:
            raise ValueError(
                f"{name}: with `carry_argnums`, result {j} must be argument {i} updated, with "
                f"its structure, shapes and dtypes; got {got[0]} {got[1]}, expected "
                f"{want[0]} {want[1]}.")


def _avals(tree):
    """``tree``'s structure and each leaf's shape and dtype: equal for values that a scan
    could carry one as the other."""
    leaves, structure = jax.tree.flatten(tree)
    return structure, [(jnp.shape(x), jnp.result_type(x)) for x in leaves]


def _warn_if_state_returned(fn, args, out) -> None:
    """A step that returns an argument's new value (``params, loss = step(batch, params)``)
    would start every fused step from the passed one, silently: say so once per trace."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    outs = [_avals(o) for o in items]
    for i, a in enumerate(args, 1):
        if not any(isinstance(x, jax.Array) and x.ndim for x in jax.tree.leaves(a)):
            continue  # scalars (a learning rate) look like a loss, not like state
        if _avals(a) in outs:
            warnings.warn(
                f"function: `{getattr(fn, '__name__', 'the step')}` returns a value shaped as "
                f"its argument {i}; with `steps_per_execution` every step starts from the "
                f"arguments of the call, so if that is new state (params, optimizer state, a "
                f"key), pass `carry_argnums=({i},)` and return it first, or keep it in "
                f"jaxmirror Variables or NNX objects.", stacklevel=2)
            return


def _with_updates(args, out, carry_argnums):
    """``args`` with the carried positions replaced by the step's results."""
    if not carry_argnums:
        return args
    args = list(args)
    for j, i in enumerate(carry_argnums):
        args[i - 1] = out[j]
    return tuple(args)


def _stacked_results(first, ys, carry_argnums, last=None):
    """The results as the fused step returns them: carried arguments as the last step left
    them, the others stacked along a new leading axis."""
    c = len(carry_argnums)
    rest = first[c:] if c else first
    if ys is None:
        stacked = jax.tree.map(lambda x: x[None], rest)
    else:
        stacked = jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), rest, ys)
    if not c:
        return stacked
    carried = tuple(first[:c]) if last is None else tuple(last[i - 1] for i in carry_argnums)
    return carried + tuple(stacked)


def _graph_nodes(tree) -> list:
    """The distinct NNX objects in ``tree``, in order."""
    seen, nodes = set(), []
    for x in jax.tree.leaves(tree, is_leaf=graphs.is_graph_node):
        if graphs.is_graph_node(x) and id(x) not in seen:
            seen.add(id(x))
            nodes.append(x)
    return nodes


def _entry(tree, i: int):
    return jax.tree.map(lambda x: x[i], tree)


__all__ = ["run_steps"]
