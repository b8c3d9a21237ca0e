"""A program's compiled side: one ``jax.jit`` of ``Compiled._trace``, the traces of the user's
function, and what a dispatched call needs after.

All the Python work happens once per input signature, while ``jax.jit`` traces ``_trace``.
``trace_replica`` traces the user's function on per-replica values (so one trace serves every
placement of the inputs), with the variables it uses bound to traced stand-ins
(``core.binding``), and records what the step returned and assigned. ``emit`` re-emits that
jaxpr under ``shard_map`` with the real ``in_specs`` and the ``out_specs`` the replication
analysis chose: replicated outputs come back as plain arrays replicated over the mesh
(Mirrored), the others as ``PerReplica``. The variables' new arrays come back as extra
outputs, ``{index: new state}``, which the call plan stores open (``variables/state.py``).
"""

from __future__ import annotations

import functools
import hashlib
import warnings
import weakref
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import errors as flax_errors

from jaxmirror.core import _compat, binding, context, inflight
from jaxmirror.core._compat import P
from jaxmirror.core.binding import PlanMiss
from jaxmirror.core.values import Mirrored, PerReplica, is_distributed, is_per_replica
from jaxmirror.runtime import ledger, watch
from jaxmirror.step import graphs
from jaxmirror.step.analysis import divergence, padding_check, replication, rows
from jaxmirror.step.arguments import check_arguments, check_not_donating
from jaxmirror.step.cross_replica import (attach_sums, getters, reducible_in_step,
                                          reductions_in_step, sum_paths)
from jaxmirror.step.replica_context import ReplicaContext
from jaxmirror.variables.creation import created_in
from jaxmirror.variables.state import state_of


# The attribute a step's own trace error carries (``call_plan.repaired`` never retries it).
RAISED_IN_TRACE = "jaxmirror_raised_while_tracing"


def mark_raised_in_trace(err: BaseException) -> None:
    """Mark ``err`` as raised by a step's trace (the step's Python ran: never run it again)."""
    try:
        setattr(err, RAISED_IN_TRACE, True)
    except (AttributeError, TypeError):  # an exception type without attributes: not marked
        pass


def raised_in_trace(err: BaseException) -> bool:
    """Whether ``err`` came out of a step's trace (an inner NNX program's too).

    Example:
        >>> err = ValueError("mine")
        >>> mark_raised_in_trace(err); raised_in_trace(err), raised_in_trace(KeyError())
        (True, False)
    """
    return getattr(err, RAISED_IN_TRACE, False) is True


