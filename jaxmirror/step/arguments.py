"""What a step's arguments may be, and the errors that say which argument is not.

``jax.jit`` refuses a string or an object array with "Error interpreting argument to <bound
method ...> as an abstract array", which names neither the argument nor what to pass instead,
and it takes a ragged nested list of Python numbers (``[[1, 2], [3]]``) as a pytree of scalars,
so a batch meant as an array silently becomes a nest of scalars. ``check_arguments`` names the
argument by its path (``args[1]['x'][2]``, ``kwargs['lr']``), says what it is and what is
accepted.

It is not on the hot path: ``Program`` calls it when ``jax.jit`` refused a call's arguments and
once per new input signature, while ``jax.jit`` traces. It visits every node once (linear in the
size of the arguments), and at trace time it sees tracers: a Python number has become a weakly
typed scalar, which it still counts as a number, so both calls agree on what is ragged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmirror.core.stateful import Stateful, is_opaque
from jaxmirror.core.values import is_distributed, is_per_replica
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


__all__ = ["ACCEPTED", "check_arguments", "describe_leaf"]


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
