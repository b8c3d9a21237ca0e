"""The compiled form of a step function: one ``jax.jit(shard_map(...))`` program per strategy.

``Program`` is what ``strategy.run``, ``@strategy.run`` and ``strategy.function`` share. Its
``__call__`` is the hot path: a context check, ``jax.jit``'s own C++ cache lookup and dispatch,
and (on CPU) one append to the in-flight queue. All the Python work happens once per input
signature, while ``jax.jit`` traces ``_trace``: it traces the user's function once on
per-replica values (``trace.trace_replica``), decides which outputs are replicated, and emits
that jaxpr for the inputs' real placement (``trace.emit``). The variables' new arrays come back
as extra outputs and are stored open (``variables.state.write_open``): committed once the step
is known to have succeeded, rolled back if it failed. A step with variables reads, dispatches
and stores under ``variables.state.lock``. ``Step`` is what users hold: it keeps the function
alive, the program does not (``program_cache``).

Variables reached by closure are found by the first trace and passed in from then on; variables
passed as arguments are swapped for their arrays. The user's function is traced once per
per-replica signature.
"""

from __future__ import annotations

import functools
import types
import warnings
import weakref

import jax
import jax.numpy as jnp

from jaxmirror.core import _compat, binding, inflight
from jaxmirror.core.values import Mirrored, PerReplica, is_distributed, is_per_replica
from jaxmirror.runtime import ledger, watch
from jaxmirror.step import captured_graphs, graphs, placing
from jaxmirror.step.arguments import (check_arguments, check_not_donating, has_variables,
                                      take_variables)
from jaxmirror.step.call_rules import check_can_run, wants_arguments
from jaxmirror.step.deleted import check_alive, donated_arrays, forget_donated
from jaxmirror.step.step_sums import (attach_sums, reducible_in_step, reductions_in_step,
                                      sum_paths)
from jaxmirror.step.static_binding import StaticBinding
from jaxmirror.step.trace import (Traced, emit, fingerprint, local_key, run_op_by_op,
                                  trace_replica)
from jaxmirror.variables import state
from jaxmirror.variables.creation import created_in
from jaxmirror.variables.state import state_of


