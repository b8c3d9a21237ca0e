"""Fused steps: ``steps_per_execution`` steps of a step function in one compiled program.

TF runs several steps per ``tf.function`` call by looping over ``next(iterator)`` inside it
(Keras: ``steps_per_execution``). Here ``strategy.function(fn, steps_per_execution=K)`` makes a
``FusedStep``: each call takes the next K elements of an iterator and runs ``fn`` on them in
one dispatch. Results are those of K single steps, stacked along a new leading axis.

Inside the trace, ``run_steps`` runs the first step as a plain step would (it finds the
variables the step uses) and the other K - 1 in a ``lax.scan``, so the program's size does not
grow with K. The scan's carry holds those variables' values, the state of the NNX objects among
the arguments, and the arguments the step returns updated (``carry_argnums``); the other
arguments pass unchanged, so what the step builds from them belongs to the scan's own trace.
"""

from __future__ import annotations

import itertools
import operator
import warnings

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxmirror.core import _compat, binding, context
from jaxmirror.core.values import PerReplica, is_per_replica
from jaxmirror.step import graphs
from jaxmirror.step.arguments import DeletedArrayError, check_alive
from jaxmirror.step.program import argnums
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

    State that changes from step to step carries over as after K calls when it lives in
    ``jaxmirror.Variable``s (read and assigned in ``fn``, as in TF), in flax NNX objects passed
    as arguments (a model, an ``nnx.Optimizer``), or in arguments named by ``carry_argnums``
    that ``fn`` returns updated first (``return params, opt_state, loss``: the call then
    returns them as the last step left them, and the rest stacked). Other arguments are the
    same for every step (a step returning a value shaped as one of them gets a warning).
    Per-row results of a padded batch come back padded (no row counts). Elements of different
    shapes (one replica's shorter last batch) run as consecutive programs within the call.

    A call waits for its program before it returns. When a step fails (a raising callback,
    an XLA error at run time), the call raises that error with a note: nothing of the failed
    program took effect (variables, NNX objects, the iterator's saved position), and its
    elements are back in a distributed iterator, so the next call retries them and
    ``next(iterator)`` skips them one by one (another iterator's are on the error, as
    ``unapplied_elements``). Under ``jax_debug_nans``/``jax_debug_infs`` a NaN found in a call
    is looked for step by step, as single steps, so that the error names its operation as a
    single step's does: the steps before it are applied, it and the later ones put back.
    Steps that were applied before a failure (those, or an earlier program of the same call)
    give their results, carried arguments first, as the error's ``applied_results``. Arguments
    in ``donate_argnums`` are used up by a program that failed (the note says so): keep a copy
    to retry from.

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
        self._compile = (compile_fn, tuple(i + 1 for i in donate_argnums))
        # The program cache keeps a program as long as its function lives: these do.
        self._functions = self._fused_functions()
        self._stacked, self._each = self._programs(self._functions)

    def _fused_functions(self) -> tuple:
        """New fused functions: for elements stacked on the host and moved in one transfer,
        and for elements moved one by one (a dataset iterated on a thread, any other iterator)
        and stacked in the program. Each also returns an array that tells when it has run."""
        strategy, fn, carry_argnums = self._strategy, self._fn, self._carry

        def fused(element, counts, *args, **kwargs):
            return (run_steps(strategy, fn, element, counts, args, kwargs, carry_argnums),
                    jnp.zeros((), jnp.int32))

        def fused_each(elements, counts, *args, **kwargs):
            return fused(_stacked(elements), _stacked(counts), *args, **kwargs)

        fused.__name__ = fused_each.__name__ = self.__name__
        # Whose closure the trace checks for NNX state read by closure (graphs.check_constants).
        fused.user_function_ref = fused_each.user_function_ref = lambda: fn
        return fused, fused_each

    def _programs(self, functions: tuple) -> tuple:
        compile_fn, donated = self._compile
        programs = tuple(compile_fn(f, donated) for f in functions)
        for program in programs:
            program.waits_for_objects = True  # the call waits anyway: objects settle after
        return programs

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
        calls = self._take(iterator)
        results = []  # the programs' results that took effect
        for done, call in enumerate(calls):
            try:
                out, finished = call[0](*call[1:3], *args, **kwargs)
                failure = None
            except FloatingPointError as err:  # jax_debug_nans/infs: as single steps would
                failure = self._step_by_step(call, args, kwargs, err)
            except DeletedArrayError as err:  # named as the caller passed it
                failure = (_named_if_deleted(err, args, kwargs, self.__name__), [], False)
            except Exception as err:  # noqa: BLE001 - raised again below, with a note
                # Failed at run time inside the call (its NNX objects waited for), or refused.
                failure = (err, [], True)
            if failure is None:
                try:
                    # Waited for, so that a step failing at run time fails this call, which
                    # puts back the elements it did not apply.
                    finished.block_until_ready()
                except Exception as err:  # noqa: BLE001 - raised again below, with a note
                    _compat.forget_failed_effect_tokens()  # reported here, not again at exit
                    failure = (err, [], True)
            if failure is not None:
                self._failed(iterator, calls, done, results, failure, (args, kwargs))
            results.append(out)
            args = self._carried(args, out)
        _forget_taken(iterator)
        return results[0] if len(results) == 1 else _joined(results, len(self._carry))

    def _carried(self, args: tuple, out) -> tuple:
        """``args`` with the carried ones replaced by ``out``'s (the next group starts where
        this one ended)."""
        for j, i in enumerate(self._carry):
            args = args[:i - 1] + (out[j],) + args[i:]
        return args

    def _step_by_step(self, call, args, kwargs, err) -> tuple:
        """``(error, results of the steps applied, True)``: the failed program's steps run
        again one at a time, by this step's one-step program, as single steps, so that JAX
        names the operation that made the NaN or inf (in the fused program it names the
        ``scan``); the steps before it are applied, as single steps would be."""
        program, element, counts, n, _ = call
        stacked, each = self._stacked, self._each
        outs = []
        for j in range(n):
            if program is self._each:
                one = (each, (element[j],), (counts[j],))
            else:
                one = (stacked, jax.tree.map(lambda x: _step_entry(x, j), element,
                                             is_leaf=is_per_replica),
                       jax.tree.map(lambda c: c[j:j + 1], counts))
            try:
                out, _ = one[0](*one[1:], *args, **kwargs)
            except FloatingPointError as found:
                return found, outs, True
            outs.append(out)
            args = self._carried(args, out)
        return err, outs, True

    def _failed(self, iterator, calls: list, done: int, results: list, failure: tuple,
                arguments: tuple) -> None:
        """Program ``done`` of this call failed (``failure``: the error, the results of the
        steps it applied one by one, and whether it ran), after programs whose ``results``
        took effect: the elements not applied go back into ``iterator`` (or onto the error for
        an iterator without ``put_back``); raises the error, with a note that says so."""
        err, one_by_one, ran = failure
        n = sum(c[3] for c in calls[done:]) - len(one_by_one)
        put_back = getattr(iterator, "put_back", None)
        if put_back is not None:
            put_back(n)
            where = ("are back in the iterator: the next call (or next()) takes them again; "
                     f"to skip them instead, call next(iterator) {n} times")
        else:
            err.unapplied_elements = [e for c in calls[done:] for e in c[4]][-n:] if n else []
            where = ("were taken from an iterator that cannot take them back: they are in "
                     "this error's `unapplied_elements`")
        applied, done_note = results + one_by_one, ""
        if applied:
            err.applied_results = (applied[0] if len(applied) == 1
                                   else _joined(applied, len(self._carry)))
            carried = ", the carried arguments first," if self._carry else ""
            done_note = (f"{sum(c[3] for c in calls[:done]) + len(one_by_one)} of its steps "
                         f"were applied (their results{carried} are this error's "
                         f"`applied_results`); ")
        err.__suppress_context__ = True  # a NaN found step by step: not the fused error
        err.add_note(f"{self.__name__}: this fused step failed; {done_note}the {n} elements "
                     f"whose steps did not take effect (the variables are as before them) "
                     f"{where}." + (_donated_used(*arguments, self._compile[1], self.__name__)
                                    if ran else ""))
        raise err

    def lower(self, iterator, *args, **kwargs):
        """The program for the next elements of ``iterator`` (which it consumes), lowered.

        Args:
            iterator: the iterator the elements come from.
            *args: ``fn``'s other arguments.
            **kwargs: its keyword arguments.

        Returns:
            A ``jax.stages.Lowered`` (of the first program, when the elements need several).
        """
        program, element, counts, _, _ = self._take(iterator)[0]
        return program.lower(element, counts, *args, **kwargs)

    def _take(self, iterator) -> list:
        """``[(program, element(s), counts, how many elements, the elements as taken)]`` for
        the next elements of ``iterator``: one per run of elements that can share a program
        (the elements as taken only for those moved one by one)."""
        take = getattr(iterator, "take_stacked", None)
        if take is not None:
            groups = take(self._steps)
        else:
            taken = list(itertools.islice(_iterator(iterator), self._steps))
            groups = [("each", taken)] if taken else []
        if not groups:
            raise StopIteration(f"{self.__name__}: the iterator is exhausted.")
        stacked, each = self._stacked, self._each
        calls = []
        for group in _merged(groups):
            if group[0] == "stacked":
                calls.append((stacked, group[1], group[2], _steps_in(group[1]), ()))
                continue
            elements = list(group[1])
            for run in _same_shape_runs([_without_counts(e) for e in elements]):
                stripped, counts = zip(*run)
                calls.append((each, tuple(stripped), tuple(counts), len(run),
                              elements[:len(run)]))
                elements = elements[len(run):]
        return calls

    def __repr__(self) -> str:
        return (f"<jaxmirror fused step {self.__name__} x{self._steps} on "
                f"{self._strategy!r}>")


def _deleted_argument(args, kwargs, api: str):
    """The error naming a deleted array among the user's arguments, or ``None`` (the user's
    ``args[0]`` is the iterator, so the others count from 1)."""
    try:
        check_alive(args, kwargs, api, first=1)
    except DeletedArrayError as named:
        return named
    return None


def _named_if_deleted(err, args, kwargs, api: str):
    """``err``, or the error naming a deleted array among the user's arguments."""
    named = _deleted_argument(args, kwargs, api)
    if named is None:
        return err
    named.__cause__ = err
    return named


def _donated_used(args, kwargs, donated: tuple, api: str) -> str:
    """What a failed call's note says of the arguments it donated: used up, if they were."""
    if _deleted_argument(args, kwargs, api) is None:
        return ""
    return (f" The arguments it donated (donate_argnums={tuple(i - 1 for i in donated)}) "
            f"were used up by the failed program: to retry, pass them again from a copy or a "
            f"checkpoint made before the call, or do not donate them.")


def _forget_taken(iterator) -> None:
    """A call that succeeded: its elements all took effect; the iterator lets them go."""
    put_back = getattr(iterator, "put_back", None)
    if put_back is not None:
        put_back(0)


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


def _steps_in(element) -> int:
    """The number of elements stacked in ``element`` (the axis after the replicas')."""
    leaf = jax.tree.leaves(element, is_leaf=is_per_replica)[0]
    return leaf.stacked.shape[1] if is_per_replica(leaf) else jnp.shape(leaf)[0]


def _step_entry(x, j: int):
    """Step ``j`` of a stacked element's leaf, its step axis kept (length 1)."""
    if is_per_replica(x):
        return PerReplica(x.stacked[:, j:j + 1])
    return x[j:j + 1]


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


# Inside a fused step's trace: K steps, the state carried in a `lax.scan`.


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


__all__ = ["FusedStep", "run_steps"]
