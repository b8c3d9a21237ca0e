"""A step function's program: ``Program``, the strategy's cache of them, and ``Step``.

``Program`` is what ``strategy.run``, ``@strategy.run`` and ``strategy.function`` share. A call
is a short pipeline: the call plan for this kind of arguments (``call_plan``: plain arrays,
variables by closure or as arguments, NNX objects), the jitted call (``compiled``), the
variables' writes stored open, the in-flight tracking. The plan is chosen on the slow path only
(the first call, and when JAX's call meets what the plan does not cover); the fast path is the
plan's one jitted call, dispatched by ``jax.jit``'s C++ cache, with no Python walk over the
arguments.

``ProgramCache`` keeps each function's programs exactly as long as the function lives:
``strategy.run(fn, args)`` must find ``fn``'s program again on every call, but must not keep
``fn`` alive, nor what it reaches (its variables, their strategy, arrays in its closure), once
the user let go of it (re-running a notebook cell makes new functions every time, and each
compiled program costs native memory). Programs are found through weak references: a
function's programs go when the function goes, a bound method's when its object goes.
Callables that cannot be weakly referenced are kept, with their programs, in a small LRU.
``cache_of(strategy)`` finds a strategy's cache (for tests and diagnostics).

``Step`` is what ``@strategy.run`` and ``strategy.function`` return: it keeps the function
alive. ``RunOptions`` are ``run``'s options; ``check_can_run`` says where ``run`` may be
called; ``StaticBinding`` names the variables a call binds without keeping them alive.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import types
import weakref

from jaxmirror.core import context
from jaxmirror.core.binding import PlanMiss
from jaxmirror.runtime import watch
from jaxmirror.step import call_plan, graphs
from jaxmirror.step.arguments import take_variables
from jaxmirror.step.compiled import Compiled
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
        counts_into: the program whose ``trace_count``/``compile_count`` this one's traces add
            to (an NNX step's inner program counts into the user's); itself by default.
        sum_first_output_only: the outputs are ``(user's results, NNX state)``: only the
            first are summed in the step for ``strategy.reduce``.

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> double = Program(s, lambda x: 2 * x, weak=False)
        >>> float(double(3.0)), double.trace_count
        (6.0, 1)
    """

    def __init__(self, strategy, fn, donate_argnums=(), weak=True, counts_into=None,
                 sum_first_output_only=False):
        self._strategy = strategy
        if not weak:
            fn_ref = lambda: fn  # noqa: E731
        elif isinstance(fn, types.MethodType):
            fn_ref = weakref.WeakMethod(fn)
        else:
            fn_ref = weakref.ref(fn)
        self._fn_ref = fn_ref
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.wants_arguments = wants_arguments(fn)  # see Strategy.run
        self.trace_count = 0  # how often the user's function was traced
        self.compile_count = 0  # how often jax.jit traced (and so compiled) this program
        self.donate_argnums = tuple(donate_argnums)
        # Wait for every call before NNX objects among the arguments take its new state (a
        # fused step sets it: a failed call must leave the objects as they were).
        self.waits_for_objects = False
        self._captured = ()  # variables the step reaches by closure, found while tracing
        self._bindings = {}  # (positions, variables, captured) -> its StaticBinding
        self._plan = None  # how calls run (call_plan), chosen by the first call
        self.compiled = Compiled(self, counts_into or self, sum_first_output_only)

    @property
    def fn(self):
        """The user's per-replica function (``None`` once nothing else holds it)."""
        return self._fn_ref()

    @property
    def fn_ref(self):
        """A callable giving the user's function (a weak reference unless ``weak=False``)."""
        return self._fn_ref

    @property
    def strategy(self):
        """The strategy whose devices run the program."""
        return self._strategy

    @property
    def plan(self):
        """How calls run now (a ``call_plan`` object; ``None`` before the first call), for
        tests and diagnostics."""
        return self._plan

    @property
    def captured(self) -> tuple:
        """The variables the step reaches by closure (found by its traces)."""
        return self._captured

    @property
    def jitted(self):
        """The ``jax.jit`` function, called as ``jitted(binding, captured values, *args,
        **kwargs)`` (for benchmarks and tests)."""
        return self.compiled.jitted

    @property
    def handle_path(self) -> tuple:
        """Getters from an output to its smallest array (the last trace's)."""
        return self.compiled.handle_path

    def output_handle(self, out):
        """One array of the output ``out`` that tells when the call finished."""
        return self.compiled.handle(out)

    def nested_programs(self) -> list:
        """The inner programs of a step given NNX objects (one per graph structure)."""
        return list(getattr(self._plan, "programs", {}).values())

    def __new__(cls, strategy, *args, **kwargs):
        if cls is Program and strategy.extended.placement.multi_process:
            cls = _WatchedProgram  # one process keeps the plain hot path
        return super().__new__(cls)

    def __call__(self, *args, **kwargs):
        check_can_run(self._strategy)
        plan = self._plan
        if plan is None:  # the first call: classify the arguments (call_plan.planned)
            plan = self._plan = call_plan.planned(self, None, args, kwargs)
        while True:
            try:
                return plan(args, kwargs)
            except PlanMiss as miss:  # the one signal from inside jax.jit: plan again
                plan = self._plan = call_plan.planned(self, plan, args, kwargs, miss)
            except (TypeError, ValueError, RuntimeError) as err:  # JAX refused the arguments
                args, kwargs = call_plan.repaired(self, args, kwargs, err)  # or raises

    def capture(self, variables: tuple) -> None:
        """Take ``variables`` (reached by closure) as inputs of every call from now on."""
        known = set(map(id, self._captured))  # another thread may have found them first
        self._captured = self._captured + tuple(v for v in variables if id(v) not in known)
        self._plan = None if not isinstance(self._plan, call_plan.GraphCall) else self._plan

    def binding_of(self, key: tuple) -> StaticBinding:
        """The one ``StaticBinding`` of ``key`` (static arguments are compared by identity).

        Args:
            key: ``(positions, variables, captured)`` as ``take_variables`` gives it.

        Returns:
            The binding ``jitted`` takes as its static argument.
        """
        found = self._bindings.get(key)
        if found is None:
            found = self._bindings[key] = StaticBinding(*key)
        return found

    def nested(self, step, donated: bool) -> "Program":
        """The inner program of an NNX step (``call_plan.GraphCall``): it counts its traces
        here and sums only the user's results; donating donates the objects' state."""
        return Program(self._strategy, step, donate_argnums=(0,) if donated else (),
                       weak=False, counts_into=self, sum_first_output_only=True)

    def lower(self, *args, **kwargs):
        """The program for these arguments, lowered and not run (``jax.stages.Lowered``).

        Raises:
            TypeError: for NNX objects among the arguments (lower a step on their
                ``nnx.state`` instead).
        """
        check_can_run(self._strategy)
        if graphs.has_graph_nodes((args, kwargs)):
            raise TypeError(f"{self.__name__}.lower: NNX objects among the arguments; lower a "
                            f"step that takes their nnx.state instead.")
        while True:
            key, a, k = take_variables(args, kwargs, self._captured)
            bound = None if key == ((), (), ()) else self.binding_of(key)
            values = tuple(map(state_of, self._captured))
            if self.compiled.central:
                values, a, k = self._strategy.extended.placement.to_compute((values, a, k))
            try:
                return self.compiled.jitted.lower(bound, values, *a, **k)
            except PlanMiss as miss:  # the trace met variables by closure: take them
                self.capture(miss.variables)

    def __repr__(self) -> str:
        return f"<jaxmirror step {self.__name__} on {self._strategy!r}>"


