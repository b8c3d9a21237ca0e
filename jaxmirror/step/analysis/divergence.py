"""Replicas whose copies of a mirrored value drift apart: found at trace time, checked on demand.

TF's ``optimizer.apply_gradients`` all-reduces the gradients for you, so a literal port of TF's
custom-training loop has no all-reduce, and each replica then applies its own gradients: the
parameters come back different on every replica. Nothing fails: the next step takes them as
``PerReplica`` values. The replication analysis already knows, for free, which outputs may
differ across replicas; this module pairs the outputs that are new versions of an input (the
same structure, shapes and dtypes as a container argument, as ``params`` in and ``params``
out, or NNX objects' state) and warns when an input that was the same on every replica comes
out differing, and when a ``MirroredVariable`` is written differently by the replicas.
``check_replicas`` compares the components' values, for a numerical answer.
"""

from __future__ import annotations

import inspect
import warnings

import jax
import numpy as np

from jaxmirror.core.stateful import Stateful
from jaxmirror.core.values import PerReplica, components, is_distributed


class ReplicaDivergenceWarning(UserWarning):
    """A value meant to be the same on every replica comes out of a step differing.

    Example:
        >>> issubclass(ReplicaDivergenceWarning, UserWarning)
        True
    """


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_distributed)
    return treedef, tuple((getattr(x, "shape", None), getattr(x, "dtype", None)) for x in leaves)


def _top_level(tree):
    """``(subtree, its first flat index)`` for each of ``tree``'s top-level children."""
    children = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)[0]
    start = 0
    for _, child in children:
        yield child, start
        start += len(jax.tree.leaves(child, is_leaf=is_distributed))


def paired_outputs(fn, args, kwargs, result) -> list:
    """Outputs that are new versions of a container argument, leaf by leaf.

    Args:
        fn: the step function (its parameter names name the arguments).
        args: the step's positional arguments as traced (per-replica).
        kwargs: its keyword arguments.
        result: what the step returned.

    Returns:
        ``(output flat index, input flat index, name)`` triples, one per leaf of every argument
        with two or more leaves whose structure, shapes and dtypes the result (or one of its
        top-level elements) repeats.

    Example:
        >>> import jax.numpy as jnp
        >>> def step(params, lr): ...
        >>> p = {"w": jnp.ones(2), "b": jnp.zeros(())}
        >>> paired_outputs(step, (p, 1.0), {}, (1.0, p))
        [(1, 0, "params['b']"), (2, 1, "params['w']")]
    """
    by_signature = {}
    for sub, start in [*_top_level(result), (result, 0)]:
        by_signature.setdefault(_signature(sub), start)
    names = _parameter_names(fn, len(args))
    # In the order jax.tree flattens (args, kwargs): positional ones, then keywords sorted.
    entries = list(zip(names, args)) + [(repr(key), kwargs[key]) for key in sorted(kwargs)]
    pairs, start = [], 0
    for label, arg in entries:
        leaves = jax.tree_util.tree_flatten_with_path(arg, is_leaf=is_distributed)[0]
        # A scalar in and a per-replica scalar out is a result, not a drift: containers only.
        out_start = by_signature.get(_signature(arg)) if len(leaves) >= 2 else None
        if out_start is not None:
            pairs.extend((out_start + j, start + j, label + jax.tree_util.keystr(path))
                         for j, (path, _) in enumerate(leaves))
        start += len(leaves)
    return pairs


def _parameter_names(fn, n: int) -> list:
    try:
        params = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"args[{i}]" for i in range(n)]


def warn_diverged(step_name: str, pairs: list, in_stacked, out_varying,
                  mirrored_writes: list) -> None:
    """Warn (once per message) about mirrored values the replicas made differ.

    Args:
        step_name: the step function's name.
        pairs: ``paired_outputs``'s triples.
        in_stacked: per flat input, whether it differs across replicas.
        out_varying: per flat output, whether it may differ across replicas.
        mirrored_writes: ``(output index, variable name)`` of mirrored variables written.
    """
    names = sorted({name for o, i, name in pairs if out_varying[o] and not in_stacked[i]})
    if names:
        _warn(f"run: `{step_name}` takes {_listed(names)} the same on every replica and "
              f"returns new versions of them that differ across replicas, so the replicas' "
              f"copies drift apart (the next step takes them as PerReplica values, and NNX "
              f"objects holding them work only inside steps; for BatchNorm statistics use "
              f"jaxmirror.nn.SyncBatchNorm)")
    variables = sorted({name for o, name in mirrored_writes if out_varying[o]})
    if variables:
        _warn(f"run: `{step_name}` assigns MirroredVariable(s) {_listed(variables)} a value "
              f"that differs across replicas (aggregation NONE writes each replica's own), so "
              f"their components differ")


def _listed(names: list) -> str:
    shown = ", ".join(names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _warn(what: str) -> None:
    warnings.warn(ReplicaDivergenceWarning(
        f"{what}; if these are parameters updated from gradients, all-reduce the gradients "
        f"first, as TF's optimizer.apply_gradients does for you: "
        f"grads = jaxmirror.get_replica_context().all_reduce('sum', grads) with "
        f"compute_average_loss (or 'mean' of per-replica mean losses); to see whether the "
        f"values really differ, call jaxmirror.experimental.check_replicas on them."),
        stacklevel=2)


def check_replicas(value, atol: float = 0.0, rtol: float = 0.0) -> list:
    """Which leaves of ``value`` hold components that differ across replicas (on the host).

    A debugging aid: the trace-time warning says a value *may* differ; this compares the
    values. ``PerReplica`` leaves, distributed variables and NNX objects holding them are
    checked; other leaves count as the same everywhere.

    Args:
        value: a nest of run results, variables or NNX objects.
        atol: absolute tolerance.
        rtol: tolerance relative to replica 0's component.

    Returns:
        The key paths (``jax.tree_util.keystr``) of the leaves whose components differ by
        more than ``atol + rtol * |component 0|``; empty when all agree.

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> v = s.run(lambda: jaxmirror.get_replica_context().replica_id_in_sync_group * 1.0)
        >>> check_replicas({"same": s.run(lambda: 1.0), "differs": v})
        ["['differs']"]
    """
    leaves = jax.tree_util.tree_flatten_with_path(
        value, is_leaf=lambda x: is_distributed(x) or isinstance(x, Stateful))[0]
    differ = []
    for path, x in leaves:
        if isinstance(x, Stateful):
            x = x.distributed_view() if x.stored_per_replica else None
        if not isinstance(x, PerReplica):
            continue
        parts = [np.asarray(c) for c in components(x.stacked)]
        first = parts[0]
        if any(c.shape != first.shape
               or np.any(np.abs(c - first) > atol + rtol * np.abs(first)) for c in parts[1:]):
            differ.append(jax.tree_util.keystr(path))
    return differ


__all__ = ["ReplicaDivergenceWarning", "check_replicas", "paired_outputs", "warn_diverged"]
