"""A step's arguments: what they may be, deleted and donated arrays, placing them on the devices.

What they may be: ``jax.jit`` refuses a string with an error that names no argument, and takes
a ragged nested list (``[[1, 2], [3]]``) as a pytree of scalars. ``check_arguments`` names the
bad argument by its path (``args[1]['x'][2]``, ``kwargs['lr']``) and says what is accepted. It
runs only when ``jax.jit`` refused a call and once per new input signature, not per call.

Deleted and donated arrays: JAX 0.10 crashes the process (a notebook's kernel dies) when a
donated array reaches a program over several devices on ``jax.jit``'s fast path, but raises an
error for an array deleted with ``.delete()``. So a step that donates deletes the arrays JAX
took after each call (``forget_donated``), and a failed call names a deleted argument
(``check_alive``). A step that donates nothing does no work per leaf. An array donated by the
user's own ``jax.jit`` is not seen here.

Placing: ``run`` takes Mirrored values as arrays replicated over the strategy's devices; arrays
made elsewhere would be refused or compile twice. ``replicate`` places a tree once,
``build_replicated`` builds it on the devices, and ``mirror_misplaced`` is what ``run`` does,
as TF does, with arrays given on other devices.
"""

from __future__ import annotations

import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmirror.core import _compat
from jaxmirror.core.stateful import Stateful, is_opaque
from jaxmirror.core.values import PerReplica, is_distributed, is_per_replica
from jaxmirror.step.graphs import is_graph_node
from jaxmirror.variables.state import state_of


ACCEPTED = ("Accepted are arrays (jax.Array, numpy) of a numeric or bool dtype, Python numbers, "
            "jaxmirror distributed values and variables, and nests (tuples, lists, dicts, "
            "dataclasses/pytrees) of them")

_SCALARS = (bool, int, float, complex)
_PLAIN_SEQUENCES = (list, tuple)  # exactly these: a namedtuple is a record, never ragged
_NEVER_NODES = (jax.Array, np.ndarray, np.generic, str, bytes)
_SHOWN = 40  # characters of a value's repr that a message shows
_LISTED = 8  # element lengths that a ragged-list message lists


def _type_name(t: type) -> str:
    module = t.__module__.split(".")[0]
    if module == "builtins":
        return t.__qualname__
    if module in ("numpy", "jax", "jaxlib"):
        return f"{'jax' if module == 'jaxlib' else module}.{t.__qualname__}"
    return f"{t.__module__}.{t.__qualname__}"


def _short_repr(x) -> str:
    text = repr(x)
    return text if len(text) <= _SHOWN else text[:_SHOWN - 3] + "..."


def describe_leaf(x) -> str:
    """What a leaf is, in a few words, for error messages.

    Args:
        x: any value.

    Returns:
        Its type, and its dtype and shape for an array, or a truncated repr of anything else.

    Example:
        >>> import numpy as np
        >>> describe_leaf(np.array([1, "a"], dtype=object))
        'numpy.ndarray of dtype object, shape (2,)'
        >>> describe_leaf("abc")
        "str 'abc'"
        >>> describe_leaf("x" * 100)
        "str 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx..."
    """
    if isinstance(x, (np.ndarray, jax.Array)):
        name = "jax.Array" if isinstance(x, jax.Array) else "numpy.ndarray"
        return f"{name} of dtype {x.dtype}, shape {tuple(x.shape)}"
    shown = x
    if isinstance(x, str):  # np.str_ too: its own repr would say np.str_('...') again
        shown = str(x)
    elif isinstance(x, bytes):
        shown = bytes(x)
    name, text = _type_name(type(x)), _short_repr(shown)
    if text.startswith(type(x).__name__ + "("):  # the repr names the type already
        return name[:len(name) - len(type(x).__name__)] + text
    return f"{name} {text}"


def _dtype_accepted(dtype) -> bool:
    """Bool, integer, floating (ml_dtypes' too) and complex dtypes, and JAX's float0."""
    return (dtype == np.bool_ or jnp.issubdtype(dtype, np.number)
            or dtype == jax.dtypes.float0)