class Compiled:
    """A program's compiled side: the ``jax.jit`` of ``_trace``, the user's traces, and what a
    dispatched call needs after (the in-flight bound, the failure watch, the in-step sums).

    Args:
        program: the ``Program`` (its function, name, donation and bindings).
        counts: the program whose ``trace_count``/``compile_count`` traces add to.
        sum_first_only: the outputs are ``(user's results, NNX state)``.
    """

    def __init__(self, program, counts, sum_first_only: bool):
        strategy = program.strategy
        placement = strategy.extended.placement
        self.program = program
        self.counts = counts
        self.track = placement.bound_in_flight
        # Across processes: each compile's first run is agreed with the other workers.
        self.watch = placement.multi_process
        self.single = placement.num_replicas == 1  # often done at return
        self.central = placement.central  # see central_call
        # Small per-replica results are summed in the program too, for strategy.reduce.
        self.reductions = None if self.single else (
            reducible_in_step, functools.partial(reductions_in_step, strategy))
        self.sum_first_only = sum_first_only  # an NNX step's program: not the objects' state
        self.owner = weakref.ref(strategy.extended)  # whose sums they are (reduce checks)
        self.traced = {}  # per-replica input signature -> Traced
        self.handle_path = ()  # getters from the output to its smallest array (last trace)
        self.sum_paths = ()  # getters from the output to each summed result (last trace)
        self.effects = False  # the traced step has side effects (host callbacks)
        # jit arguments: (variable binding (static), captured variables' arrays, *args, **kwargs)
        self.jitted = jax.jit(self._trace, static_argnums=0,
                              donate_argnums=tuple(i + 2 for i in program.donate_argnums))

    def central_call(self, bound, values, args, kwargs):
        """Central storage: what the step reads from the parameter device is broadcast to the
        replicas, and its mirrored results (new parameters, variables' values) go back there."""
        placement = self.program.strategy.extended.placement
        values, args, kwargs = placement.to_compute((values, args, kwargs))
        out, token, writes, sums = self.jitted(bound, values, *args, **kwargs)
        return placement.to_storage(out), token, placement.to_storage(writes), sums

    def finish(self, out, token, sums):
        """The call was dispatched: it counts against the in-flight bound, and its small
        per-replica results get the sums it computed with them (``reductions_in_step``)."""
        if self.track or self.watch:
            handle = token if token is not None else self.handle(out)
            if self.track:  # the sums too: ``reduce`` returns them, counted here already
                inflight.track_array(handle, sums)
            if self.watch:
                watch.dispatched(self.program.__name__, handle)
        if sums:
            attach_sums(out, sums, self.sum_paths, self.owner)
        return out

    def handle(self, out):
        """One output array of this call, found without flattening ``out`` (on the hot path)."""
        try:
            for getter in self.handle_path:
                out = getter(out)
            return out.stacked if isinstance(out, PerReplica) else out
        except Exception:  # another signature's output structure: fall back to flattening
            leaves = jax.tree.leaves(out)
            return leaves[-1] if leaves else None

    # -- trace time only -------------------------------------------------------------------
    def _trace(self, bound, captured_states, *args, **kwargs):
        guard = _compat.array_like_guard
        refusal, guard.refusal = guard.refusal, None  # the user's own jax.jit may take variables
        try:
            return self._traced_call(bound, captured_states, args, kwargs)
        except PlanMiss:
            raise
        except Exception as err:  # the step's own error (or ours about it): never retried
            mark_raised_in_trace(err)
            raise
        finally:
            guard.refusal = refusal

    def _traced_call(self, bound, captured_states, args, kwargs):
        name, placement = self.program.__name__, self.program.strategy.extended.placement
        if self.watch:
            watch.tracing(name)  # tracing and compiling: not waiting for the others
        # Called with concrete arrays, not traced: jax_debug_nans/infs saw a NaN or inf in the
        # outputs and calls the function un-jitted to find the operation that made it.
        op_by_op = _compat.trace_state_clean()
        check_arguments(args, kwargs, "run")  # once per signature: jax.jit takes ragged lists
        if graphs.has_graph_nodes((args, kwargs)):  # jax.jit took them apart as pytrees
            raise PlanMiss(graphs=True)
        leaves, in_tree = jax.tree.flatten((args, kwargs), is_leaf=is_distributed)
        n_args = len(leaves)
        # Batches from a distributed dataset: their row counts go in as replicated operands
        # after the captured variables' arrays, so a new partial batch is new data, not a new
        # program.
        padded = tuple(i for i, x in enumerate(leaves)
                       if is_per_replica(x) and x.row_counts is not None)
        if padded and self.program.donate_argnums:
            check_not_donating("batches", args, self.program.donate_argnums, name)
        counts = [leaves[i].row_counts for i in padded]
        leaves += list(captured_states)
        stacked = tuple(is_per_replica(x) for x in leaves) + (False,) * len(counts)
        # Each replica sees a PerReplica's own component and a Mirrored's value.
        flat = [x.stacked if s else (x.value if isinstance(x, Mirrored) else x)
                for x, s in zip(leaves, stacked)] + counts
        local = tuple(_compat.local_abstract_key(x, s) for x, s in zip(flat, stacked))
        traced = self._traced_for(in_tree, n_args, local, bound, padded)
        if op_by_op:
            with jax.disable_jit():
                run_op_by_op(traced, flat, stacked, placement)
            return None, None, {}, ()  # no NaN op by op: JAX raises its own error about that
        self.handle_path = traced.handle_path
        self.counts.compile_count += 1  # a trace that got here is compiled (not abandoned)
        self.effects = self.effects or bool(traced.jaxpr.effects)
        reductions = self.reductions
        if reductions is not None and self.sum_first_only:  # (user's results, NNX state)
            reductions += (traced.out_tree.children()[0].num_leaves,)
        elif reductions is not None:
            reductions += (None,)
        outs, summed, sums = emit(traced, flat, stacked, placement, len(counts), reductions)
        n_out = len(outs) - len(traced.written)
        results, new_states = outs[:n_out], outs[n_out:]
        self.sum_paths = sum_paths(traced.out_tree, n_out, summed)
        # A step with no outputs still queues collectives: give the in-flight bound a handle.
        token = None if results else jnp.zeros((), jnp.int32)
        if self.watch:  # before its first run: every worker compiled the same program
            ledger.agree(f"step `{name}`", fingerprint(traced))
            watch.tracing(None)
        return (jax.tree.unflatten(traced.out_tree, results), token,
                dict(zip(traced.written, new_states)), tuple(sums))

    def _traced_for(self, in_tree, n_args, local, bound, padded) -> Traced:
        """The user's function traced for this per-replica signature (once per signature).

        The user's function sees only per-replica values, so one trace serves every placement
        of the inputs: host or replicated arrays, replicated or stacked (a variable whose
        replicas diverged) ones. jax.jit retraces for those; the user's function does not.
        """
        key = (in_tree, local, bound, padded)
        traced = self.traced.get(key)
        if traced is not None:
            return traced
        program, strategy = self.program, self.program.strategy
        self.counts.trace_count += 1
        resolved = None if bound is None else bound.resolve()
        # The strategy's variables the step might reach by closure are bound in the same
        # trace, so that finding which ones it uses costs no second run of its Python.
        taken = set(map(id, resolved[1] + resolved[2])) if resolved else set()
        candidates = tuple(v for v in created_in(strategy) if id(v) not in taken)
        fn = program.fn
        traced = trace_replica(strategy, fn, in_tree, n_args, local, resolved, padded,
                               candidates)
        user = fn  # the user's own function, behind the wrappers of NNX and fused steps
        while getattr(user, "user_function_ref", None) is not None:
            user = user.user_function_ref()
        graphs.check_constants(user, traced.jaxpr, program.__name__)
        cacheable = not any(map(_compat.is_tracer, _compat.jaxpr_constants(traced.jaxpr)))
        if traced.adopted:  # the next call passes them: keep the trace for that call
            positions, variables, captured = resolved or ((), (), ())
            n_bound = n_args + len(captured)
            local = local[:n_bound] + tuple(map(local_key, traced.adopted)) + local[n_bound:]
            bound = program.binding_of((positions, variables, captured + traced.adopted))
            if cacheable:
                self.traced[(in_tree, local, bound, padded)] = traced
            raise PlanMiss(traced.adopted)  # out of jax.jit: the program takes them as inputs
        if cacheable:
            self.traced[key] = traced
        return traced


