"""How a step call runs: the plan for the kind of arguments it gets.

A ``Program`` holds one plan, an object for one kind of call:

* ``ArrayCall``: plain arrays and pytrees of them; the jitted call as it is (the fast path);
* ``CapturedCall``: the same, with variables reached by closure (TF's usual style): their
  current values go in after the arguments, their new ones are stored open (``state``);
* ``VariableCall``: variables among the arguments: each call swaps them for their values;
* ``GraphCall``: flax NNX objects among the arguments: split, run on their state by an inner
  program (one per graph structure), the objects updated after.

``planned`` chooses the plan on the slow path only: the first call, and when JAX's call met
what the plan does not cover. That is the one signal that must come from inside ``jax.jit``,
and only an exception leaves it: ``binding.PlanMiss``, for a variable where the plan had an
array (JAX abstracting one raises it while ``_compat.array_like_guard`` is set, which the
plans that pass arguments through as they are set around their call), variables a new trace
reached by closure, or NNX objects the trace met. Plans only move on: arrays to captured
variables, to variables as arguments, to NNX objects.

``repaired`` is the error path: when JAX refused a call's arguments it names a bad or deleted
argument in place of JAX's error, or mirrors arrays placed on other devices (as TF does).
"""

from __future__ import annotations

import functools
import operator
import weakref

import jax

from jaxmirror.core import _compat
from jaxmirror.core.binding import PlanMiss
from jaxmirror.core.stateful import Stateful
from jaxmirror.core.values import is_distributed
from jaxmirror.step import graphs
from jaxmirror.step.compiled import raised_in_trace
from jaxmirror.step.arguments import (check_alive, check_arguments, check_not_donating,
                                      donated_arrays, forget_donated, has_variables,
                                      mirror_misplaced, take_variables, warn_mirrored_once)
from jaxmirror.variables import state

_guard = _compat.array_like_guard
_value = operator.attrgetter("value")  # a VariableState's value, on the hot path


class ArrayCall:
    """Plain arrays (and pytrees, distributed values) as arguments: the jitted call as it is.

    Args:
        program: the ``Program``.
    """

    def __init__(self, program):
        compiled = program.compiled
        self.name = program.__name__
        self.donating = program.donate_argnums
        self.jitted = compiled.jitted
        self.central = compiled.central_call if compiled.central else None
        self.finish = compiled.finish

    def __call__(self, args, kwargs):
        donated = self.donating and donated_arrays(args, kwargs, self.donating, self.name)
        _guard.refusal = PlanMiss  # a variable among them: JAX's call raises (plan again)
        try:
            if self.central is None:
                out, token, _, sums = self.jitted(None, (), *args, **kwargs)
            else:
                out, token, _, sums = self.central(None, (), args, kwargs)
        finally:
            _guard.refusal = None
        if donated:  # what JAX took is deleted: a later call raises, not crashes
            forget_donated(donated)
        return self.finish(out, token, sums)


class CapturedCall(ArrayCall):
    """Arrays as arguments, variables reached by closure: their values go in as one tuple and
    come back as one (``state.CommitRecord``), read, dispatched and stored open under
    ``state.lock`` (one update at a time): no work per variable per call."""

    def __init__(self, program):
        super().__init__(program)
        self.held = tuple(v.variable_state for v in program.captured)
        self.record = state.CommitRecord(self.held)
        # Gone with its plan (a new plan, or the program collected): its variables go back.
        weakref.finalize(self, _retire, weakref.ref(self.record))
        self.binding = program.binding_of(((), (), program.captured))
        self.single = program.compiled.single

    def __call__(self, args, kwargs):
        if not _compat.trace_state_clean():
            raise transformed_error(self.name)
        donated = self.donating and donated_arrays(args, kwargs, self.donating, self.name)
        record = self.record
        with state.lock:
            state.poll()  # first: a step seen to have failed is rolled back
            state.check(self.held)  # and a failure not reported yet is raised
            values = record.current()
            _guard.refusal = PlanMiss
            try:
                if self.central is None:
                    out, token, writes, sums = self.jitted(self.binding, values, *args, **kwargs)
                else:
                    out, token, writes, sums = self.central(self.binding, values, args, kwargs)
            finally:
                _guard.refusal = None
            if writes:
                state.write_record(record, writes, out is not None, self.single)
        if donated:
            forget_donated(donated)
        return self.finish(out, token, sums)