class _WatchedProgram(Program):
    """A program across processes: the failure watch sees each call (``runtime/watch.py``)."""

    def __call__(self, *args, **kwargs):
        watch.entering(self.__name__)
        try:
            return Program.__call__(self, *args, **kwargs)
        finally:
            watch.left()


# Programs of callables that cannot be weakly referenced: the most recently used are kept.
MAX_STRONG = 256

# Each strategy's cache, weakly both ways: the strategy holds its cache, not this table.
_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ProgramCache:
    """``fn``'s ``Program`` for each ``donate_argnums``, alive while ``fn`` (or its object) is.

    Args:
        strategy: the strategy the programs run on.

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> cache = ProgramCache(s)
        >>> f = lambda x: x
        >>> cache.get(f, ()) is cache.get(f, ()), len(cache)
        (True, 1)
        >>> del f
        >>> len(cache)
        0
    """

    def __init__(self, strategy):
        self._strategy = strategy
        self._weak: dict = {}  # id(owner) -> (weakref to owner, {subkey: Program})
        self._strong: collections.OrderedDict = collections.OrderedDict()  # LRU
        _CACHES[strategy] = weakref.ref(self)  # for ``of`` (a strong value would keep it alive)

    def get(self, fn, donate_argnums: tuple) -> Program:
        """The program of ``fn`` with ``donate_argnums``, made on first use.

        Args:
            fn: the per-replica function (any callable).
            donate_argnums: a tuple of positional argument indices.

        Returns:
            The ``Program``.
        """
        if isinstance(fn, types.MethodType):
            owner, subkey = fn.__self__, (fn.__func__, donate_argnums)
        else:
            owner, subkey = fn, donate_argnums
        entry = self._weak.get(id(owner))
        if entry is None or entry[0]() is not owner:
            try:
                ref = weakref.ref(owner, _forgetter(self._weak, id(owner)))
            except TypeError:  # cannot be weakly referenced
                return self._get_strong(fn, donate_argnums)
            entry = self._weak[id(owner)] = (ref, {})
        programs = entry[1]
        program = programs.get(subkey)
        if program is None:
            program = programs[subkey] = Program(self._strategy, fn, donate_argnums)
        return program

    def _get_strong(self, fn, donate_argnums: tuple) -> Program:
        key = (id(fn), donate_argnums)  # ``fn`` is kept with its program, so its id stays its own
        hit = self._strong.get(key)
        if hit is not None:
            self._strong.move_to_end(key)  # in use: the last to be evicted
            return hit[1]
        program = Program(self._strategy, fn, donate_argnums, weak=False)
        self._strong[key] = (fn, program)
        if len(self._strong) > MAX_STRONG:
            self._strong.popitem(last=False)
        return program

    def programs(self) -> list:
        """Every program alive in the cache (for tests and diagnostics).

        Returns:
            A list of ``Program``s.
        """
        alive = [p for _, table in list(self._weak.values()) for p in table.values()]
        return alive + [p for _, p in self._strong.values()]

    def __len__(self) -> int:
        return len(self.programs())