# warnings.warn_explicit's record of the warnings shown (as a module's __warningregistry__).
_WARNED: dict = {}


class Traced(NamedTuple):
    """One trace of the user's function (see ``trace_replica``)."""

    jaxpr: object  # a ClosedJaxpr with one shard_map equation
    out_tree: object  # the structure of the step's results
    handle_path: tuple  # getters to the smallest result, for the in-flight bound
    written: tuple  # which bound variables the step assigned (their arrays are the last outputs)
    force_varying: list  # outputs that stay per-replica whatever the analysis says
    row_source: list  # per output: the padded batch whose rows it holds (an index), or None
    name: str  # the step function's name, for warnings
    pairs: list  # outputs that are new versions of inputs (divergence.paired_outputs)
    mirrored_writes: list  # (output index, name) of the mirrored variables the step wrote
    adopted: tuple  # candidate variables the step used: captured from now on (see trace_replica)


def _as_output_array(x, where):
    if isinstance(x, (jax.Array, int, float, complex, bool)) or hasattr(x, "__array__"):
        return jnp.asarray(x)
    raise TypeError(
        f"run: the step function must return arrays, Python numbers or nests of them; got "
        f"{type(x).__name__} at {jax.tree_util.keystr(where) or 'the top level'}."
    )


def _bind_inputs(frame, strategy, values, n_args, bound, candidates) -> list:
    """The user's flat inputs, with the variables passed, captured or candidates bound in
    ``frame``."""
    positions, arg_vars, captured = bound or ((), (), ())
    user = list(values[:n_args])
    # Whether a variable's replicas agree is not known here (the trace serves every placement);
    # a distributed variable's slot starts as "may differ", which only costs a collective when
    # a merge_fn reads the variable before the step writes it.
    for pos, var in zip(positions, arg_vars):
        var.check_usable_in(strategy)
        frame.bind(var, values[pos], mirrored=not is_distributed(var))
        user[pos] = var
    for j, var in enumerate(captured + candidates):
        frame.bind(var, values[n_args + j], mirrored=not is_distributed(var))
    return user


