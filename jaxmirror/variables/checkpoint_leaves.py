"""One leaf of a checkpoint: how a tree's leaves are matched, saved and restored.

A checkpoint holds one array per leaf (a variable's cross-replica value). Trees are matched by
the names along each leaf's path, as orbax stores them (tuples become lists, namedtuples and
dataclasses dicts), so a restored tree need only have the saved one's names.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from jaxmirror.core import _compat
from jaxmirror.core.checkpointable import Checkpointable
from jaxmirror.core.stateful import is_opaque
from jaxmirror.core.values import DistributedValues, Mirrored
from jaxmirror.variables.creation import owning_strategy
from jaxmirror.variables.handle import VariableHandle
from jaxmirror.variables.variable import Variable

SCALARS = (bool, int, float, complex)


# A checkpoint's leaves: variables, and distributed values (one value each, not their stacked
# or inner arrays): what tree maps hand over whole.
is_leaf = is_opaque


def where(path) -> str:
    """A leaf's path as errors name it: ``tree['w'][0]``."""
    return "tree" + jax.tree_util.keystr(path)


def key_name(key) -> str:
    """One path key as a name (orbax stores tuples as lists and namedtuples and dataclasses as
    dicts; keys are compared by name)."""
    if isinstance(key, DictKey):
        return str(key.key)
    if isinstance(key, SequenceKey):
        return str(key.idx)
    if isinstance(key, GetAttrKey):
        return key.name
    if isinstance(key, FlattenedIndexKey):
        return str(key.key)
    return str(key)


def by_name(pairs) -> dict:
    """``{names along the path: (path, leaf)}`` of flattened ``(path, leaf)`` pairs; two leaves
    with the same names raise ``ValueError``."""
    named = {}
    for path, leaf in pairs:
        name = tuple(key_name(k) for k in path)
        if name in named:
            raise ValueError(f"jaxmirror.checkpoint: {where(named[name][0])} and {where(path)} "
                             f"have the same name in a checkpoint; give them distinct keys.")
        named[name] = (path, leaf)
    return named


def check_same_structure(target_pairs, saved_pairs, what: str) -> dict:
    """The saved leaves by target path; raises unless both trees have the same leaves."""
    saved = by_name(saved_pairs)
    target = by_name(target_pairs)
    missing = [where(target[k][0]) for k in target if k not in saved]
    extra = [where(saved[k][0]) for k in saved if k not in target]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"in target but not in {what}: {', '.join(missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        if extra:
            parts.append(f"in {what} but not in target: {', '.join(extra[:5])}"
                         + (f" and {len(extra) - 5} more" if len(extra) > 5 else ""))
        raise ValueError(f"jaxmirror.checkpoint: the target's structure does not match the "
                         f"{what}'s ({'; '.join(parts)}); restore into a tree shaped like the one "
                         f"saved.")
    return {k: saved[k][1] for k in target}


def saveable_leaf(path, x):
    """The array saved for the leaf ``x`` at ``path``: its cross-replica value (an iterator's
    or another ``Checkpointable``'s state)."""
    if isinstance(x, Checkpointable):
        return x.checkpoint_state()
    if isinstance(x, (Variable, VariableHandle)):
        try:
            x = x.read_value()
        except ValueError as e:  # a sync-on-read variable with aggregation NONE
            raise ValueError(f"jaxmirror.checkpoint: cannot save {where(path)}: {e}") from e
    elif isinstance(x, Mirrored):
        x = x.value
    elif isinstance(x, DistributedValues):
        raise ValueError(
            f"jaxmirror.checkpoint: cannot save {where(path)}, a {type(x).__name__} value whose "
            f"replicas hold different values, since a checkpoint holds one value per leaf; "
            f"reduce it (strategy.reduce) or gather it (strategy.gather) first."
        )
    if _compat.is_tracer(x):
        raise ValueError(f"jaxmirror.checkpoint: cannot save {where(path)}, a traced value; save "
                         f"outside jax.jit, jax.grad and `run`, from the arrays they return.")
    if is_key(x):  # a typed PRNG key (nnx.Rngs holds them): saved as its raw key data
        return jax.random.key_data(x)
    if isinstance(x, (jax.Array, np.ndarray)):
        return x
    if isinstance(x, (np.generic,) + SCALARS):
        return np.asarray(x)
    raise TypeError(f"jaxmirror.checkpoint: cannot save {where(path)}, a {type(x).__name__}; "
                    f"expected a jaxmirror Variable, a jax.Array, a NumPy array or a Python "
                    f"number.")