def cache_of(strategy) -> ProgramCache | None:
    """The ``ProgramCache`` of ``strategy`` (for tests and diagnostics).

    Args:
        strategy: a strategy.

    Returns:
        The cache its ``run`` takes programs from (the latest made for it), or ``None`` for
        an object without one.

    Example:
        >>> import jax.numpy as jnp, jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> step = lambda x: x + 1
        >>> float(s.run(step, args=(jnp.float32(1),)))
        2.0
        >>> len(cache_of(s)), cache_of(s).get(step, ()).trace_count
        (1, 1)
    """
    try:
        ref = _CACHES.get(strategy)
    except TypeError:  # not weakly referenceable: no strategy of ours
        return None
    return None if ref is None else ref()


def _forgetter(table: dict, key: int):
    """A weakref callback dropping ``table[key]`` when its owner dies (and holding no cache)."""
    def forget(ref):
        entry = table.get(key)
        if entry is not None and entry[0] is ref:
            del table[key]
    return forget


class Step:
    """A step function compiled for every replica of a strategy; call it like the function.

    What ``@strategy.run`` and ``strategy.function`` return. The step holds the function, and
    the strategy keeps the compiled program for exactly as long as the function lives: a step
    (or function) you let go of takes its compiled program with it.

    Args:
        program: the ``Program`` that runs it.
        fn: the user's per-replica function.

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> @s.function
        ... def step(x):
        ...     return x + 1
        >>> float(step(1.0)), step.trace_count
        (2.0, 1)
    """

    def __init__(self, program, fn):
        self._program = program
        self.__wrapped__ = fn
        self.__name__ = program.__name__
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args, **kwargs):
        return self._program(*args, **kwargs)

    def lower(self, *args, **kwargs):
        """The step's program for these arguments, lowered but not run, as ``jax.jit``'s.

        ``.as_text()`` shows what the step emits, ``.compile().as_text()`` the collectives
        XLA runs (e.g. to see a ``cross_device_ops`` choice).

        Args:
            *args: the step's arguments, as for a call.
            **kwargs: its keyword arguments.

        Returns:
            A ``jax.stages.Lowered``.

        Example:
            >>> import jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> @s.function
            ... def step(x):
            ...     return jaxmirror.get_replica_context().all_reduce("sum", x)
            >>> "all-reduce" in step.lower(1.0).compile().as_text()
            True
        """
        return self._program.lower(*args, **kwargs)

    @property
    def program(self):
        """The compiled program (shared with ``strategy.run(fn, args)``)."""
        return self._program

    @property
    def fn(self):
        """The user's per-replica function."""
        return self.__wrapped__

    @property
    def trace_count(self) -> int:
        """How often the user's function was traced."""
        return self._program.trace_count

    @property
    def compile_count(self) -> int:
        """How often a program was built for it (a new placement of the inputs builds one)."""
        return self._program.compile_count

    def __repr__(self) -> str:
        return repr(self._program)