def _written_outputs(frame, bound, adopted, num_replicas: int) -> tuple:
    """``(written, varying, values, mirrored)`` of the variables the step assigned: each one's
    index among the bound variables, whether its output stays per replica, its new traced
    value, and the names of the mirrored ones (by position among the writes)."""
    _, arg_vars, captured = bound or ((), (), ())
    slots = frame.written()
    # Which variable each write is for: its index among the bound ones (arguments' first, then
    # captured), a plain dict key, so jit rebuilds the writes in C++.
    bound_vars = list(arg_vars) + list(captured) + list(adopted)
    index = {id(v): bound_vars.index(v) for v in reversed(bound_vars)}
    written = tuple(index[id(s.var)] for s in slots)
    # A sync-on-read variable keeps one component per replica, even when they agree.
    varying = [s.var.always_per_replica and num_replicas > 1 for s in slots]
    mirrored = [(j, s.var.name) for j, s in enumerate(slots)
                if is_distributed(s.var) and not s.var.always_per_replica]
    return written, varying, [jnp.asarray(s.value) for s in slots], mirrored


def trace_replica(strategy, fn, in_tree, n_args, local, bound, padded=(),
                  candidates=()) -> Traced:
    """Trace ``fn`` once, for one replica.

    Args:
        strategy: the strategy the step runs on.
        fn: the user's per-replica function.
        in_tree: the structure of ``(args, kwargs)``.
        n_args: how many of the flat inputs are the user's (the rest are captured variables'
            arrays, then the padded batches' row counts).
        local: each flat input's per-replica ``(shape, dtype, weak_type)``.
        bound: ``None``, or ``(positions, variables, captured)``: the flat positions at which
            the user passed variables, those variables, and the variables the step reaches by
            closure (their arrays follow the user's inputs).
        padded: the flat positions of padded batches; their row counts are the last inputs.
        candidates: variables the step may reach by closure, bound as extra inputs (after the
            captured ones, ``local`` does not list them) so that a first trace needs no second:
            the ones it used stay inputs (``Traced.adopted``), the others are dropped.

    Returns:
        A ``Traced``: a closed jaxpr holding one ``shard_map`` whose body is the replica's
        computation on per-replica inputs, and what ``emit`` needs to emit it.

    Raises:
        binding.PlanMiss: when the step reached variables it does not take as inputs yet.
    """
    placement = strategy.extended.placement
    found = {}
    n_bound = n_args + len(bound[2] if bound else ())
    local = local[:n_bound] + tuple(map(local_key, candidates)) + local[n_bound:]

    def per_replica_body(*values):
        frame = binding.Frame(strategy, placement.axis_name, discover=True)
        user = _bind_inputs(frame, strategy, values, n_args, bound, candidates)
        a, k = jax.tree.unflatten(in_tree, user)
        first_count = len(values) - len(padded)
        ctx = ReplicaContext(strategy, axis_name=placement.axis_name, padded_batches=tuple(
            (local[pos][0][0] if local[pos][0] else None, values[first_count + j])
            for j, pos in enumerate(padded)))
        with context.pushed(context.Entry(strategy, ctx, in_run=True)), binding.pushed(frame):
            result = _called(fn, a, k)
            # Still bound: a variable returned by the step is read as the step left it.
            with_paths, tree = jax.tree_util.tree_flatten_with_path(result)
            outs = [_as_output_array(x, path) for path, x in with_paths]
        if frame.discovered:
            raise binding.PlanMiss(tuple(frame.discovered))
        # No attribute paths: an attribute may be a property that warns (NNX's `.value`).
        plain = [i for i, (path, _) in enumerate(with_paths)
                 if not any(isinstance(k, jax.tree_util.GetAttrKey) for k in path)]
        smallest = min(plain, key=lambda i: outs[i].size, default=None)
        adopted = tuple(v for v in candidates if frame.slots[id(v)].used)
        written, varying, new_values, mirrored = _written_outputs(frame, bound, adopted,
                                                                  placement.num_replicas)
        found.update(
            out_tree=tree,
            handle_path=getters(with_paths[smallest][0] if smallest is not None else (None,)),
            written=written,
            force_varying=[False] * len(outs) + varying,
            pairs=(divergence.paired_outputs(fn, a, k, result)
                   if placement.num_replicas > 1 else []),
            mirrored_writes=[(len(outs) + j, name) for j, name in mirrored],
            adopted=adopted,
        )
        return outs + new_values

    avals = [jax.ShapeDtypeStruct(shape, dtype, weak_type=weak) for shape, dtype, weak in local]
    # Traced with every input and output replicated, i.e. on per-replica values; ``emit`` picks
    # the real in_specs and out_specs.
    traced = jax.make_jaxpr(
        _compat.shard_map(per_replica_body, placement.mesh, P(), P())
    )(*avals)
    if candidates:
        adopted = set(map(id, found["adopted"]))
        unused = {n_bound + j for j, v in enumerate(candidates) if id(v) not in adopted}
        traced = _compat.shard_map_without_inputs(traced, unused)
    sources = rows.row_sources(traced, padded)
    # Once per trace: a hand-written mean over padded rows fed to a collective (padding_check).
    warning = padding_check.padded_rows_warning(traced, padded, placement.axis_name)
    if warning is not None and warning.lineno is None:
        warnings.warn(warning, stacklevel=padding_check.user_stacklevel())
    elif warning is not None:  # shown at the user's line that summed over the padded rows
        warnings.warn_explicit(warning, type(warning), warning.filename, warning.lineno,
                               registry=_WARNED)
    n_results = len(sources) - len(found["written"])
    row_source = sources[:n_results] + [None] * len(found["written"])
    return Traced(jaxpr=traced, row_source=row_source,
                  name=getattr(fn, "__name__", type(fn).__name__), **found)