def _leaf_problem(x) -> str | None:
    """Why ``x`` cannot be a step's argument (a hint on what to do), or None when it can."""
    if isinstance(x, jax.Array) or type(x) in _SCALARS:  # the common leaves, first
        return None
    if isinstance(x, (str, bytes)):  # np.str_ and np.bytes_ too
        return ("a string cannot go into a compiled step; pass it by closure (or "
                "functools.partial), or encode it as numbers first")
    if isinstance(x, (np.ndarray, np.generic)):
        if _dtype_accepted(x.dtype):
            return None
        if x.dtype == object:
            return ("NumPy made an object array of it (ragged rows or mixed types); give a "
                    "numeric array, e.g. np.asarray(x, dtype=np.float32), padded to one shape")
        if x.dtype.kind in "US":
            return ("an array of strings cannot go into a compiled step; pass it by closure, "
                    "or encode it as numbers first")
        return "convert it to a numeric array first"
    if isinstance(x, jax.ShapeDtypeStruct):
        return ("a ShapeDtypeStruct describes an array but holds no values; pass an array, "
                "e.g. jnp.zeros(s.shape, s.dtype)")
    if isinstance(x, _SCALARS) or hasattr(type(x), "__jax_array__"):
        return None
    try:  # a type JAX knows how to abstract (a registered array-like)
        jax.typeof(x)
    except (TypeError, ValueError):
        return ("pass it by closure (or functools.partial), or convert it to an array first")
    return None


class _Ragged(Exception):
    """A ragged nested list was found: where (keys) and what its elements' shapes are."""

    def __init__(self, keys, shapes):
        super().__init__()
        self.keys, self.shapes = keys, shapes


def _is_number(x) -> bool:
    """A Python number, or what ``jax.jit`` makes of one while tracing (a weak scalar)."""
    if type(x) in _SCALARS:
        return True
    if isinstance(x, jax.Array) and x.ndim == 0:
        aval = jax.typeof(x)
        return bool(getattr(aval, "weak_type", False)) or aval.dtype == np.bool_
    return False


def _stops(x) -> bool:
    return type(x) in _PLAIN_SEQUENCES or is_opaque(x)


def _walk(x, keys: tuple, bad: list):
    """The numeric shape of ``x`` when it is a (nest of lists of) number(s), else None.

    Plain lists and tuples are walked here, to see their shapes; every other node is flattened
    by JAX one level down to the next list, tuple or leaf, so each node is visited once. The
    first bad leaf goes into ``bad``; a ragged list raises ``_Ragged``.
    """
    if type(x) in _PLAIN_SEQUENCES:
        shapes = [_walk(c, keys + (jax.tree_util.SequenceKey(i),), bad)
                  for i, c in enumerate(x)]
        if any(s is None for s in shapes):
            return None
        if not shapes or all(s == shapes[0] for s in shapes):
            return (len(shapes),) + (shapes[0] if shapes else ())
        if all(shapes):  # every element a sequence of numbers, of different shapes
            raise _Ragged(keys, shapes)
        return None  # numbers mixed with lists: a pytree (jax.jit's reading), not an array
    if is_opaque(x):
        return None
    if _is_number(x):
        return ()
    if bad:
        return None
    if isinstance(x, _NEVER_NODES):  # leaves for sure: no flatten to find that out
        problem = _leaf_problem(x)
        if problem is not None:
            bad.append((keys, x, problem))
        return None
    flat, _ = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x and _stops(y))
    if len(flat) == 1 and flat[0][0] == () and flat[0][1] is x:  # x is a leaf
        problem = _leaf_problem(x)
        if problem is not None:
            bad.append((keys, x, problem))
        return None
    for path, child in flat:
        if bad:
            break
        if _stops(child):
            _walk(child, keys + path, bad)
        else:
            problem = _leaf_problem(child)
            if problem is not None:
                bad.append((keys + path, child, problem))
    return None


def _where(root: str, keys: tuple) -> str:
    return root + jax.tree_util.keystr(keys)


def _shapes_text(shapes) -> str:
    lengths = [s[0] for s in shapes]
    shown = lengths if len(set(lengths)) > 1 else [tuple(s) for s in shapes]
    more = ", ..." if len(shown) > _LISTED else ""
    kind = "lengths" if shown is lengths else "shapes"
    return f"{kind} [{', '.join(map(str, shown[:_LISTED]))}{more}]"