class StaticBinding:
    """The static jit argument naming the variables a call binds, without keeping them alive.

    JAX's compilation caches are global and keep a jitted function's static arguments until the
    function is collected; a tuple of variables there would keep the variables, their strategy,
    its programs and so the jitted function itself alive for ever. A ``_Binding`` holds weak
    references and compares by identity: ``Program._binding`` makes one per binding.
    """

    __slots__ = ("_positions", "_arguments", "_captured", "__weakref__")

    def __init__(self, positions: tuple, variables: tuple, captured: tuple):
        self._positions = positions
        self._arguments = tuple(map(weakref.ref, variables))
        self._captured = tuple(map(weakref.ref, captured))

    def resolve(self) -> tuple:
        """``(positions, variables, captured)`` as ``trace.trace_replica`` takes them."""
        return (self._positions, tuple(r() for r in self._arguments),
                tuple(r() for r in self._captured))


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Options for ``Strategy.run`` (``tf.distribute.RunOptions``, with JAX's own knobs).

    Args:
        donate_argnums: positions of ``args`` whose buffers the step may reuse for its outputs
            (``jax.jit``'s donation): pass the params' position so updated params are written in
            place of the old ones. A donated argument must not be used after the call.

    Example:
        >>> import jax.numpy as jnp, jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> params = s.run(lambda: jnp.zeros(3))
        >>> new = s.run(lambda p: p + 1, args=(params,),
        ...             options=jaxmirror.RunOptions(donate_argnums=(0,)))
        >>> new.tolist()
        [1.0, 1.0, 1.0]
    """

    donate_argnums: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "donate_argnums",
                           argnums(self.donate_argnums, "RunOptions", "donate_argnums"))


def argnums(nums, where: str, name: str) -> tuple:
    """Argument positions given as an int or a sequence of them, as a tuple.

    Args:
        nums: an int or a sequence of ints.
        where: the API name, for the error.
        name: the parameter's name, for the error.

    Returns:
        The positions as a tuple.

    Raises:
        ValueError: unless every position is a non-negative int.

    Example:
        >>> argnums(1, "RunOptions", "donate_argnums")
        (1,)
    """
    positions = (nums,) if isinstance(nums, int) else tuple(nums)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in positions):
        raise ValueError(f"{where}: `{name}` must be non-negative ints; got {nums!r}.")
    return positions


def wants_arguments(fn) -> bool:
    """True when ``fn`` has a required positional parameter (then ``run(fn)`` decorates)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               for p in params)


def check_can_run(strategy) -> None:
    """Refuse a ``run`` of ``strategy`` here, before any device work, as TF does.

    ``run`` inside a step that ``run`` is tracing raises, and so does a strategy's ``run`` inside
    another strategy's scope.

    Args:
        strategy: the strategy whose ``run`` is called.

    Raises:
        RuntimeError: in those two cases.
    """
    entry = context.current()
    if entry.in_run:
        where = ("; inside a merge_fn, run a function on every replica with "
                 "`strategy.extended.call_for_each_replica(fn, args)`" if entry.merging else "")
        raise RuntimeError(
            "run: called inside a function that `run` is already running; call the inner "
            "function directly, or, as TF says, \"Method requires being in cross-replica "
            f"context, use get_replica_context().merge_call()\"{where}."
        )
    if entry.strategy is not strategy and entry.strategy is not context.default_strategy():
        raise context.mixing_error(entry.strategy, strategy)


__all__ = ["MAX_STRONG", "Program", "ProgramCache", "RunOptions", "StaticBinding", "Step", "argnums",
           "cache_of", "check_can_run", "wants_arguments"]
