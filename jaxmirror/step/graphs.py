"""flax NNX objects in steps: as arguments, split and updated after; by closure, refused.

As arguments, a step does what ``nnx.jit`` does (``split_arguments``, ``merged_call``,
``update``): the objects are split into a graph definition and an ``nnx.State``, the function
runs on objects merged back, and the caller's objects get the state they end with, so an
optimizer's update or BatchNorm's statistics are visible after. The state goes in replicated
and comes back Mirrored, or ``PerReplica`` where the replicas made it differ. A step that takes
``nnx.State`` (``nnx.split`` once, ``nnx.merge`` inside) skips the per-call split.

By closure (a global ``model``, a closure cell, a ``functools.partial`` argument, a bound
method's ``self``), an object's arrays would be baked into the program as constants, and later
calls would silently use the first values. TF's tutorial does this, and it works there because
``tf.function`` reads variables by reference. Here the trace is checked instead: the step's
bytecode, callables and partials are walked once per trace, and a step whose constants hold
such an object's arrays is refused before it runs, saying to pass the object as an argument.
"""

from __future__ import annotations

import dis
import functools
import inspect
import sysconfig

import jax
from flax import nnx

from jaxmirror.core import _compat, context
from jaxmirror.core.values import is_distributed
from jaxmirror.step.analysis import jaxpr_walk


def is_graph_node(x) -> bool:
    """Whether ``x`` is an NNX object (a module, an optimizer, ``nnx.Rngs``...).

    Args:
        x: anything.

    Returns:
        True for flax NNX graph nodes other than a bare ``nnx.Variable`` (an ``nnx.State``
        holds those: a step takes them as the pytrees they are).

    Example:
        >>> from flax import nnx
        >>> is_graph_node(nnx.Linear(2, 1, rngs=nnx.Rngs(0))), is_graph_node({"w": 1})
        (True, False)
    """
    return _compat.is_graph_node(x) and not isinstance(x, nnx.Variable)


def _graph_or_distributed(x) -> bool:
    return is_distributed(x) or is_graph_node(x)


def has_graph_nodes(tree) -> bool:
    """Whether ``tree`` holds NNX objects (checked once per traced signature)."""
    return any(map(is_graph_node, jax.tree.leaves(tree, is_leaf=_graph_or_distributed)))


def split_arguments(args, kwargs, placement):
    """The arguments as ``(key, state, nodes, others)``: NNX objects split together.

    Args:
        args: the step's positional arguments.
        kwargs: its keyword arguments.
        placement: the strategy's ``Placement``; state arrays not on all its devices are
            replicated onto them.

    Returns:
        ``key``: ``(structure, positions of the NNX objects, their GraphDef)`` (hashable);
        ``state``: their ``nnx.State``; ``nodes``: the objects; ``others``: the other leaves.
    """
    leaves, tree = jax.tree.flatten((args, kwargs), is_leaf=_graph_or_distributed)
    positions = tuple(i for i, x in enumerate(leaves) if is_graph_node(x))
    nodes = [leaves[i] for i in positions]
    if not _compat.trace_state_clean():  # the objects could not be updated out of that trace
        raise RuntimeError(
            "a step given flax NNX objects was called inside jax.jit, nnx.jit or another JAX "
            "transformation (TF's @tf.function around a distributed step): the step is "
            "compiled already, and the objects' updates cannot leave the outer trace; call the "
            "step directly (drop the outer jit), or pass nnx.state(...) arrays instead.")
    graphdef, state = nnx.split(nodes)  # one split: objects shared between arguments stay shared
    state = jax.tree.map(lambda x: _on_devices(x, placement), state, is_leaf=is_distributed)
    taken = set(positions)
    others = [x for i, x in enumerate(leaves) if i not in taken]
    return (tree, positions, graphdef), state, nodes, others


def _on_devices(x, placement):
    if isinstance(x, jax.Array) and x.sharding.device_set != placement.device_set:
        return placement.replicate(x)
    return x


def merged_call(fn, key, state, others):
    """``fn`` called on NNX objects merged from ``state`` (inside the step's trace).

    Each replica draws its own random numbers (dropout masks differ across replicas, as the
    rows of one device's batch would): the replica id is folded into every ``nnx.Rngs`` key for
    the call, and the stored keys stay the same on every replica.

    Args:
        fn: the user's step function.
        key: as ``split_arguments`` gave it.
        state: the (traced) state.
        others: the other (traced) leaves.

    Returns:
        ``(fn's result, the objects' state after the call)``.

    Raises:
        ValueError: when ``fn`` changed the objects' structure or static attributes
            (``model.eval()``), which a step cannot carry out of its program.
    """
    tree, positions, graphdef = key
    nodes = nnx.merge(graphdef, state)
    leaves, rest = [], iter(others)
    slots = dict(zip(positions, nodes))
    for i in range(len(positions) + len(others)):
        leaves.append(slots[i] if i in slots else next(rest))
    args, kwargs = jax.tree.unflatten(tree, leaves)
    ctx = context.current().replica_context
    keys = [v for _, v in nnx.iter_graph(nodes) if isinstance(v, nnx.RngKey)]
    stored = [v[...] for v in keys]
    if ctx is not None and ctx.num_replicas_in_sync > 1:
        for v, k in zip(keys, stored):
            v.set_value(jax.random.fold_in(k, ctx.replica_id_in_sync_group))
    out = fn(*args, **kwargs)
    for v, k in zip(keys, stored):
        v.set_value(k)  # the count moved on; the key stays the one every replica shares
    new_graphdef, new_state = nnx.split(nodes)
    if new_graphdef != graphdef and not _carried_by_update(graphdef, state, new_graphdef,
                                                           new_state):
        raise ValueError(
            "run: the step changed the NNX objects passed to it beyond their state (a static "
            "attribute such as `model.eval()`/`model.train()` set, or a submodule added or "
            "removed); a compiled step carries only their state out; do that outside the "
            "step, before calling it."
        )
    return out, new_state


def _carried_by_update(graphdef, state, new_graphdef, new_state) -> bool:
    # New variables (``sow``n intermediates) reach the caller's objects through nnx.update;
    # static attributes (``model.eval()``) do not. Tried once, at trace time, on a copy.
    probe = nnx.merge(graphdef, state)
    nnx.update(probe, new_state)
    return nnx.graphdef(probe) == new_graphdef


def update(nodes, state) -> None:
    """Write the state a step ended with into the caller's NNX objects (``nnx.update``).

    Args:
        nodes: the objects ``split_arguments`` split.
        state: the step's new state for them.
    """
    nnx.update(nodes, state)


# NNX objects a step reads by closure: found after its trace, and refused.

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
    if _compat.is_graph_node(fn):  # a module called as the step: `strategy.run(model, ...)`
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
    if _compat.is_graph_node(value):
        found.setdefault(id(value), (name, value))
        return
    if not isinstance(value, (list, tuple, dict)):
        if _plain_object(value):  # `trainer.model`, a SimpleNamespace of objects
            for attr, child in list(vars(value).items())[:_MAX_ITEMS]:
                if _compat.is_graph_node(child):
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
            if _compat.is_graph_node(child):
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
    if _compat.is_graph_node(obj):
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


__all__ = ["check_constants", "has_graph_nodes", "is_graph_node", "merged_call", "reached_objects",
           "split_arguments", "update"]