def check_arguments(args, kwargs, api: str) -> None:
    """Refuse arguments a step cannot take, naming the first bad one by its path.

    Distributed values (``PerReplica``, ``Mirrored``) and variables are accepted whole. A
    rectangular nested list of numbers is accepted (a pytree of scalars, as ``jax.jit`` reads
    it); a ragged one is refused, since it is almost always an array that NumPy could not make.
    The error is raised ``from None``: called while handling ``jax.jit``'s own error, it
    replaces it.

    Args:
        args: the positional arguments (a tuple); their paths read ``args[i]...``.
        kwargs: the keyword arguments (a dict, or None); paths read ``kwargs['name']...``.
        api: the API name that starts the messages (``"run"``).

    Raises:
        TypeError: for a leaf JAX cannot take: a string or bytes, a NumPy array or scalar of
            dtype object, string, bytes, void or datetime, a ``jax.ShapeDtypeStruct``, or any
            other object that is neither an array nor a number.
        ValueError: for a ragged nested list or tuple of numbers, with its elements' lengths.

    Example:
        >>> import numpy as np
        >>> check_arguments((np.ones(2), [[1, 2], [3, 4]]), {"lr": 0.1}, "run")
        >>> check_arguments((np.ones(2),), {"names": np.array(["a", "b"])}, "run")
        Traceback (most recent call last):
        ...
        TypeError: run: argument kwargs['names'] is numpy.ndarray of dtype <U1, shape (2,), ...
        >>> check_arguments(([[1, 2], [3]],), {}, "run")
        Traceback (most recent call last):
        ...
        ValueError: run: argument args[0] is a ragged nested list (its elements have lengths [2, 1]): ...
    """
    named = [(("args", jax.tree_util.SequenceKey(i)), arg) for i, arg in enumerate(args)]
    named += [(("kwargs", jax.tree_util.DictKey(k)), arg) for k, arg in (kwargs or {}).items()]
    bad = []
    for (root, key), arg in named:
        try:
            _walk(arg, (key,), bad)
        except _Ragged as ragged:
            if not bad:  # else a bad leaf came first
                raise ValueError(
                    f"{api}: argument {_where(root, ragged.keys)} is a ragged nested list (its "
                    f"elements have {_shapes_text(ragged.shapes)}): NumPy cannot make one array "
                    f"of it, and as a pytree it would be many separate Python scalars; pass an "
                    f"array (np.asarray, padded to one shape) or a pytree of arrays. {ACCEPTED}."
                ) from None
        if bad:
            keys, leaf, problem = bad[0]
            raise TypeError(
                f"{api}: argument {_where(root, keys)} is {describe_leaf(leaf)}, which a step "
                f"cannot take; {problem}. {ACCEPTED}."
            ) from None
def has_variables(args, kwargs) -> bool:
    """Whether the arguments hold variables (``Stateful`` leaves)."""
    return any(isinstance(x, Stateful)
               for x in jax.tree.leaves((args, kwargs), is_leaf=is_distributed))


def take_variables(args, kwargs, captured):
    """Variables in the arguments replaced by their arrays, and the static binding key.

    Returns:
        ``((positions, variables, captured), args, kwargs)``: the flat positions of the
        variables among the arguments' leaves, the variables, and the captured ones.
    """
    # Numbered as _trace numbers them: distributed values are leaves.
    leaves, tree = jax.tree.flatten((args, kwargs), is_leaf=is_distributed)
    positions, variables = [], []
    for i, x in enumerate(leaves):
        if isinstance(x, Stateful):
            positions.append(i)
            variables.append(x)
            leaves[i] = state_of(x)
    args, kwargs = jax.tree.unflatten(tree, leaves)
    return (tuple(positions), tuple(variables), captured), args, kwargs


def _donated_argument_holding(args, donate_argnums: tuple, predicate):
    """The first donated positional argument with a leaf ``predicate`` accepts, or None."""
    for i in donate_argnums:
        if i < len(args) and any(map(predicate,
                                     jax.tree.leaves(args[i], is_leaf=is_distributed))):
            return i
    return None


def _holds_a_batch(x) -> bool:
    return is_per_replica(x) and x.row_counts is not None


