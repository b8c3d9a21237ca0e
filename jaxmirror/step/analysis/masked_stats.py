"""Whether a step averages across replicas a library's per-replica masked mean of a padded batch.

flax's normalization layers given ``axis_name`` (``nnx.BatchNorm``, ``linen.BatchNorm``) and a
``mask`` compute each replica's mean over the rows the mask keeps, then ``pmean`` those means:
with a padded batch masked by ``batch_mask`` every replica weighs alike however many real rows
it holds, so the statistics differ from one device's over the real rows (the values 10 to 19
split 3, 3, 2, 2 over four replicas: a mean of 15.0 for 14.5, 3% off), though no padded row is
counted, so ``padding_check`` has nothing to say.
This forward analysis over the per-replica jaxpr finds such a quotient: a sum over a padded
batch's rows that depends on this replica's row count, divided by a count of this replica's
rows (a sum of its mask), made by flax, reaching a sum across replicas. A quotient written by
hand is taken as written (TF averages per-replica means the same way); a layer's statistics
are meant to be the global batch's (``jaxmirror.nn.SyncBatchNorm`` sums the sums and the
counts instead).
"""

from __future__ import annotations

import contextvars
import importlib.util
import os
from typing import NamedTuple

from jax import lax

from jaxmirror.core import _compat
from jaxmirror.step.analysis.jaxpr_walk import Analysis


class Flow(NamedTuple):
    """What the analysis knows of one jaxpr value."""

    data: bool  # depends on a padded batch
    counts: bool  # depends on the batches' row counts
    replica: bool  # depends on the replica's index
    count: bool  # a sum of this replica's mask alone: a count of its rows
    quotient: tuple | None  # a library's masked mean of this replica's rows: _made_by_library


NOTHING = Flow(False, False, False, False, None)
# The sums across replicas (and the gathers and sends that end in one).
_SUMS = (lax.psum_p, _compat.psum_invariant_p, _compat.reduce_scatter_p, lax.all_gather_p,
         lax.all_to_all_p, lax.ppermute_p)


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    return os.path.dirname(spec.origin) + os.sep if spec and spec.origin else "\0"


# Whose quotients count: flax's (its normalization layers' statistics). Equations are named
# by the first frame outside jax, jaxlib, flax and jaxmirror: the user's call of the layer.
_LIBRARY = _package_dir("flax")
# (axis name, findings) of the analysis running in this thread.
_STATE: contextvars.ContextVar = contextvars.ContextVar("masked_stats")
_SKIPPED = tuple(_package_dir(p) for p in ("jax", "jaxlib", "flax", "jaxmirror"))


def _made_by_library(eqn):
    """``(name, place)`` of a flax-made ``eqn``: ``"file:line (function)"`` of flax's line and
    the user's ``(path, line)`` that called it (``None`` when unknown); ``None`` when not."""
    frames = _compat.eqn_frames(eqn)  # innermost first
    inner = next((f for f in frames if not f[0].startswith(_SKIPPED[:2])), None)
    if inner is None or not inner[0].startswith(_LIBRARY):
        return None
    user = next((f for f in frames if not f[0].startswith(_SKIPPED)), None)
    name = f"{os.path.basename(inner[0])}:{inner[1]} ({inner[2]})"
    return name, (None if user is None else (user[0], user[1]))


def _masked(f: Flow) -> bool:
    return f.counts and f.replica  # this replica's row count: its mask


def _outs(eqn, ins, **given) -> list:
    """The outputs' flows: the flags of ``ins`` joined, then ``given``."""
    data = any(f.data for f in ins)
    flow = Flow(data, any(f.counts for f in ins), any(f.replica for f in ins),
                not data and any(f.count for f in ins),
                next((f.quotient for f in ins if f.quotient), None))
    return [flow._replace(**given)] * len(eqn.outvars)


ANALYSIS = Analysis(constant=NOTHING, unknown=_outs)


@ANALYSIS.register(lax.axis_index_p)
def _axis_index(eqn, ins):
    return [NOTHING._replace(replica=True)]