def _called(fn, args, kwargs):
    try:
        return fn(*args, **kwargs)
    except (ValueError, flax_errors.TraceContextError) as err:
        # flax's words when a step uses NNX objects it reached by closure (a Dropout's
        # nnx.Rngs it cannot update from inside the step's trace): say what to do.
        if "different trace level" not in str(err):
            raise
        raise ValueError(_closure_message(fn, err)) from err
    except jax.errors.ConcretizationTypeError as err:  # `if ctx.replica_id_in_sync_group == 0:`
        err.add_note(
            "run: the step is traced once for all replicas and compiled, so its values (the "
            "replica id, a loss) have no Python value while it runs: a Python `if`, `int()` or "
            "`float()` of one cannot work there; choose with jnp.where or jax.lax.cond, or read "
            "the step's results after it returns (TF's tf.function has the same rule).")
        raise


def _closure_message(fn, err) -> str:
    user = fn  # the user's own function, behind the wrappers of NNX and fused steps
    while getattr(user, "user_function_ref", None) is not None:
        user = user.user_function_ref()
    reached = graphs.reached_objects(user)
    names = ", ".join(f"`{name}` ({type(obj).__name__})" for name, obj in reached)
    example = reached[0][0].rsplit(".", 1)[-1] if reached else "model"
    example = example if example.isidentifier() else "model"
    flax_said = str(err).split(" (https://", 1)[0].split("\n", 1)[0]
    return (
        f"run: the step uses flax NNX objects that it reaches by closure; pass them as "
        f"arguments of the step instead{': ' + names if names else ''}, e.g. "
        f"`step({example}, batch)` for `def step({example}, batch)`: run then updates them "
        f"after each call, as nnx.jit does (flax: {flax_said}: an object read by closure, a "
        f"Dropout's nnx.Rngs say, cannot be updated from inside a compiled step). For a test "
        f"step, also turn "
        f"dropout off first, as TF's `training=False` does: `{example}.eval()` outside the "
        f"step, or layers built with deterministic=True."
    )