def _retire(record_ref) -> None:
    """A captured-variables plan is gone: its record gives its variables back (if it lives:
    held weakly, so that a record nothing else holds goes with its plan)."""
    record = record_ref()
    if record is not None:
        state.retire(record)


class VariableCall(ArrayCall):
    """Variables among the arguments: each call swaps them for their values
    (``take_variables``); their writes, and the captured variables', are stored open one by
    one (``state.write_open``)."""

    def __init__(self, program):
        super().__init__(program)
        self.binding_of = program.binding_of
        self.captured = program.captured
        self.held = tuple(v.variable_state for v in program.captured)
        self.single = program.compiled.single

    def __call__(self, args, kwargs):
        donated = self.donating and donated_arrays(args, kwargs, self.donating, self.name)
        with state.lock:
            state.poll()  # first: a step seen to have failed is rolled back before the read
            key, a, k = take_variables(args, kwargs, self.captured)
            held = tuple(v.variable_state for v in key[1]) + self.held
            state.check(held)  # a failure not reported yet: raised, nothing run
            bound = self.binding_of(key)
            if held and not _compat.trace_state_clean():
                raise transformed_error(self.name)
            if key[1] and self.donating:
                check_not_donating("variables", args, self.donating, self.name)
            values = tuple(map(_value, self.held))
            if self.central is None:
                out, token, writes, sums = self.jitted(bound, values, *a, **k)
            else:
                out, token, writes, sums = self.central(bound, values, a, k)
            if writes:
                state.write_open(held, writes, out is not None, self.single)
        if donated:
            forget_donated(donated)
        return self.finish(out, token, sums)


class GraphCall:
    """NNX objects among the arguments: split into graph definition and state, run by an inner
    program on their state, updated with the state it ends with (as ``nnx.jit`` does).

    Attributes:
        programs: ``{(structure, positions, GraphDef): inner Program}``.
    """

    def __init__(self, program):
        self.program = program
        self.placement = program.strategy.extended.placement
        self.programs = {}

    def __call__(self, args, kwargs):
        program = self.program
        try:
            key, nnx_state, nodes, others = graphs.split_arguments(args, kwargs, self.placement)
            inner = self.programs.get(key)
            if inner is None:
                inner = self.programs[key] = self._inner(key, args)
            out, new_state = inner(nnx_state, others)
        except (RuntimeError, ValueError):  # a deleted array: named as the caller passed it
            check_alive(args, kwargs, program.__name__)
            raise
        graphs.update(nodes, new_state)  # while the program runs; undone if it fails
        if inner.compiled.effects or program.waits_for_objects:
            # A host callback may fail at run time; the objects must not keep a failed step's
            # arrays (they would raise on every later read), so wait for it here.
            try:
                jax.block_until_ready((out, new_state))
            except Exception:
                graphs.update(nodes, nnx_state)  # as before the call, as nnx.jit leaves them
                _compat.forget_failed_effect_tokens()  # reported here, not again at exit
                raise
        return out

    def _inner(self, key, args):
        program = self.program
        step = functools.partial(_graph_step, program.fn_ref, key)
        step.__name__ = program.__name__
        step.user_function_ref = program.fn_ref  # whose closure graphs.check_constants checks
        # Donating an NNX object donates its state: the object gets the new arrays.
        donated = any(graphs.has_graph_nodes(args[i]) for i in program.donate_argnums
                      if i < len(args))
        return program.nested(step, donated)


