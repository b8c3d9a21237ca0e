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
the functions of its own module that it calls, a few levels deep), once per trace.
"""

from __future__ import annotations

import dis
import functools
import inspect

import jax
from flax import nnx
from flax.nnx import graphlib

# How many levels of the user's own helper functions are followed from the step.
_DEPTH = 3
# Containers bigger than this (a global list of thousands of arrays) are not searched.
_MAX_LEAVES = 1000


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
    while isinstance(fn, functools.partial):
        for i, value in enumerate(fn.args):
            _note(f"partial argument {i}", value, found)
        for name, value in fn.keywords.items():
            _note(f"partial argument {name}", value, found)
        fn = fn.func
    if inspect.ismethod(fn):
        _note("self", fn.__self__, found)
        fn = fn.__func__
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
        _follow(value, fn, found, seen, depth)
    for name in _global_names(code):
        if name in fn.__globals__:
            value = fn.__globals__[name]
            _note(name, value, found)
            _follow(value, fn, found, seen, depth)


def _follow(value, fn, found: dict, seen: set, depth: int) -> None:
    # Only the user's own helpers (defined in the step's module): never into libraries.
    if inspect.isfunction(value) and value.__module__ == getattr(fn, "__module__", None):
        _search(value, found, seen, depth - 1)


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
    if graphlib.is_graph_node(value):
        found.setdefault(id(value), (name, value))
    elif isinstance(value, (list, tuple, dict)):
        leaves = jax.tree.leaves(value, is_leaf=graphlib.is_graph_node)
        if len(leaves) <= _MAX_LEAVES:
            for leaf in leaves:
                if graphlib.is_graph_node(leaf):
                    found.setdefault(id(leaf), (name, leaf))


def _arrays_of(obj) -> list:
    if isinstance(obj, nnx.Variable):
        return [obj.get_value()]
    return jax.tree.leaves(nnx.state(obj))


def check_constants(fn, consts, api: str) -> None:
    """Refuse a trace of ``fn`` whose constants include arrays of NNX objects it reached by
    closure (they would be frozen at this trace's values).

    Args:
        fn: the user's step function.
        consts: the constants of its traced program.
        api: the name errors start with.

    Raises:
        ValueError: naming the objects and saying to pass them as arguments.

    Example:
        >>> check_constants(lambda x: x, [], "run")  # nothing reached: nothing to refuse
    """
    if not consts:
        return
    reached = reached_objects(fn)
    if not reached:
        return
    const_ids = {id(c) for c in consts}
    read = [(name, obj) for name, obj in reached
            if any(id(a) in const_ids for a in _arrays_of(obj))]
    if not read:
        return
    names = ", ".join(f"`{name}` ({type(obj).__name__})" for name, obj in read)
    example = read[0][0] if read[0][0].isidentifier() else "model"
    raise ValueError(
        f"{api}: the step reads flax NNX state it reaches by closure, not through its "
        f"arguments: {names}. The values would be compiled into the step as constants, so later "
        f"calls would keep using today's values (a TF tf.function reads them by reference; a "
        f"compiled JAX step cannot). Pass the object as an argument of the step, e.g. "
        f"`step({example}, batch)` for `def step({example}, batch)`; the step then reads its "
        f"current state on every call, and any updates it makes come back to it."
    )
