"""Fused steps: ``steps_per_execution`` steps of a step function in one compiled program.

TF runs several steps per ``tf.function`` call by looping over ``next(iterator)`` inside it
(Keras: ``steps_per_execution``). Here ``strategy.function(fn, steps_per_execution=K)`` makes a
``FusedStep``: each call takes the next K elements of an iterator and runs ``fn`` on them, one
after the other, in one dispatch. The first step is traced as a plain step (which finds the
variables it uses); the other K - 1 run in a ``lax.scan`` that carries those variables' values,
so the program's size does not grow with K. Results are those of K single steps, stacked
along a new leading axis.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxmirror.core import binding, context
from jaxmirror.core.values import PerReplica, is_per_replica
from jaxmirror.step import graphs
from jaxmirror.step.replica_context import ReplicaContext


class FusedStep:
    """``fn`` run ``steps_per_execution`` times per call, in one compiled program.

    Call it as ``step(iterator, *args, **kwargs)``: it takes the next K elements of
    ``iterator`` (e.g. ``iter(strategy.experimental_distribute_dataset(ds))``) and runs
    ``fn(element, *args, **kwargs)`` for each, in order, as K calls of
    ``strategy.function(fn)`` would: variables carry over from step to step; other arguments
    are the same for every step. Each result leaf comes back with a new leading axis of
    length K, one entry per step (a per-replica loss becomes a ``PerReplica`` of shape
    ``(K,)`` per replica, so ``strategy.reduce("SUM", losses, axis=None)`` gives each step's
    sum). Near the end of the data a call takes the elements that are left (a program for
    that count is built once); with none left it raises ``StopIteration``.

    State that changes from step to step must live in ``jaxmirror.Variable``s (read and
    assigned in ``fn``, as in TF) or in flax NNX objects passed as arguments (a model, an
    ``nnx.Optimizer``: updated as after K calls); arrays passed as arguments are inputs of
    every step, not carried. Per-row results of a padded batch come back padded (no row
    counts).

    Args:
        strategy: the strategy whose replicas run the steps.
        fn: the per-replica step function, ``fn(element, *args, **kwargs)``.
        steps: how many steps one call runs (``steps_per_execution``).
        compile_fn: ``compile_fn(function, donate_argnums)`` gives the ``Program`` of a
            per-replica function (the strategy's program cache).
        donate_argnums: positions of ``fn``'s arguments (not 0, the element) whose buffers the
            results may reuse.

    Example:
        >>> import numpy as np, jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with s.scope():
        ...     total = jaxmirror.Variable(0.0)
        >>> def step(x):
        ...     total.assign_add(jaxmirror.get_replica_context().all_reduce("sum", x.sum()))
        ...     return total.read_value()
        >>> steps = s.function(step, steps_per_execution=3)
        >>> it = iter(s.experimental_distribute_dataset([np.ones(4)] * 3))
        >>> steps(it).tolist(), float(total.numpy())
        ([4.0, 8.0, 12.0], 12.0)
    """

    def __init__(self, strategy, fn, steps: int, compile_fn, donate_argnums=()):
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"function: `steps_per_execution` must be an int >= 1; got "
                             f"{steps!r}.")
        if 0 in donate_argnums:
            raise ValueError("function: with `steps_per_execution`, argument 0 is the element "
                             "taken from the iterator, which cannot be donated; donate params "
                             "and optimizer state.")
        self._strategy = strategy
        self._fn = fn
        self._steps = steps
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

        def fused(element, counts, *args, **kwargs):
            return _run_steps(strategy, fn, element, counts, args, kwargs)

        def fused_each(elements, counts, *args, **kwargs):
            return _run_steps(strategy, fn, _stacked(elements), _stacked(counts), args, kwargs)

        fused.__name__ = fused_each.__name__ = self.__name__
        # The program cache keeps a program as long as its function lives: these do.
        self._functions = (fused, fused_each)
        donated = tuple(i + 1 for i in donate_argnums)
        # Elements stacked on the host and moved in one transfer, or moved one by one (a
        # dataset iterated on a thread, any other iterator) and stacked in the program.
        self._stacked = compile_fn(fused, donated)
        self._each = compile_fn(fused_each, donated)

    @property
    def steps_per_execution(self) -> int:
        """How many steps one call runs."""
        return self._steps

    @property
    def fn(self):
        """The user's per-replica step function."""
        return self._fn

    @property
    def trace_count(self) -> int:
        """How often a fused function was traced (each trace runs ``fn``'s Python twice)."""
        return self._stacked.trace_count + self._each.trace_count

    @property
    def compile_count(self) -> int:
        """How often a program was built (one per number of steps per call, and placement)."""
        return self._stacked.compile_count + self._each.compile_count

    def __call__(self, iterator, *args, **kwargs):
        program, element, counts = self._take(iterator)
        return program(element, counts, *args, **kwargs)

    def lower(self, iterator, *args, **kwargs):
        """The program for the next elements of ``iterator`` (which it consumes), lowered.

        Returns:
            A ``jax.stages.Lowered``.
        """
        program, element, counts = self._take(iterator)
        return program.lower(element, counts, *args, **kwargs)

    def _take(self, iterator):
        """``(program, element(s), counts)`` for the next elements of ``iterator``."""
        take = getattr(iterator, "take_stacked", None)
        if take is not None:
            taken = take(self._steps)
        else:
            taken = ("each", list(itertools.islice(_iterator(iterator), self._steps)))
        if taken[0] == "stacked":
            return self._stacked, taken[1], taken[2]
        elements = taken[1]
        if not elements:
            raise StopIteration(f"{self.__name__}: the iterator is exhausted.")
        stripped, counts = zip(*map(_without_counts, elements))
        _check_same_shapes(stripped, self.__name__)
        return self._each, tuple(stripped), tuple(counts)

    def __repr__(self) -> str:
        return (f"<jaxmirror fused step {self.__name__} x{self._steps} on "
                f"{self._strategy!r}>")


def _iterator(iterator):
    if not hasattr(iterator, "__next__"):
        raise TypeError(
            f"function: a step with `steps_per_execution` takes an iterator as its first "
            f"argument (e.g. iter(strategy.experimental_distribute_dataset(ds))); got "
            f"{type(iterator).__name__}."
        )
    return iterator


def _without_counts(element):
    """``(element without row counts, each leaf's row counts or None)``: a batch's counts
    become the program's explicit per-step inputs."""
    leaves, tree = jax.tree.flatten(element, is_leaf=is_per_replica)
    counts = tuple(x.row_counts if is_per_replica(x) else None for x in leaves)
    if not any(c is not None for c in counts):
        return element, ()
    plain = [PerReplica(x.stacked) if is_per_replica(x) else x for x in leaves]
    return jax.tree.unflatten(tree, plain), counts


def _one_step(strategy, fn, element, counts, args, kwargs):
    """``fn`` on one element, in a replica context whose ``batch_mask`` is this element's."""
    axis = strategy.extended.placement.axis_name
    leaves = jax.tree.leaves(element)
    padded = tuple((leaf.shape[0] if leaf.ndim else None, c)
                   for leaf, c in zip(leaves, counts) if c is not None)
    ctx = ReplicaContext(strategy, axis_name=axis, padded_batches=padded)
    with context.pushed(context.Entry(strategy, ctx, in_run=True)):
        return fn(element, *args, **kwargs)


def _run_steps(strategy, fn, element, counts, args, kwargs):
    """Inside the step's trace (per replica): the step on each entry of ``element``'s leading
    axis in turn (the first plainly, the others in a scan), results stacked."""
    first = _as_arrays(_one_step(strategy, fn, _entry(element, 0), _entry(counts, 0),
                                 args, kwargs))
    if len(jax.tree.leaves(element)[0]) == 1:
        return jax.tree.map(lambda x: x[None], first)
    outer = binding.current()
    carried = [s for s in outer.slots.values() if s.used or s.written]
    axis = strategy.extended.placement.axis_name
    # NNX objects among the arguments (merged in this trace, see graphs.merged_call) carry
    # their state from step to step too; each step runs on objects merged from it.
    nodes = _graph_nodes((args, kwargs))
    graphdef, nnx_state = nnx.split(nodes) if nodes else (None, None)
    slots = []  # the last trace of the body's slots, one per carried variable

    def body(carry, xs):
        values, state = carry
        inner = binding.Frame(strategy, axis, discover=True)
        for s, value in zip(carried, values):
            inner.bind(s.var, value, s.mirrored)
        a, k = args, kwargs
        if nodes:
            merged = nnx.merge(graphdef, state)
            by_id = {id(old): new for old, new in zip(nodes, merged)}
            a, k = jax.tree.map(lambda x: by_id.get(id(x), x), (args, kwargs),
                                is_leaf=graphs.is_graph_node)
        with binding.pushed(inner):
            out = _as_arrays(_one_step(strategy, fn, xs[0], xs[1], a, k))
        if inner.discovered:
            raise ValueError(
                f"function: with `steps_per_execution`, the step used variable(s) "
                f"{[v.name for v in inner.discovered]} only after its first step; every step "
                f"must use the same variables.")
        slots[:] = [inner.slots[id(s.var)] for s in carried]
        new = [jnp.asarray(slot.value).astype(v.dtype) for slot, v in zip(slots, values)]
        return (new, nnx.state(merged) if nodes else None), out

    rest = jax.tree.map(lambda x: x[1:], (element, counts))
    init = ([jnp.asarray(s.value) for s in carried], nnx_state)
    (final, final_state), ys = lax.scan(body, init, rest)
    for s, slot, value in zip(carried, slots, final):
        if slot.written:
            s.write(value, s.mirrored and slot.mirrored)
    if nodes:
        nnx.update(nodes, final_state)
    return jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), first, ys)


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


def _check_same_shapes(elements, name: str) -> None:
    """Elements moved one by one are stacked in the program: they must match."""
    first = [(jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(elements[0])]
    tree = jax.tree.structure(elements[0])
    for i, e in enumerate(elements[1:], 1):
        if (jax.tree.structure(e) != tree
                or [(jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(e)] != first):
            raise ValueError(
                f"{name}: with `steps_per_execution`, the elements one call takes must have "
                f"the same structure and shapes, but element {i} differs from element 0 "
                f"({tree} {first}); give batches of one size (a distributed dataset pads a "
                f"partial batch for you with several replicas), or call a step without "
                f"`steps_per_execution` for the odd ones.")


def _as_arrays(tree):
    return jax.tree.map(jnp.asarray, tree)


def _stacked(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


__all__ = ["FusedStep"]