# What a donated argument may not hold: (the test of a leaf, why, what to donate instead).
_NOT_DONATABLE = {
    "variables": (lambda x: isinstance(x, Stateful),
                  "which holds jaxmirror Variables, and a variable's array is its state, "
                  "which cannot be donated",
                  "donate only arrays (variables are written back after the call anyway)"),
    "batches": (_holds_a_batch,
                "a batch from a distributed dataset; its leaves share their row counts with "
                "the rest of the batch (and later batches), so it cannot be donated",
                "donate params and optimizer state, not batches"),
}


def check_not_donating(what: str, args, donate_argnums: tuple, api: str) -> None:
    """Refuse donating an argument holding ``what``: ``"variables"`` (their arrays are their
    state) or ``"batches"`` (trace time only: a batch's leaves share their row counts).

    Args:
        what: ``"variables"`` or ``"batches"``.
        args: the step's positional arguments.
        donate_argnums: the positions the step donates.
        api: the step's name, for the message.

    Raises:
        ValueError: naming the argument.

    Example:
        >>> check_not_donating("variables", (jnp.ones(2),), (0,), "step")  # arrays: fine
    """
    predicate, why, instead = _NOT_DONATABLE[what]
    i = _donated_argument_holding(args, donate_argnums, predicate)
    if i is not None:
        raise ValueError(f"{api}: `donate_argnums` includes argument {i}, {why}; {instead}.")


# Deleted and donated arrays among the arguments.


class DeletedArrayError(ValueError):
    """An argument holds an array an earlier call donated, or one deleted by hand."""


def _deleted(x) -> bool:
    """Whether ``x`` is a deleted (or donated) array; False for anything else (tracers too)."""
    is_deleted = getattr(x, "is_deleted", None)
    return is_deleted is not None and not _compat.is_tracer(x) and is_deleted()


def donated_arrays(args, kwargs, donate_argnums: tuple, api: str) -> list:
    """The arrays a donating call is about to donate; refuses one also given elsewhere in the
    call (JAX 0.10 crashes the process on a buffer donated and read in one call).

    Args:
        args: the call's positional arguments.
        kwargs: its keyword arguments (a dict, or None).
        donate_argnums: the positions it donates.
        api: the step's name, which starts the message.

    Returns:
        The donated arguments' array leaves, for ``forget_donated`` after the call.

    Raises:
        ValueError: naming both places of an array given twice.

    Example:
        >>> import jax.numpy as jnp
        >>> w = jnp.ones(2)
        >>> len(donated_arrays(({"w": w}, jnp.ones(2)), {}, (0,), "step"))
        1
        >>> donated_arrays(({"w": w}, w), {}, (0,), "step")
        Traceback (most recent call last):
        ...
        ValueError: step: args[0]['w'] and args[1] are the same array, and argument 0 is donated; ...
    """
    donated = [x for i in donate_argnums if i < len(args)
               for x in jax.tree.leaves(args[i]) if isinstance(x, jax.Array)]
    ids = set(map(id, donated))
    if len(ids) == len(donated):
        others = [x for i, a in enumerate(args) if i not in donate_argnums
                  for x in jax.tree.leaves(a)] + jax.tree.leaves(dict(kwargs or {}))
        if not any(id(x) in ids for x in others):
            return donated
    _refuse_twice(args, kwargs, donate_argnums, api)


def _refuse_twice(args, kwargs, donate_argnums: tuple, api: str) -> None:
    pairs = jax.tree_util.tree_flatten_with_path((tuple(args), dict(kwargs or {})))[0]
    first = {}
    for path, x in pairs:
        if not isinstance(x, jax.Array):
            continue
        where = _argument_at(path, 0)[1]
        if id(x) in first:
            raise ValueError(
                f"{api}: {first[id(x)]} and {where} are the same array, and argument"
                f"{'s' if len(donate_argnums) > 1 else ''} "
                f"{', '.join(map(str, donate_argnums))} {'are' if len(donate_argnums) > 1 else 'is'} "
                f"donated; JAX cannot donate a buffer that the same call also reads (it would "
                f"crash the process); pass a copy for one of them, e.g. "
                f"`ema = jax.tree.map(jnp.copy, params)`.")
        first[id(x)] = where