@ANALYSIS.register(lax.reduce_sum_p)
def _sum(eqn, ins):
    (x,) = ins
    # A sum of the batch (masked: what a quotient divides), or of the mask alone: a count.
    return _outs(eqn, ins, count=not x.data and _masked(x))


@ANALYSIS.register(lax.div_p)
def _div(eqn, ins):
    num, den = ins
    made = _made_by_library(eqn)
    if made is not None and num.data and _masked(num) and den.count:
        return _outs(eqn, ins, quotient=made)
    return _outs(eqn, ins)


@ANALYSIS.register(lax.mul_p)
def _mul(eqn, ins):
    # A quotient times its count is the masked sum again: weighted back, nothing to say.
    if any(f.quotient for f in ins) and any(f.count for f in ins):
        return _outs(eqn, ins, quotient=None)
    return _outs(eqn, ins)


@ANALYSIS.register(*_SUMS)
def _sum_across(eqn, ins):
    axis, found = _STATE.get()
    quotient = next((f.quotient for f in ins if f.quotient), None)
    if quotient is not None and axis in _compat.collective_axes(eqn):
        found.append((f"{eqn.primitive.name} of the masked mean at {quotient[0]}", quotient[1]))
    return _outs(eqn, ins, quotient=None, count=False)


def per_replica_means(jaxpr, padded_inputs, count_inputs, axis_name,
                      places: dict | None = None) -> list[str]:
    """Where a flax-made masked mean of this replica's rows reaches a sum across replicas.

    Args:
        jaxpr: an open per-replica jaxpr.
        padded_inputs: the invar positions of the padded batches.
        count_inputs: the invar positions of the batches' row counts.
        axis_name: the replica axis.
        places: if given, filled with ``{finding: (path, line)}``: the user's line that called
            the layer, where known.

    Returns:
        One ``"<collective> of the masked mean at <file:line (function)>"`` per finding, in
        jaxpr order; empty when there is none.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> def step(x, counts):  # written by hand: taken as written
        ...     mask = jnp.arange(4) < counts[jax.lax.axis_index("r")]
        ...     return jax.lax.pmean(jnp.sum(x * mask) / jnp.sum(mask), "r")
        >>> jaxpr = jax.make_jaxpr(step, axis_env=[("r", 2)])(jnp.ones(4), jnp.ones(2, int))
        >>> per_replica_means(jaxpr.jaxpr, [0], [1], "r")
        []
    """
    ins = [NOTHING] * len(jaxpr.invars)
    for pos in padded_inputs:
        ins[pos] = NOTHING._replace(data=True)
    for pos in count_inputs:
        ins[pos] = NOTHING._replace(counts=True)
    found: list = []
    token = _STATE.set((axis_name, found))
    try:
        ANALYSIS.analyse(jaxpr, ins)
    finally:
        _STATE.reset(token)
    if places is not None:
        places.update((text, place) for text, place in found if place is not None)
    return list(dict.fromkeys(text for text, _ in found))


def per_replica_means_message(found: list) -> str:
    """The ``PaddedRowsWarning`` text for ``per_replica_means``' findings.

    Args:
        found: a non-empty list from ``per_replica_means``.

    Returns:
        The message.

    Example:
        >>> per_replica_means_message(["psum of the masked mean at normalization.py:102"])[:44]
        'run: a flax normalization layer (BatchNorm) '
    """
    return (f"run: a flax normalization layer (BatchNorm) given `axis_name` and a mask "
            f"averages every replica's masked mean across replicas ({found[0]}), weighing each "
            f"replica alike however many real rows it holds: whenever a batch splits unevenly "
            f"or is partial its statistics differ from one device's over the real rows; use "
            f"`jaxmirror.nn.SyncBatchNorm` (statistics over every replica's real rows, no "
            f"`axis_name` needed).")


__all__ = ["ANALYSIS", "Flow", "NOTHING", "per_replica_means", "per_replica_means_message"]
