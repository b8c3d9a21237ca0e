"""flax NNX objects a step reads by closure: found after its trace, and refused.

A step's inputs are its arguments. An NNX object it reaches otherwise (a global ``model``, a
variable of an enclosing function, a ``functools.partial`` argument, the ``self`` of a bound
method) is read while the step is traced, so its arrays are baked into the compiled program as
constants: later calls keep using the values of the first one, with no error. TF's custom
training tutorial does exactly this (its ``test_step`` reads ``model`` from the notebook), and
it works there because a ``tf.function`` reads variables by reference. Here the trace is
checked instead: if a constant of the program is an array of such an object, the step is
refused before it runs, with a message saying to pass the object as an argument.

Finding the objects walks the step's bytecode (the globals it loads, its closure cells, and
the user's own functions it calls, a few levels deep), the attributes of a callable object or
of a bound method's ``self``, and ``functools.partial`` and ``functools.wraps`` layers, once per
trace; the constants (those of inner ``jax.jit`` calls included) are read only when it finds one.
"""

from __future__ import annotations

import dis
import functools
import inspect
import sysconfig

import jax
from flax import nnx
from flax.nnx import graphlib

from jaxmirror.step import jaxpr_walk

# How many levels of the user's own helper functions are followed from the step.
_DEPTH = 3
# How many container items are looked at per value the step reaches (a global list of
# thousands of arrays is not searched to its end).
_MAX_ITEMS = 1000
# Where libraries live: their functions are never followed.
_LIBRARY_DIRS = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib",
                                                           "platlib")})


def reached_objects(fn) -> list:
    """The NNX objects (and bare ``nnx.Variable``s) ``fn`` can reach without arguments.

    Args:
        fn: the step function (a function, a bound method or a ``functools.partial``).

    Returns:
        ``(name, object)`` pairs, each object once.

    Example:
        >>> from flax import nnx
        >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> [name for name, _ in reached_objects(lambda x: model(x))]
        ['model']
    """
    found: dict = {}
    _search(fn, found, set(), _DEPTH)
    return list(found.values())


def _search(fn, found: dict, seen: set, depth: int) -> None:
    if id(fn) in seen or depth < 0:
        return
    seen.add(id(fn))
    while True:
        if isinstance(fn, functools.partial):
            for i, value in enumerate(fn.args):
                _note(f"partial argument {i}", value, found)
            for name, value in fn.keywords.items():
                _note(f"partial argument {name}", value, found)
            fn = fn.func
        elif getattr(fn, "__wrapped__", None) is not None:  # functools.wraps, jax.jit
            fn = fn.__wrapped__
        else:
            break
    if graphlib.is_graph_node(fn):  # a module called as the step: `strategy.run(model, ...)`
        _note("the step itself", fn, found)
        return
    if inspect.ismethod(fn):
        _note_attributes("self", fn.__self__, found)
        fn = fn.__func__
    elif not inspect.isfunction(fn) and callable(fn):  # an object with __call__
        _note_attributes("self", fn, found)
        fn = getattr(type(fn), "__call__", None)
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    cells = dict(zip(code.co_freevars, fn.__closure__ or ()))
    for name, cell in cells.items():
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not filled yet
            continue
        _note(name, value, found)
        _follow(value, found, seen, depth)
    for name in _global_names(code):
        if name in fn.__globals__:
            value = fn.__globals__[name]
            _note(name, value, found)
            _follow(value, found, seen, depth)


def _follow(value, found: dict, seen: set, depth: int) -> None:
    # Only the user's own helpers (also under jax.jit or functools.wraps): never into
    # libraries (flax, optax, jax, the stdlib).
    if callable(value) and getattr(value, "__wrapped__", None) is not None:
        try:
            value = inspect.unwrap(value)
        except ValueError:  # a cycle of __wrapped__
            return
    if inspect.isfunction(value) and not _in_library(value):
        _search(value, found, seen, depth - 1)