def is_key(x) -> bool:
    """Whether ``x`` is a typed PRNG key array (or its abstract value)."""
    return (isinstance(x, (jax.Array, jax.ShapeDtypeStruct))
            and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key))


def target_shape_dtype(path, leaf):
    """(shape, dtype) a target leaf takes; dtype None: keep the saved one. Raises for bad leaves."""
    if isinstance(leaf, (Variable, VariableHandle)):
        return tuple(leaf.shape), None  # `assign` applies the variable's own dtype rules
    if isinstance(leaf, Checkpointable):
        return leaf.checkpoint_shape_dtype()
    if isinstance(leaf, Mirrored):
        return target_shape_dtype(path, leaf.value)
    if isinstance(leaf, DistributedValues):
        raise ValueError(
            f"jaxmirror.checkpoint: cannot restore into {where(path)}, a {type(leaf).__name__} "
            f"value, since a checkpoint holds one value per leaf; restore into a variable made in "
            f"the strategy's scope, or into an array "
            f"(jax.device_put(x, strategy.extended.replicated_sharding)).")
    if _compat.is_tracer(leaf):
        raise ValueError(f"jaxmirror.checkpoint: cannot restore into {where(path)}, a traced "
                         f"value; restore outside jax.jit, jax.grad and `run`.")
    if is_key(leaf):
        data = jax.eval_shape(jax.random.key_data, leaf)
        return tuple(data.shape), np.dtype(data.dtype)
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)):
        return tuple(leaf.shape), np.dtype(leaf.dtype)
    if isinstance(leaf, SCALARS):
        return (), None
    raise TypeError(f"jaxmirror.checkpoint: cannot restore into {where(path)}, a "
                    f"{type(leaf).__name__}; expected a jaxmirror Variable, a jax.Array, a "
                    f"jax.ShapeDtypeStruct, a NumPy array or a Python number.")


def check_shape(path, leaf, saved_shape) -> None:
    """Raise ``ValueError`` unless the target ``leaf`` takes a value of ``saved_shape``."""
    shape, _ = target_shape_dtype(path, leaf)
    if tuple(saved_shape) != shape:
        raise ValueError(f"jaxmirror.checkpoint: cannot restore into {where(path)}: the saved "
                         f"value has shape {tuple(saved_shape)}, the target has shape {shape}; "
                         f"restore into a tree shaped like the one saved.")


def sharding_of(leaf):
    """Where a target leaf's values live: its sharding, or ``None`` (host values).

    Inside a strategy's scope a ``jax.Array`` or ``jax.ShapeDtypeStruct`` target that is not
    already on exactly the strategy's devices restores mirrored over them, as TF restores into
    mirrored variables: a fresh target made on one device then feeds ``run`` directly.
    """
    if isinstance(leaf, Mirrored):
        return sharding_of(leaf.value)
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        strategy = owning_strategy()
        if strategy is None:
            return leaf.sharding
        placement = strategy.extended.placement
        if leaf.sharding is not None and leaf.sharding.device_set == placement.device_set:
            return leaf.sharding
        return placement.storage_sharding
    return None


def placed_like(leaf, x):
    """The saved value ``x`` as the (non-variable) target ``leaf`` holds values."""
    if isinstance(leaf, Mirrored):
        # Rebuilt through its pytree structure, which carries the wrapper's replica count.
        return jax.tree.unflatten(jax.tree.structure(leaf), [placed_like(leaf.value, x)])
    if isinstance(leaf, SCALARS):
        return type(leaf)(np.asarray(x).item())
    if is_key(leaf):
        data = jax.device_put(np.asarray(x, np.uint32) if not isinstance(x, jax.Array) else x,
                              sharding_of(leaf))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
    dtype = np.dtype(leaf.dtype)
    sharding = sharding_of(leaf)
    if sharding is None:  # a NumPy target, or an abstract one with no placement: on the host
        out = np.asarray(x, dtype=dtype)
        return out[()] if isinstance(leaf, np.generic) else out
    x = x if isinstance(x, jax.Array) else np.asarray(x)
    if x.dtype != dtype:
        x = x.astype(dtype)
    return jax.device_put(x, sharding)
