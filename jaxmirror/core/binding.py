"""Variables bound to a trace: the traced stand-ins that ``run`` and ``update`` give them.

What variables (``core.stateful.Stateful``) and compiled steps share. A variable is a stateful
box, but a compiled step is a pure function. While ``run`` traces the step function it pushes a
``Frame`` that binds every variable the step touches to a ``Slot``: reads return the slot's
(traced, per-replica) value, assignments replace it. After the trace the written slots become
extra outputs of the same program, and ``run`` stores them back into the variables once the call
has succeeded, so a step that fails changes nothing.

A variable the step reaches by closure is not an input of the program being traced. The frame
then *discovers* it: it hands out a placeholder so tracing can go on, and the program is traced
again with the discovered variables as inputs (once; later calls pass them directly). The
discovery leaves ``jax.jit`` as ``PlanMiss``, the one signal a step's call plan takes from it.
"""

from __future__ import annotations

import contextlib
import threading

import jax.numpy as jnp

from jaxmirror.core import _compat

_local = threading.local()


class PlanMiss(Exception):
    """The one signal out of a step's ``jax.jit`` call: these arguments need another call plan.

    Only JAX's own call can find some things out, and only an exception leaves it: a variable
    where the plan had an array (JAX abstracts it: see ``_compat.array_like_guard``), variables
    the trace reached by closure (``Frame``), NNX objects among the arguments (the trace sees
    them taken apart as pytrees). ``Program`` catches it in one place, plans again on its slow
    path (``step/call_plan.py``) and calls again; nothing ran.

    Args:
        variables: variables the trace met that the program does not take as inputs yet.
        graphs: whether NNX objects were among the arguments.
    """

    def __init__(self, variables: tuple = (), graphs: bool = False):
        super().__init__(f"the step's call plan missed: {len(variables)} variable(s) captured "
                         f"by closure" + (", NNX objects among the arguments" if graphs else ""))
        self.variables = variables
        self.graphs = graphs


class Slot:
    """One variable's traced value inside a frame.

    Attributes:
        var: the variable.
        value: its current value as this replica sees it (a tracer).
        mirrored: whether ``value`` is known to be the same on every replica.
        written: whether the step assigned the variable.
        used: whether the step read or assigned it (a variable bound in case the step uses it
            and then unused is not an input of the program).
        updating: depth of ``extended.update`` calls on it (assignments then write components as
            they are, with no aggregation).
        update_mirrored: whether the innermost ``update``'s arguments are the same on every
            replica (then so is what it writes, if the variable was).
    """

    __slots__ = ("var", "value", "mirrored", "written", "used", "updating", "update_mirrored")

    def __init__(self, var, value, mirrored: bool):
        self.var = var
        self.value = value
        self.mirrored = mirrored
        self.written = False
        self.used = False
        self.updating = 0
        self.update_mirrored = True

    def write(self, value, mirrored: bool) -> None:
        self.value = value
        self.mirrored = mirrored
        self.written = True


class Frame:
    """The variables bound while one step (or one eager ``update``) is traced.

    Args:
        strategy: the strategy whose program is being traced.
        axis_name: the replica axis inside the program, ``None`` for an eager update.
        discover: whether a variable met for the first time becomes a discovered input (``run``)
            or is left to its eager behaviour (``update``).
        adopt: for an eager ``update``: ``adopt(var)`` gives the value a variable first met
            inside ``fn`` starts from (its component); ``None`` otherwise.
    """

    def __init__(self, strategy, axis_name, discover: bool, adopt=None):
        self.strategy = strategy
        self.axis_name = axis_name
        self.num_replicas = strategy.num_replicas_in_sync
        self.discover = discover
        self.adopt = adopt  # eager update: the value a variable met inside ``fn`` starts from
        self.trace = _compat.current_trace()  # writes must happen at this level, not nested
        self.slots: dict[int, Slot] = {}
        self.discovered: list = []

    def bind(self, var, value, mirrored: bool) -> Slot:
        slot = self.slots.get(id(var))
        if slot is None:
            slot = self.slots[id(var)] = Slot(var, value, mirrored)
        return slot

    def lookup(self, var) -> Slot | None:
        """The variable's slot; a first meeting in a ``run`` trace discovers the variable."""
        slot = self.slots.get(id(var))
        if slot is not None:
            if self.discovered and any(var is d for d in self.discovered) and self._nested():
                raise PlanMiss(tuple(self.discovered))
            slot.used = True
            return slot
        if self.adopt is not None:  # inside update's fn every variable is a component
            slot = self.bind(var, self.adopt(var), mirrored=not var.stored_per_replica)
            slot.updating = 1
            return slot
        if not self.discover:
            return None
        var.check_usable_in(self.strategy)
        self.discovered.append(var)
        if self._nested():
            # A nested jax.jit (or scan/cond body) may cache its trace: it must never see the
            # placeholder. Stop here; the retrace passes the variable in.
            raise PlanMiss(tuple(self.discovered))
        # A placeholder of the right per-replica shape lets the trace finish; it is thrown away.
        placeholder = jnp.zeros(var.shape, var.dtype)
        return self.bind(var, placeholder, mirrored=not var.stored_per_replica)

    def _nested(self) -> bool:
        trace = _compat.current_trace()
        return trace is not self.trace and _compat.is_staging(trace)

    def written(self) -> list[Slot]:
        return [s for s in self.slots.values() if s.written]


def current() -> Frame | None:
    """The innermost frame of this thread, or ``None`` outside every trace."""
    frames = getattr(_local, "frames", None)
    return frames[-1] if frames else None


@contextlib.contextmanager
def pushed(frame: Frame):
    frames = getattr(_local, "frames", None)
    if frames is None:
        frames = _local.frames = []
    frames.append(frame)
    try:
        yield frame
    finally:
        frames.pop()


@contextlib.contextmanager
def updating(slots, mirrored: bool):
    """Inside ``extended.update``: assignments to these slots write components as given."""
    saved = [s.update_mirrored for s in slots]
    for s in slots:
        s.updating += 1
        s.update_mirrored = mirrored
    try:
        yield
    finally:
        for s, m in zip(slots, saved):
            s.updating -= 1
            s.update_mirrored = m