class Program:
    """``fn`` compiled for every replica of ``strategy``; call it like ``fn``.

    A program does not keep ``fn`` alive (the strategy's cache keeps the program exactly as long
    as ``fn`` lives; ``Step`` is what keeps ``fn`` for a user), and neither do JAX's global
    compilation caches keep its variables alive (see ``StaticBinding``).

    Args:
        strategy: the strategy whose devices run the program.
        fn: the step function, written for one replica.
        donate_argnums: positional arguments whose buffers the outputs may reuse.
        weak: hold ``fn`` by a weak reference (False for callables that cannot be).
    """

    def __init__(self, strategy, fn, donate_argnums=(), weak=True):
        self._strategy = strategy
        if not weak:
            self._fn_ref = lambda: fn
        elif isinstance(fn, types.MethodType):
            self._fn_ref = weakref.WeakMethod(fn)
        else:
            self._fn_ref = weakref.ref(fn)
        self.wants_arguments = wants_arguments(fn)  # see Strategy.run
        self.trace_count = 0  # how often the user's function was traced
        self.compile_count = 0  # how often jax.jit traced (and so compiled) this program
        self._traced = {}  # per-replica input signature -> Traced
        self._handle_path = ()  # getters from the output to its smallest array (last trace)
        self._track = strategy.extended.placement.bound_in_flight
        # Across processes: each compile's first run is agreed with the other workers.
        self._watch = strategy.extended.placement.multi_process
        self._single = strategy.extended.placement.num_replicas == 1  # often done at return
        self._central = strategy.extended.placement.central  # see _central_call
        # Small per-replica results are summed in the program too, for strategy.reduce.
        self._reductions = None if self._single else (
            reducible_in_step, functools.partial(reductions_in_step, strategy))
        self._owner = weakref.ref(strategy.extended)  # whose sums they are (reduce checks)
        self._sum_first_only = False  # an NNX step's program: not the objects' new state
        self._sum_paths = ()  # getters from the output to each summed result (last trace)
        self._donate_argnums = tuple(donate_argnums)
        # None, or how every call goes from now on: with variable or NNX-object arguments
        self._mode = None
        self._graph_programs = {}  # NNX arguments' (structure, positions, GraphDef) -> Program
        self._counter = self  # whose trace_count/compile_count a trace adds to
        self._warned_placement = False
        self._effects = False  # the traced step has side effects (host callbacks)
        # Wait for every call before NNX objects among the arguments take its new state (a
        # fused step sets it: a failed call must leave the objects as they were).
        self.waits_for_objects = False
        self._captured = ()  # variables the step reaches by closure, found while tracing
        self._captured_key = None  # the binding of a call without variable arguments
        self._bindings = {}  # (positions, variables, captured) -> its StaticBinding
        # jit arguments: (variable binding (static), captured variables' arrays, *args, **kwargs)
        self._jitted = jax.jit(self._trace, static_argnums=0,
                               donate_argnums=tuple(i + 2 for i in donate_argnums))
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    @property
    def fn(self):
        """The user's per-replica function (``None`` once nothing else holds it)."""
        return self._fn_ref()

    def __new__(cls, strategy, *args, **kwargs):
        if cls is Program and strategy.extended.placement.multi_process:
            cls = _WatchedProgram  # one process keeps the plain hot path
        return super().__new__(cls)

    def __call__(self, *args, **kwargs):
        check_can_run(self._strategy)
        mode = self._mode
        if mode is not None:
            return mode(self, args, kwargs)
        donated = self._donate_argnums and donated_arrays(args, kwargs, self._donate_argnums,
                                                          self.__name__)
        captured = self._captured
        try:
            if captured:  # TF's usual style: variables by closure, nothing to flatten per call
                if not _compat.trace_state_clean():
                    raise self._transformed_error()
                with state.lock:  # read, dispatch, write back: one update at a time
                    state.poll()  # first: a step seen to have failed is rolled back
                    state.check(captured)  # and a failure not reported yet is raised
                    out, token, sums = self._dispatch(self._captured_key, captured, args,
                                                      kwargs)
            elif self._central:
                out, token, _, sums = self._central_call(None, (), args, kwargs)
            else:  # no variables, no writes
                out, token, _, sums = self._jitted(None, (), *args, **kwargs)
        except binding.Discovered as found:  # the step reads variables by closure
            self._capture(found.variables)
            return self(*args, **kwargs)
        except graphs.GraphArguments:
            self._mode = Program._call_with_graphs
            return self._call_with_graphs(args, kwargs)
        except (TypeError, ValueError) as err:  # jax.jit refuses Variable arguments, bad ones
            check_arguments(args, kwargs, "run")  # a bad one: name it, in place of JAX's error
            check_alive(args, kwargs, self.__name__)  # one device: JAX's ValueError for it
            moved = self._mirrored_arguments(args, kwargs, err)
            if moved is not None:
                return self(*moved[0], **moved[1])
            if not has_variables(args, kwargs):
                raise
            self._mode = Program._call_with_variable_args
            return self._call_with_variable_args(args, kwargs)
        except RuntimeError:  # JAX's own for a deleted array: name it (see step/deleted.py)
            check_alive(args, kwargs, self.__name__)
            raise
        if donated:  # what JAX took is deleted: a later call raises, not crashes
            forget_donated(donated)
        return self._finish(out, token, sums)

    def _call_with_variable_args(self, args, kwargs):
        """A call whose arguments may hold variables: they go in as their arrays."""
        donated = self._donate_argnums and donated_arrays(args, kwargs, self._donate_argnums,
                                                          self.__name__)
        captured = self._captured
        try:
            with state.lock:  # read, dispatch, write back: one update at a time
                state.poll()  # first: a step seen to have failed is rolled back before the read
                key, a, k = take_variables(args, kwargs, captured)
                variables = key[1] + captured
                state.check(variables)  # a failure not reported yet: raised, nothing run
                bound = self._binding(key)
                if variables and not _compat.trace_state_clean():
                    raise self._transformed_error()
                if key[1] and self._donate_argnums:
                    check_not_donating("variables", args, self._donate_argnums, self.__name__)
                out, token, sums = self._dispatch(bound, variables, a, k)
        except binding.Discovered as found:
            self._capture(found.variables)
            return self._call_with_variable_args(args, kwargs)
        except graphs.GraphArguments:
            self._mode = Program._call_with_graphs
            return self._call_with_graphs(args, kwargs)
        except (TypeError, ValueError) as err:
            check_arguments(args, kwargs, "run")  # a bad argument: name it, in place of JAX's
            check_alive(args, kwargs, self.__name__)
            moved = self._mirrored_arguments(args, kwargs, err)
            if moved is None:
                raise
            return self._call_with_variable_args(*moved)
        except RuntimeError:
            check_alive(args, kwargs, self.__name__)
            raise
        if donated:
            forget_donated(donated)
        return self._finish(out, token, sums)

    def _mirrored_arguments(self, args, kwargs, err):
        """``(args, kwargs)`` with arrays on other devices mirrored (as TF does), or ``None``
        when JAX's ``err`` was not about devices or none is; says once per step that each such
        call pays a copy."""
        args, kwargs, names = placing.mirror_misplaced(self._strategy.extended.placement,
                                                       args, kwargs, self._donate_argnums)
        if not names or "devices" not in str(err):  # the step's own error: not ours to retry
            return None
        if not self._warned_placement:
            self._warned_placement = True
            warnings.warn(
                f"run: `{self.__name__}` got {', '.join(names[:3])}"
                f"{' and more' if len(names) > 3 else ''} on devices other than the "
                f"strategy's; they were mirrored onto its devices, as TF does, at the cost of a "
                f"copy per call that gets them; place them once with "
                f"strategy.experimental_replicate(tree), build them with strategy.init(fn), or "
                f"pass the step's own outputs back in.", stacklevel=4)
        return args, kwargs

    def _call_with_graphs(self, args, kwargs):
        """A call whose arguments hold NNX objects: split, run on their state, updated after."""
        try:
            key, nnx_state, nodes, others = graphs.split_arguments(
                args, kwargs, self._strategy.extended.placement)
            program = self._graph_programs.get(key)
            if program is None:
                step = functools.partial(_graph_step, self._fn_ref, key)
                step.__name__ = self.__name__
                step.user_function_ref = self._fn_ref  # whose closure captured_graphs checks
                # Donating an NNX object donates its state: the object gets the new arrays.
                donated = any(graphs.has_graph_nodes(args[i]) for i in self._donate_argnums
                              if i < len(args))
                program = Program(self._strategy, step, donate_argnums=(0,) if donated else (),
                                  weak=False)
                program._counter = self
                program._sum_first_only = True
                self._graph_programs[key] = program
            out, new_state = program(nnx_state, others)
        except (RuntimeError, ValueError):  # a deleted array: named as the caller passed it
            check_alive(args, kwargs, self.__name__)
            raise
        graphs.update(nodes, new_state)  # while the program runs; undone if it fails
        if program._effects or self.waits_for_objects:
            # A host callback may fail at run time; the objects must not keep a failed step's
            # arrays (they would raise on every later read), so wait for it here.
            try:
                jax.block_until_ready((out, new_state))
            except Exception:
                graphs.update(nodes, nnx_state)  # as before the call, as nnx.jit leaves them
                _compat.forget_failed_effect_tokens()  # reported here, not again at exit
                raise
        return out

    def _dispatch(self, bound, variables: tuple, args, kwargs):
        """Under ``state.lock``: the jitted call on the captured variables' current arrays, its
        writes to ``variables`` (passed ones first, then captured) stored open."""
        states = tuple(map(state_of, self._captured))
        if self._central:
            out, token, writes, sums = self._central_call(bound, states, args, kwargs)
        else:
            out, token, writes, sums = self._jitted(bound, states, *args, **kwargs)
        if writes:
            state.write_open(variables, writes, out is not None, self._single)
        return out, token, sums

    def lower(self, *args, **kwargs):
        """The program for these arguments, lowered and not run (``jax.stages.Lowered``).

        Raises:
            TypeError: for NNX objects among the arguments (lower a step on their
                ``nnx.state`` instead).
        """
        check_can_run(self._strategy)
        while True:
            key, a, k = take_variables(args, kwargs, self._captured)
            bound = None if key == ((), (), ()) else self._binding(key)
            states = tuple(map(state_of, self._captured))
            if self._central:
                states, a, k = self._strategy.extended.placement.to_compute((states, a, k))
            try:
                return self._jitted.lower(bound, states, *a, **k)
            except binding.Discovered as found:
                self._capture(found.variables)
            except graphs.GraphArguments:
                raise TypeError(f"{self.__name__}.lower: NNX objects among the arguments; "
                                f"lower a step that takes their nnx.state instead.") from None

    def _central_call(self, bound, states, args, kwargs):
        """Central storage: what the step reads from the parameter device is broadcast to the
        replicas, and its mirrored results (new parameters, variables' values) go back there."""
        placement = self._strategy.extended.placement
        states, args, kwargs = placement.to_compute((states, args, kwargs))
        out, token, writes, sums = self._jitted(bound, states, *args, **kwargs)
        return placement.to_storage(out), token, placement.to_storage(writes), sums

    def _finish(self, out, token, sums):
        """The call was dispatched: it counts against the in-flight bound, and its small
        per-replica results get the sums it computed with them (``step_sums``)."""
        if self._track or self._watch:
            handle = token if token is not None else self._handle(out)
            if self._track:
                inflight.track_array(handle)
            if self._watch:
                watch.dispatched(self.__name__, handle)
        if sums:
            attach_sums(out, sums, self._sum_paths, self._owner)
        return out

    def _capture(self, variables: tuple) -> None:
        self._captured = self._captured + variables
        self._captured_key = self._binding(((), (), self._captured))

    def _binding(self, key: tuple) -> "StaticBinding":
        """The one ``StaticBinding`` of ``key`` (static arguments are compared by identity)."""
        binding_ = self._bindings.get(key)
        if binding_ is None:
            binding_ = self._bindings[key] = StaticBinding(*key)
        return binding_

    def _transformed_error(self) -> RuntimeError:
        return RuntimeError(
            f"{self.__name__}: a step that uses jaxmirror Variables cannot be called inside "
            f"jax.jit, jax.grad or lax.scan (its assignments would be lost); call it directly, "
            f"or pass arrays instead of variables.")

    def _handle(self, out):
        """One output array of this call, found without flattening ``out`` (on the hot path)."""
        try:
            for getter in self._handle_path:
                out = getter(out)
            return out.stacked if isinstance(out, PerReplica) else out
        except Exception:  # another signature's output structure: fall back to flattening
            leaves = jax.tree.leaves(out)
            return leaves[-1] if leaves else None

    def __repr__(self) -> str:
        return f"<jaxmirror step {self.__name__} on {self._strategy!r}>"

    # -- trace time only -------------------------------------------------------------------
    def _trace(self, bound, captured_states, *args, **kwargs):
        if self._watch:
            watch.tracing(self.__name__)  # tracing and compiling: not waiting for the others
        # Called with concrete arrays, not traced: jax_debug_nans/infs saw a NaN or inf in the
        # outputs and calls the function un-jitted to find the operation that made it.
        op_by_op = _compat.trace_state_clean()
        check_arguments(args, kwargs, "run")  # once per signature: jax.jit takes ragged lists
        if graphs.has_graph_nodes((args, kwargs)):  # jax.jit took them apart as pytrees
            raise graphs.GraphArguments()
        leaves, in_tree = jax.tree.flatten((args, kwargs), is_leaf=is_distributed)
        n_args = len(leaves)
        # Batches from a distributed dataset: their row counts go in as replicated operands
        # after the captured variables' arrays, so a new partial batch is new data, not a new
        # program.
        padded = tuple(i for i, x in enumerate(leaves)
                       if is_per_replica(x) and x.row_counts is not None)
        if padded and self._donate_argnums:
            check_not_donating("batches", args, self._donate_argnums, self.__name__)
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
                run_op_by_op(traced, flat, stacked, self._strategy.extended.placement)
            return None, None, {}, ()  # no NaN op by op: JAX raises its own error about that
        self._handle_path = traced.handle_path
        self._counter.compile_count += 1  # a trace that got here is compiled (not abandoned)
        self._effects = self._effects or bool(traced.jaxpr.effects)
        reductions = self._reductions
        if reductions is not None and self._sum_first_only:  # (user's results, NNX state)
            reductions += (traced.out_tree.children()[0].num_leaves,)
        elif reductions is not None:
            reductions += (None,)
        outs, summed, sums = emit(traced, flat, stacked, self._strategy.extended.placement,
                                  len(counts), reductions)
        n_out = len(outs) - len(traced.written)
        results, new_states = outs[:n_out], outs[n_out:]
        self._sum_paths = sum_paths(traced.out_tree, n_out, summed)
        # A step with no outputs still queues collectives: give the in-flight bound a handle.
        token = None if results else jnp.zeros((), jnp.int32)
        if self._watch:  # before its first run: every worker compiled the same program
            ledger.agree(f"step `{self.__name__}`", fingerprint(traced))
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
        traced = self._traced.get(key)
        if traced is None:
            self._counter.trace_count += 1
            resolved = None if bound is None else bound.resolve()
            # The strategy's variables the step might reach by closure are bound in the same
            # trace, so that finding which ones it uses costs no second run of its Python.
            taken = set(map(id, resolved[1] + resolved[2])) if resolved else set()
            candidates = tuple(v for v in created_in(self._strategy) if id(v) not in taken)
            fn = self._fn_ref()
            traced = trace_replica(self._strategy, fn, in_tree, n_args, local,
                                   resolved, padded, candidates)
            user = fn  # the user's own function, behind the wrappers of NNX and fused steps
            while getattr(user, "user_function_ref", None) is not None:
                user = user.user_function_ref()
            captured_graphs.check_constants(user, traced.jaxpr, self.__name__)
            cacheable = not any(_compat.is_tracer(c) for c in traced.jaxpr.consts)
            if traced.adopted:  # the next call passes them: keep the trace for that call
                positions, variables, captured = resolved or ((), (), ())
                n_bound = n_args + len(captured)
                local = (local[:n_bound] + tuple(map(local_key, traced.adopted))
                         + local[n_bound:])
                bound = self._binding((positions, variables, captured + traced.adopted))
                if cacheable:
                    self._traced[(in_tree, local, bound, padded)] = traced
                raise binding.Discovered(traced.adopted)
            if cacheable:
                self._traced[key] = traced
        return traced


class _WatchedProgram(Program):
    """A program across processes: the failure watch sees each call (``runtime/watch.py``)."""

    def __call__(self, *args, **kwargs):
        watch.entering(self.__name__)
        try:
            return Program.__call__(self, *args, **kwargs)
        finally:
            watch.left()


class _VariableArguments(TypeError):
    """Raised by ``jax.jit`` in ``Program.__call__`` for variable arguments (see ``_compat``)."""


# JAX takes variables as arrays elsewhere; a step must see them as variables, so its own jit
# call refuses them and ``__call__`` passes their arrays instead (``_call_with_variable_args``).
_compat.refuse_array_likes_in(Program.__call__.__code__, _VariableArguments,
                              until=Program._trace.__code__)


def _graph_step(fn_ref, key, nnx_objects, others):
    """A step given NNX objects (``graphs``); its parameter names name the arguments in warnings."""
    return graphs.merged_call(fn_ref(), key, nnx_objects, others)