def _graph_step(fn_ref, key, nnx_objects, others):
    """A step given NNX objects (``graphs``); its parameter names name the arguments in warnings."""
    return graphs.merged_call(fn_ref(), key, nnx_objects, others)


def planned(program, current, args, kwargs, miss=None):
    """The plan for these arguments: the slow path (the first call, and each ``PlanMiss``).

    Args:
        program: the ``Program``.
        current: its plan so far (``None`` before the first call).
        args: the call's positional arguments.
        kwargs: its keyword arguments.
        miss: the ``PlanMiss`` that JAX's call raised, if any.

    Returns:
        A plan: ``plan(args, kwargs)`` runs the call.
    """
    if miss is not None and miss.variables:
        program.capture(miss.variables)
    if isinstance(current, CapturedCall):
        state.retire(current.record)  # a new plan (or this one again) takes the variables
    if isinstance(current, GraphCall):
        return current
    if (miss is not None and miss.graphs) or graphs.has_graph_nodes((args, kwargs)):
        return GraphCall(program)
    if isinstance(current, VariableCall) or has_variables(args, kwargs):
        plan = VariableCall(program)
    elif program.captured:
        plan = CapturedCall(program)
    else:
        plan = ArrayCall(program)
    if miss is not None and not miss.variables and type(plan) is type(current):
        # JAX met an array-like that is no variable of a step (a handle): no plan takes it.
        leaves = jax.tree.leaves((args, kwargs), is_leaf=is_distributed)
        kinds = sorted({type(x).__name__ for x in leaves
                        if hasattr(x, "read_value") and not isinstance(x, Stateful)})
        raise TypeError(
            f"run: `{program.__name__}` got {', '.join(kinds) or 'an array-like object'} as an "
            f"argument, which a step cannot take as a variable; pass its value "
            f"(`x.read_value()`), or use it by closure.")
    return plan


def repaired(program, args, kwargs, err):
    """JAX refused a call's arguments with ``err``: name the argument, or mirror misplaced ones.

    Called while ``err`` is handled. A bad argument (a string, a ragged list) or a deleted
    array raises its own clear error in place of JAX's; arrays committed to devices other than
    the strategy's are mirrored onto its devices, as TF does (each call that gets them pays a
    copy; said once per step); anything else is ``err`` raised again, and so is an error the
    step's trace raised (its Python is not run twice).

    Args:
        program: the ``Program``.
        args: the call's positional arguments.
        kwargs: its keyword arguments.
        err: JAX's (or the step's) ``TypeError``, ``ValueError`` or ``RuntimeError``.

    Returns:
        ``(args, kwargs)`` with the misplaced arrays mirrored, to call again with.
    """
    from_trace = raised_in_trace(err)
    if not isinstance(err, RuntimeError):
        check_arguments(args, kwargs, "run")  # a bad one: name it, in place of JAX's error
    check_alive(args, kwargs, program.__name__)  # a deleted one (one device: a ValueError)
    if isinstance(err, RuntimeError):
        raise err
    # Also names a PerReplica of another strategy (its components on other devices).
    args, kwargs, names = mirror_misplaced(
        program.strategy.extended.placement, args, kwargs, program.donate_argnums)
    if from_trace or not names:  # the step's own error (its Python ran once), or JAX's about
        raise err  # something else: not ours to retry
    warn_mirrored_once(program, names)
    return args, kwargs


def transformed_error(name: str) -> RuntimeError:
    """The error for a step with variables called inside ``jax.jit``/``grad``/``scan``."""
    return RuntimeError(
        f"{name}: a step that uses jaxmirror Variables cannot be called inside jax.jit, "
        f"jax.grad or lax.scan (its assignments would be lost); call it directly, or pass "
        f"arrays instead of variables.")


__all__ = ["ArrayCall", "CapturedCall", "GraphCall", "VariableCall", "planned", "repaired",
           "transformed_error"]