def forget_donated(donated: list) -> None:
    """Delete the arrays a donating call took, so that a later call raises instead of crashing.

    Only arrays JAX already marks deleted (their buffers were donated) are deleted: an array
    JAX did not donate (no output of its shape) stays usable.

    Args:
        donated: the arrays the call donated (``donated_arrays``), after it returned.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> x, y = jnp.ones(2), jnp.ones(2)
        >>> x.delete()
        >>> forget_donated([x, y]); y.is_deleted()
        False
    """
    if not _compat.trace_state_clean():  # inside an outer jax.jit: nothing was donated
        return
    for x in donated:
        if not _compat.is_tracer(x) and x.is_deleted():
            x.delete()


def check_alive(args, kwargs, api: str, first: int = 0) -> None:
    """Refuse arguments holding a deleted array, naming the first by its path.

    Called when a step's call failed (not before every call): it walks the arguments once.

    Args:
        args: the step's positional arguments.
        kwargs: its keyword arguments (a dict, or None).
        api: the step's name, which starts the message.
        first: the position the user's call gives ``args[0]`` (a fused step's program takes
            its iterator's elements first).

    Raises:
        DeletedArrayError (a ``ValueError``): naming the argument and the deleted array's path.

    Example:
        >>> import jax.numpy as jnp
        >>> w = jnp.ones(2)
        >>> check_alive(({"w": w},), {}, "step")  # alive: nothing happens
        >>> w.delete()
        >>> check_alive(({"b": jnp.ones(2), "w": w},), {}, "step")
        Traceback (most recent call last):
        ...
        jaxmirror.step.arguments.DeletedArrayError: step: argument 0 holds arrays an earlier call donated or deleted: args[0]['w'] is deleted; ...
    """
    pairs = jax.tree_util.tree_flatten_with_path((tuple(args), dict(kwargs or {})),
                                                 is_leaf=is_distributed)[0]
    for path, x in pairs:
        if any(map(_deleted, jax.tree.leaves(x))):  # a distributed value's arrays too
            which, where = _argument_at(path, first)
            raise DeletedArrayError(
                f"{api}: argument {which} holds arrays an earlier call donated or deleted: "
                f"{where} is deleted; pass that call's results instead, e.g. `params, "
                f"opt_state, loss = step(params, opt_state, batch)` (in a notebook: re-run "
                f"the cell that made them, not only the one that calls the step).") from None


def _argument_at(path, first: int) -> tuple:
    """``(argument, path as the caller wrote it)`` of a leaf of ``(args, kwargs)``."""
    head, rest = path[1], path[2:]
    if path[0].idx == 0:
        return head.idx + first, f"args[{head.idx + first}]" + jax.tree_util.keystr(rest)
    return repr(head.key), "kwargs" + jax.tree_util.keystr(path[1:])


# Placing user trees on the strategy's devices.


def _misplaced(x, placement) -> bool:
    # Uncommitted arrays (made without a device) go wherever jax.jit puts them.
    return (isinstance(x, jax.Array) and not _compat.is_tracer(x) and x.committed
            and x.sharding.device_set != placement.device_set)


def replicate(placement, tree):
    """``tree`` with every array replicated over the strategy's devices.

    NNX objects in it are updated in place (their ``nnx.Variable``s get the placed arrays) and
    returned; other arrays are returned placed; distributed values are left as they are. The
    placed arrays never share a buffer with the given ones, so donating them to a step leaves
    the caller's arrays alive.

    Args:
        placement: the strategy's ``Placement``.
        tree: a pytree of arrays and NNX objects.

    Returns:
        The same structure, placed.
    """
    def place(x):
        if is_graph_node(x):
            nnx.update(x, placement.store(nnx.state(x), owned=True))
            return x
        if isinstance(x, jax.Array) or (hasattr(x, "__array__") and not is_distributed(x)):
            return placement.store(x, owned=True)
        return x

    return jax.tree.map(place, tree, is_leaf=lambda x: is_graph_node(x) or is_distributed(x))