def fingerprint(traced: Traced) -> str:
    """A traced step's per-replica input shapes and a digest of its program: what the workers
    compare before a compiled step first runs across processes (``runtime/ledger.py``).

    Args:
        traced: the step traced for one replica.

    Returns:
        ``"inputs (float32[2, 3], ...), program <12 hex digits>"``.
    """
    jaxpr = traced.jaxpr
    shapes = ", ".join(a.str_short() for a in jaxpr.in_avals) or "no inputs"
    program = f"{_compat.open_jaxpr(jaxpr)}|{jaxpr.out_avals}"
    digest = hashlib.sha1(program.encode()).hexdigest()[:12]
    return f"inputs ({shapes}), program {digest}"


def local_key(var) -> tuple:
    """A variable's per-replica ``(shape, dtype, weak type)``, as ``Program`` keys its inputs.

    Args:
        var: a variable.

    Returns:
        The key of what one replica sees of its state.
    """
    held = state_of(var)
    stacked = isinstance(held, PerReplica)
    return _compat.local_abstract_key(held.stacked if stacked else held, stacked)


def _shard_map_operands(traced: Traced, flat: list, stacked: tuple) -> tuple:
    """The trace's one ``shard_map`` equation, its operands (fed by the trace's constants and
    the flat inputs) and, per operand, whether it is replica-stacked."""
    outer = _compat.open_jaxpr(traced.jaxpr)
    (eqn,) = outer.eqns
    env = dict(zip(outer.constvars, _compat.jaxpr_constants(traced.jaxpr)))
    env.update(zip(outer.invars, flat))
    is_stacked = dict(zip(outer.invars, stacked))
    operands = [v.val if isinstance(v, _compat.Literal) else env[v] for v in eqn.invars]
    op_stacked = [not isinstance(v, _compat.Literal) and is_stacked.get(v, False)
                  for v in eqn.invars]
    return eqn, operands, op_stacked


def run_op_by_op(traced: Traced, flat: list, stacked: tuple, placement) -> list:
    """The traced body run one operation at a time, the replicas a ``vmap`` axis.

    This is how ``jax_debug_nans``/``jax_debug_infs`` find the operation that made a NaN or
    inf: JAX calls the jitted function again un-jitted, and each operation here is checked on
    its own. (Eager ``shard_map`` would recurse: it re-jits its inputs and outputs, which hold
    the NaN.) Collectives work as in the step: ``vmap`` binds the same axis name.

    Args:
        traced: the trace to run.
        flat: the flat inputs as arrays (stacked ones with the replica axis first).
        stacked: per flat input, whether it is replica-stacked.
        placement: the strategy's ``Placement`` (its axis name).

    Returns:
        The outputs, each stacked over the replicas (only its errors matter to JAX).
    """
    eqn, operands, op_stacked = _shard_map_operands(traced, flat, stacked)
    axes = [0 if s else None for s in op_stacked]
    inner = _compat.shard_map_body(eqn)

    def body(*ops):  # jaxpr_as_fun would turn the NaN checks off
        return _compat.eval_jaxpr(inner, (), *ops)

    return jax.vmap(body, in_axes=axes, axis_name=placement.axis_name,
                    axis_size=placement.num_replicas)(*operands)