def _in_library(fn) -> bool:
    path = getattr(fn.__code__, "co_filename", "")
    return path.startswith(_LIBRARY_DIRS) or (fn.__module__ or "").split(".")[0] == "jaxmirror"


def _global_names(code) -> set:
    names = set()
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            names.add(instruction.argval)
    for const in code.co_consts:  # lambdas, comprehensions and functions defined inside
        if inspect.iscode(const):
            names |= _global_names(const)
    return names


def _note(name: str, value, found: dict) -> None:
    """Record ``value``, or the NNX objects inside a plain container of it (bounded)."""
    if graphlib.is_graph_node(value):
        found.setdefault(id(value), (name, value))
        return
    if not isinstance(value, (list, tuple, dict)):
        if _plain_object(value):  # `trainer.model`, a SimpleNamespace of objects
            for attr, child in list(vars(value).items())[:_MAX_ITEMS]:
                if graphlib.is_graph_node(child):
                    found.setdefault(id(child), (f"{name}.{attr}", child))
        return
    stack, visited, budget = [value], set(), _MAX_ITEMS
    while stack and budget > 0:
        item = stack.pop()
        if id(item) in visited:
            continue
        visited.add(id(item))
        for child in (item.values() if isinstance(item, dict) else item):
            budget -= 1
            if graphlib.is_graph_node(child):
                found.setdefault(id(child), (name, child))
            elif isinstance(child, (list, tuple, dict)):
                stack.append(child)
            if budget <= 0:
                break


def _plain_object(value) -> bool:
    """An instance with attributes of its own, not a module, class, function or array."""
    return (hasattr(value, "__dict__") and not isinstance(value, jax.Array)
            and not inspect.ismodule(value) and not inspect.isclass(value)
            and not inspect.isroutine(value) and not isinstance(value, functools.partial))


def _note_attributes(name: str, obj, found: dict) -> None:
    """``obj`` itself, or the NNX objects among its attributes (``self.model``)."""
    if graphlib.is_graph_node(obj):
        _note(name, obj, found)
        return
    for attr, value in list(getattr(obj, "__dict__", {}).items())[:_MAX_ITEMS]:
        _note(f"{name}.{attr}", value, found)


def _arrays_of(obj) -> list:
    if isinstance(obj, nnx.Variable):
        return [obj.get_value()]
    return jax.tree.leaves(nnx.state(obj))


def check_constants(fn, closed, api: str) -> None:
    """Refuse a trace of ``fn`` whose constants include arrays of NNX objects it reached by
    closure (they would be frozen at this trace's values).

    Args:
        fn: the user's step function.
        closed: its traced program, a ``ClosedJaxpr``.
        api: the name errors start with.

    Raises:
        ValueError: naming the objects and saying to pass them as arguments.

    Example:
        >>> import jax
        >>> check_constants(lambda x: x, jax.make_jaxpr(lambda x: x)(1.0), "run")  # fine
    """
    reached = reached_objects(fn)
    if not reached:
        return
    const_ids = {id(c) for c in jaxpr_walk.all_constants(closed)}
    read = [(name, obj) for name, obj in reached
            if any(id(a) in const_ids for a in _arrays_of(obj))]
    if not read:
        return
    names = ", ".join(f"`{name}` ({type(obj).__name__})" for name, obj in read)
    example = read[0][0].rsplit(".", 1)[-1]
    example = example if example.isidentifier() else "model"
    raise ValueError(
        f"{api}: the step reads flax NNX state it reaches by closure, not through its "
        f"arguments: {names}. The values would be compiled into the step as constants, so later "
        f"calls would keep using today's values (a TF tf.function reads them by reference; a "
        f"compiled JAX step cannot). Pass the object as an argument of the step, e.g. "
        f"`step({example}, batch)` for `def step({example}, batch)`; the step then reads its "
        f"current state on every call, and any updates it makes come back to it. (A model that "
        f"never changes, a frozen teacher say, may be closed over as arrays: `graphdef, state = "
        f"nnx.split(teacher)` outside, `nnx.merge(graphdef, state)` inside.)"
    )