def build_replicated(placement, fn, args, kwargs):
    """``fn(*args, **kwargs)`` computed by one program whose outputs are replicated over the
    strategy's devices (NNX objects it returns come back built on them).

    Args:
        placement: the strategy's ``Placement``.
        fn: builds the tree (a model, an optimizer, their state).
        args: positional arguments of ``fn`` (arrays or static Python values).
        kwargs: keyword arguments of ``fn``.

    Returns:
        What ``fn`` returns, placed.
    """
    built = {}

    def pure():
        out = fn(*args, **kwargs)
        leaves, tree = jax.tree.flatten(out, is_leaf=is_graph_node)
        positions = tuple(i for i, x in enumerate(leaves) if is_graph_node(x))
        graphdef, state = nnx.split([leaves[i] for i in positions])
        built.update(tree=tree, positions=positions, graphdef=graphdef, n=len(leaves))
        return state, [x for i, x in enumerate(leaves) if i not in positions]

    state, others = jax.jit(pure, out_shardings=placement.storage_sharding)()
    nodes = dict(zip(built["positions"], nnx.merge(built["graphdef"], state)))
    rest = iter(others)
    leaves = [nodes[i] if i in nodes else next(rest) for i in range(built["n"])]
    return jax.tree.unflatten(built["tree"], leaves)


def mirror_misplaced(placement, args, kwargs, donate_argnums: tuple = ()):
    """The arguments with arrays on other devices than the strategy's replicated over them.

    A copy that a step donates is made in new buffers: ``jax.device_put`` would reuse the
    buffer the array already has on one of the strategy's devices, and donating the copy would
    delete the caller's array too.

    Args:
        placement: the strategy's ``Placement``.
        args: a step's positional arguments.
        kwargs: its keyword arguments.
        donate_argnums: the positions of ``args`` the step donates.

    Returns:
        ``(args, kwargs, names)``: ``names`` lists the arguments moved (empty: nothing was).

    Raises:
        ValueError: for a ``PerReplica`` of another strategy (its components elsewhere).
    """
    pairs, tree = jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=is_distributed)
    names, leaves = [], []
    for path, x in pairs:
        if isinstance(x, PerReplica):
            _check_components(x, placement, _argument(path))
        elif _misplaced(x, placement):
            names.append(_argument(path))
            donated = path[0].idx == 0 and path[1].idx in donate_argnums
            x = placement.replicate(jnp.copy(x) if donated else x)
        leaves.append(x)
    args, kwargs = jax.tree.unflatten(tree, leaves)
    return args, kwargs, names


def _check_components(x, placement, name: str) -> None:
    stacked = x.stacked
    if _compat.is_tracer(stacked) or not isinstance(stacked, jax.Array):
        return
    if (stacked.shape[0] != placement.num_replicas
            or stacked.sharding.device_set != placement.device_set):
        raise ValueError(
            f"run: {name} is a PerReplica with {stacked.shape[0]} components on "
            f"{sorted(d.id for d in stacked.sharding.device_set)}, but this strategy has "
            f"{placement.num_replicas} replicas on devices "
            f"{sorted(d.id for d in placement.device_set)}: a value of another strategy; make "
            f"it with this strategy (its experimental_distribute_dataset or "
            f"experimental_distribute_values_from_function), or reduce it there first."
        )


def _argument(path) -> str:
    head, rest = path[0], path[1:]
    return ("args" if head.idx == 0 else "kwargs") + jax.tree_util.keystr(rest)


# The steps that said so already: once per step.
_WARNED = weakref.WeakSet()


def warn_mirrored_once(step, names: list) -> None:
    """Say once per ``step`` that its calls mirror arrays placed on other devices.

    Args:
        step: the program whose call got them (its ``__name__`` names it).
        names: the arguments moved, as ``mirror_misplaced`` named them.
    """
    if step in _WARNED:
        return
    _WARNED.add(step)
    warnings.warn(
        f"run: `{step.__name__}` got {', '.join(names[:3])}"
        f"{' and more' if len(names) > 3 else ''} on devices other than the "
        f"strategy's; they were mirrored onto its devices, as TF does, at the cost of a "
        f"copy per call that gets them; place them once with "
        f"strategy.experimental_replicate(tree), build them with strategy.init(fn), or "
        f"pass the step's own outputs back in.", stacklevel=4)


__all__ = ["ACCEPTED", "DeletedArrayError", "build_replicated", "check_alive", "check_arguments",
           "describe_leaf", "donated_arrays", "forget_donated", "mirror_misplaced", "replicate",
           "warn_mirrored_once"]
