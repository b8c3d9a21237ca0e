"""Fused steps: ``steps_per_execution`` steps of a step function in one compiled program.

TF runs several steps per ``tf.function`` call by looping over ``next(iterator)`` inside it
(Keras: ``steps_per_execution``). Here ``strategy.function(fn, steps_per_execution=K)`` makes a
``FusedStep``: each call takes the next K elements of an iterator and runs ``fn`` on them, one
after the other, in one dispatch (``fused_trace.run_steps``: the first step traced plainly, the
others in a ``lax.scan``, so the program's size does not grow with K). Results are those of K
single steps, stacked along a new leading axis.
"""

from __future__ import annotations

import itertools
import operator

import jax
import jax.numpy as jnp

from jaxmirror.core.values import PerReplica, is_per_replica
from jaxmirror.step.fused_trace import run_steps
from jaxmirror.step.run_options import argnums


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

    State that changes from step to step carries over as after K calls when it lives in
    ``jaxmirror.Variable``s (read and assigned in ``fn``, as in TF), in flax NNX objects passed
    as arguments (a model, an ``nnx.Optimizer``), or in arguments named by ``carry_argnums``
    that ``fn`` returns updated first (``return params, opt_state, loss``: the call then
    returns them as the last step left them, and the rest stacked). Other arguments are the
    same for every step (a step returning a value shaped as one of them gets a warning).
    Per-row results of a padded batch come back padded (no row counts). Elements of different
    shapes (one replica's shorter last batch) run as consecutive programs within the call.

    Args:
        strategy: the strategy whose replicas run the steps.
        fn: the per-replica step function, ``fn(element, *args, **kwargs)``.
        steps: how many steps one call runs (``steps_per_execution``).
        compile_fn: ``compile_fn(function, donate_argnums)`` gives the ``Program`` of a
            per-replica function (the strategy's program cache).
        donate_argnums: positions of ``fn``'s arguments (not 0, the element) whose buffers the
            results may reuse.
        carry_argnums: positions of ``fn``'s arguments (not 0) that it returns updated.

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

    def __init__(self, strategy, fn, steps: int, compile_fn, donate_argnums=(),
                 carry_argnums=()):
        steps = _positive_int(steps)
        carry_argnums = argnums(carry_argnums, "function", "carry_argnums")
        if 0 in donate_argnums or 0 in carry_argnums:
            raise ValueError("function: with `steps_per_execution`, argument 0 is the element "
                             "taken from the iterator, which cannot be donated or carried; "
                             "name params and optimizer state.")
        self._strategy = strategy
        self._fn = fn
        self._steps = steps
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

        self._carry = carry_argnums

        def fused(element, counts, *args, **kwargs):
            return run_steps(strategy, fn, element, counts, args, kwargs, carry_argnums)

        def fused_each(elements, counts, *args, **kwargs):
            return run_steps(strategy, fn, _stacked(elements), _stacked(counts), args, kwargs,
                             carry_argnums)

        fused.__name__ = fused_each.__name__ = self.__name__
        # Whose closure the trace checks for NNX state read by closure (captured_graphs).
        fused.user_function_ref = fused_each.user_function_ref = lambda: fn
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
        results = []
        for program, element, counts in self._take(iterator):
            out = program(element, counts, *args, **kwargs)
            results.append(out)
            for j, i in enumerate(self._carry):  # the next group starts where this one ended
                args = args[:i - 1] + (out[j],) + args[i:]
        return results[0] if len(results) == 1 else _joined(results, len(self._carry))

    def lower(self, iterator, *args, **kwargs):
        """The program for the next elements of ``iterator`` (which it consumes), lowered.

        Args:
            iterator: the iterator the elements come from.
            *args: ``fn``'s other arguments.
            **kwargs: its keyword arguments.

        Returns:
            A ``jax.stages.Lowered`` (of the first program, when the elements need several).
        """
        program, element, counts = self._take(iterator)[0]
        return program.lower(element, counts, *args, **kwargs)

    def _take(self, iterator) -> list:
        """``[(program, element(s), counts)]`` for the next elements of ``iterator``: one per
        run of elements that can share a program."""
        take = getattr(iterator, "take_stacked", None)
        if take is not None:
            groups = take(self._steps)
        else:
            taken = list(itertools.islice(_iterator(iterator), self._steps))
            groups = [("each", taken)] if taken else []
        if not groups:
            raise StopIteration(f"{self.__name__}: the iterator is exhausted.")
        calls = []
        for group in _merged(groups):
            if group[0] == "stacked":
                calls.append((self._stacked, group[1], group[2]))
                continue
            for run in _same_shape_runs([_without_counts(e) for e in group[1]]):
                stripped, counts = zip(*run)
                calls.append((self._each, tuple(stripped), tuple(counts)))
        return calls

    def __repr__(self) -> str:
        return (f"<jaxmirror fused step {self.__name__} x{self._steps} on "
                f"{self._strategy!r}>")


def _positive_int(steps) -> int:
    try:
        value = operator.index(steps)
    except TypeError:
        value = None
    if value is None or isinstance(steps, bool) or value < 1:
        raise ValueError(f"function: `steps_per_execution` must be an int >= 1; got {steps!r}.")
    return value


def _iterator(iterator):
    if not hasattr(iterator, "__next__"):
        raise TypeError(
            f"function: a step with `steps_per_execution` takes an iterator as its first "
            f"argument (e.g. iter(strategy.experimental_distribute_dataset(ds))); got "
            f"{type(iterator).__name__}."
        )
    return iterator


def _merged(groups: list) -> list:
    """Consecutive ``("each", ...)`` groups as one."""
    out = []
    for g in groups:
        if g[0] == "each" and out and out[-1][0] == "each":
            out[-1] = ("each", out[-1][1] + g[1])
        else:
            out.append(g)
    return out


def _without_counts(element):
    """``(element without row counts, each leaf's row counts or None)``: a batch's counts
    become the program's explicit per-step inputs."""
    leaves, tree = jax.tree.flatten(element, is_leaf=is_per_replica)
    counts = tuple(x.row_counts if is_per_replica(x) else None for x in leaves)
    if not any(c is not None for c in counts):
        return element, ()
    plain = [PerReplica(x.stacked) if is_per_replica(x) else x for x in leaves]
    return jax.tree.unflatten(tree, plain), counts


def _signature(pair):
    element, counts = pair
    return (jax.tree.structure(element), len(counts),
            tuple((jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(element)))


def _same_shape_runs(pairs: list) -> list:
    """``pairs`` cut into runs of consecutive elements with one structure and shapes (which
    one program can stack)."""
    runs = []
    for pair, sig in zip(pairs, map(_signature, pairs)):
        if runs and runs[-1][0] == sig:
            runs[-1][1].append(pair)
        else:
            runs.append((sig, [pair]))
    return [run for _, run in runs]


def _joined(results: list, n_carried: int):
    """The results of consecutive programs of one call as one: carried arguments from the
    last, the stacked results concatenated along their step axis."""
    def join(*xs):
        per_replica = isinstance(xs[0], PerReplica)  # the step axis: 1 there, else 0
        stacked = [x.stacked if per_replica else x for x in xs]
        if len({jnp.shape(x)[:per_replica] + jnp.shape(x)[per_replica + 1:]
                for x in stacked}) > 1:
            raise ValueError(
                f"function: with `steps_per_execution`, this call took elements of different "
                f"shapes (one replica's shorter last batch) and ran them as {len(xs)} "
                f"programs, whose results differ in shape ({[jnp.shape(x) for x in stacked]}) "
                f"and cannot be stacked; the steps did run (variables are updated). Return "
                f"per-step values that do not depend on the batch size, or use "
                f"InputOptions(drop_remainder=True).")
        joined = jnp.concatenate(stacked, axis=int(per_replica))
        return PerReplica(joined) if per_replica else joined

    if not n_carried:
        return jax.tree.map(join, *results, is_leaf=is_per_replica)
    stacked = [r[n_carried:] for r in results]
    return tuple(results[-1][:n_carried]) + tuple(
        jax.tree.map(join, *stacked, is_leaf=is_per_replica))


def _stacked(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


__all__ = ["FusedStep"]