def emit(traced: Traced, flat: list, stacked: tuple, placement, n_counts: int,
         reductions=None) -> tuple:
    """The traced body under ``shard_map`` with the inputs' real placement.

    Args:
        traced: the trace to emit.
        flat: the flat inputs as arrays (stacked ones with the replica axis first); the last
            ``n_counts`` are the padded batches' row counts.
        stacked: per flat input, whether it is replica-stacked.
        placement: the strategy's ``Placement``.
        n_counts: how many row-count inputs end ``flat``.
        reductions: ``None``, or ``(wanted, reduce, limit)``: ``wanted(aval)`` says whether a
            per-replica result (among the first ``limit``, or all when ``None``; not a batch's
            rows) is summed over the replicas in the program too, and ``reduce(components)``
            gives each one's sum there.

    Returns:
        ``(outputs, summed, sums)``: the outputs, replicated arrays for Mirrored ones,
        ``PerReplica`` for the others (with row counts for those holding a padded batch's
        rows); the indices of the results summed, and their sums.
    """
    eqn, operands, op_stacked = _shard_map_operands(traced, flat, stacked)
    inner = _compat.shard_map_body(eqn)
    if placement.num_replicas > 1:
        analysed = replication.analyse(inner, op_stacked)
        out_varying = [a or f for a, f in zip(analysed, traced.force_varying)]
        # Once per placement of the inputs: mirrored values the replicas made differ.
        divergence.warn_diverged(traced.name, traced.pairs, stacked, analysed,
                                 traced.mirrored_writes)
    else:
        out_varying = [False] * len(inner.outvars)
    body = _compat.jaxpr_as_fun(_compat.close_jaxpr(inner))
    n_out = len(out_varying)
    n_results = n_out - len(traced.written)  # the variables' new arrays follow the results
    limit = n_results if reductions is None or reductions[2] is None else reductions[2]
    wanted = [] if reductions is None else [
        i for i, (vary, source, var) in enumerate(zip(out_varying[:limit],
                                                      traced.row_source, inner.outvars))
        if vary and source is None and reductions[0](var.aval)]

    def per_replica(*ops):
        ops = [o.reshape(o.shape[1:]) if s else o for o, s in zip(ops, op_stacked)]
        outs = body(*ops)
        if wanted:
            # One materialized value for the result and its sum: XLA would otherwise fuse
            # the result's computation into the sum's packing again, rounded differently.
            barred = _compat.optimization_barrier([outs[i] for i in wanted])
            outs = list(outs)
            for i, o in zip(wanted, barred):
                outs[i] = o
        sums = reductions[1]([outs[i] for i in wanted]) if wanted else []
        return [o[None] if vary else o for o, vary in zip(outs, out_varying)] + list(sums)

    axis = placement.axis_name
    in_specs = tuple(P(axis) if s else P() for s in op_stacked)
    out_specs = [P(axis) if vary else P() for vary in out_varying] + [P()] * len(wanted)
    outs = _compat.shard_map(per_replica, placement.mesh, in_specs, out_specs)(*operands)
    # A per-replica result computed row by row from a padded batch (analysis/rows.py) shows only the
    # real rows, as TF's would: it carries that batch's row counts back out.
    counts_in = flat[len(flat) - n_counts:]
    results = [PerReplica(o, None if source is None else counts_in[source]) if vary else o
               for o, vary, source in zip(outs, out_varying, traced.row_source)]
    return results, wanted, outs[n_out:]


__all__ = ["RAISED_IN_TRACE", "Compiled", "Traced", "emit", "fingerprint", "local_key",
           "mark_raised_in_trace", "raised_in_trace", "run_op_by_op", "trace_replica"]
