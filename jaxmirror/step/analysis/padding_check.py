"""Whether a step feeds a sum over a padded batch's rows, padding included, to a collective or
to its results, or gathers the padded rows across replicas.

A batch from a distributed dataset is padded to a static number of rows per replica (with copies
of real rows; a replica without rows gets copies of another's). A sum or mean written by hand
over its rows (``jnp.mean(loss)``, flax's ``BatchNorm`` statistics) counts the padded rows:
reduced across replicas (``psum``/``pmean``/``all_gather``), or returned by the step (and then
given to ``strategy.reduce``, or read), it silently differs from TF and from one-device
training. So does an ``all_gather`` of the rows themselves inside the step. This forward
analysis over the per-replica jaxpr finds that at trace time, at no cost at run time. Per value
it tracks: where a padded batch's rows lie (with ``rows``' rules), whether it depends on the row
counts at all (``masked``: ``where(mask, x, 0)``, ``x * mask`` and anything after
``compute_average_loss`` do), and the first sum-like reduction over rows of an unmasked value it
depends on. Max, min and argmax over rows are fine: padding repeats a real row. Calls, conds and
loops are followed (loops to a fixed point); where unsure (rows lost by a primitive without a
rule, a reduction with its own computation) it stays quiet.
"""

from __future__ import annotations

import contextvars
import functools
import importlib.util
import inspect
import os
from typing import NamedTuple

import jax
import jaxlib
from jax import lax

from jaxmirror.core import _compat
from jaxmirror.step.analysis import masked_stats, rows
from jaxmirror.step.analysis.jaxpr_walk import Analysis


class PaddedRowsWarning(UserWarning):
    """A step reduces across replicas a sum over a padded batch's rows that counts the padding.

    Example:
        >>> issubclass(PaddedRowsWarning, UserWarning)
        True
    """

    # The user's source line that summed over the padded rows (``padded_rows_warning`` sets
    # them when it knows it): where the warning is shown.
    filename: str | None = None
    lineno: int | None = None


class Flow(NamedTuple):
    """What the analysis knows of one jaxpr value."""

    rows: tuple | None  # ``rows``' tag: (batch index, axis) holding that batch's rows
    masked: bool  # depends on the row counts (so the padding may have been left out)
    unmasked: str | None  # the first sum over rows, padding included, it depends on


NOTHING = Flow(None, False, None)
# How findings start that are not "<collective> at ... of <reduction> at ...".
GATHERED = "the padded rows gathered by "
RETURNED = "a result of the step: "
# Collectives that sum (or gather or send, to be summed) across replicas. The sends are how
# ``ReductionToOneDevice`` and a narrower wire dtype sum.
COLLECTIVES = (lax.psum_p, _compat.psum_invariant_p, lax.all_gather_p, _compat.reduce_scatter_p,
               lax.ppermute_p, lax.all_to_all_p)
# Source lines are named by the first frame outside these packages (jax, jaxlib, jaxmirror).
_INTERNAL = tuple(os.path.dirname(path) + os.sep
                  for path in (jax.__file__, jaxlib.__file__, os.path.dirname(__file__)))
# (axis name, findings) of the analysis running in this thread.
_STATE: contextvars.ContextVar = contextvars.ContextVar("padding_check")
# Where equations are named: the first frame outside these libraries, the user's own line (a
# gradient's sum over rows was made by flax's layer, called from the user's loss), then the
# first frame outside JAX and jaxmirror if it is another (that flax layer).
_JAX_AND_OURS, _LIBRARIES = (tuple(
    os.path.dirname(spec.origin) + os.sep for spec in map(importlib.util.find_spec, names)
    if spec is not None and spec.origin) for names in (
        ("jax", "jaxlib", "jaxmirror"), ("jax", "jaxlib", "jaxmirror", "flax", "optax")))
# {"file:line (function)": (path, line)} of the places named by the analysis running here.
_PLACES: contextvars.ContextVar = contextvars.ContextVar("padding_check_places")


def _where(eqn) -> str:
    """``file:line (function)`` of the first frame outside jax, flax, optax and jaxmirror (the
    user's line), then ``via`` the library's own frame when one made the equation (flax's
    ``Linear.__call__`` for a gradient's sum over rows); ``?`` when there is none."""
    frames = _compat.eqn_frames(eqn)  # innermost first
    user = next((f for f in frames if not f[0].startswith(_LIBRARIES)), None)
    inner = next((f for f in frames if not f[0].startswith(_JAX_AND_OURS)), None)
    if user is None:
        return "?" if inner is None else _named(inner)
    where = _named(user) if inner in (None, user) else f"{_named(user)} via {_named(inner)}"
    places = _PLACES.get(None)
    if places is not None:
        places[where] = user[:2]
    return where


def _named(frame) -> str:
    return f"{os.path.basename(frame[0])}:{frame[1]} ({frame[2]})"


def _row_tags(eqn, ins) -> list:
    tags = [f.rows for f in ins]
    rule = rows.ANALYSIS.rules.get(eqn.primitive)
    if rule is None or all(t is None for t in tags):
        return [None] * len(eqn.outvars)
    return rule(eqn, tags)


def _outs(eqn, ins, tags, over_rows=False) -> list:
    """The outputs' flows: dependencies joined; ``over_rows``: ``eqn`` sums over rows."""
    masked = any(f.masked for f in ins)
    unmasked = next((f.unmasked for f in ins if f.unmasked), None)
    if over_rows and not masked and unmasked is None:
        unmasked = f"{eqn.primitive.name} at {_where(eqn)}"
    return [Flow(t, masked, unmasked) for t in tags]


def _join(a: Flow, b: Flow) -> Flow:
    return Flow(a.rows if a.rows == b.rows else None, a.masked or b.masked,
                a.unmasked or b.unmasked)


def _any_other(eqn, ins):
    return _outs(eqn, ins, _row_tags(eqn, ins))


ANALYSIS = Analysis(constant=NOTHING, unknown=_any_other)


@ANALYSIS.register(lax.reduce_sum_p, lax.reduce_prod_p, lax.cumsum_p, lax.cumprod_p,
                   lax.cumlogsumexp_p)
def _sum(eqn, ins):
    t = ins[0].rows
    # A forward cumsum's real row i sums rows <= i, all real (padding comes last); reversed,
    # it sums the padding too.
    over = t is not None and t[1] in _compat.op_axes(eqn) and (
        eqn.primitive in (lax.reduce_sum_p, lax.reduce_prod_p) or _compat.cumulative_reverse(eqn))
    return _outs(eqn, ins, _row_tags(eqn, ins), over)


@ANALYSIS.register(lax.dot_general_p)
def _dot_general(eqn, ins):
    contracting = _compat.dot_dimensions(eqn)[0]
    over = any(f.rows is not None and f.rows[1] in c for f, c in zip(ins, contracting))
    return _outs(eqn, ins, _row_tags(eqn, ins), over)


@ANALYSIS.register(lax.conv_general_dilated_p)
def _conv(eqn, ins):
    # rows.py has no rule for convolutions; a CNN's BatchNorm follows one. The lhs's batch
    # axis goes to the output's; as the lhs's or rhs's feature axis (a weight gradient) it is
    # summed over.
    dn, batch_groups = _compat.conv_dimensions(eqn)
    lhs, rhs = ins[0].rows, ins[1].rows
    if lhs is not None and lhs[1] == dn.lhs_spec[0] and batch_groups == 1:
        return _outs(eqn, ins, [(lhs[0], dn.out_spec[0])])
    over = ((lhs is not None and lhs[1] in dn.lhs_spec[:2])
            or (rhs is not None and rhs[1] == dn.rhs_spec[1]))
    return _outs(eqn, ins, [None], over)


@ANALYSIS.register(lax.reduce_p)
def _reduce(eqn, ins):
    # A reduction with a computation of its own: not a call, though jaxpr_walk.call_body would
    # take it for one (as many inputs and outputs). It may be max-like: no warning.
    return _outs(eqn, ins, [None] * len(eqn.outvars))


@ANALYSIS.register(*COLLECTIVES)
def _collective(eqn, ins):
    axis, found = _STATE.get()
    bad = next((f.unmasked for f in ins if f.unmasked), None)
    over_replicas = axis in _compat.collective_axes(eqn)
    if bad is not None and over_replicas:
        found.append(f"{eqn.primitive.name} at {_where(eqn)} of {bad}")
    elif (eqn.primitive is lax.all_gather_p and over_replicas
          and any(f.rows is not None and not f.masked for f in ins)):
        found.append(f"{GATHERED}{eqn.primitive.name} at {_where(eqn)}")
    return _outs(eqn, ins, [None] * len(eqn.outvars))


def _shifted(f: Flow, by: int) -> Flow:
    t = f.rows
    return f._replace(rows=None if t is None or t[1] + by < 0 else (t[0], t[1] + by))


def _fixed_point(carry: list, step) -> list:
    """Join ``step(carry)`` into ``carry`` until nothing changes (rows only go, flags only come)."""
    while True:
        new = [_join(c, o) for c, o in zip(carry, step(carry))]
        if new == carry:
            return carry
        carry = new


@ANALYSIS.register(lax.scan_p)
def _scan(eqn, ins):
    body, nc, ncarry = _compat.scan_parts(eqn)
    consts, carry = ins[:nc], ins[nc:nc + ncarry]
    # The body sees one slice of xs: their axis 0 goes (with rows along it), the others move up.
    xs = [_shifted(f, -1) for f in ins[nc + ncarry:]]
    carry = _fixed_point(carry, lambda c: ANALYSIS.analyse(body, consts + c + xs)[:ncarry])
    return carry + [_shifted(f, 1) for f in ANALYSIS.analyse(body, consts + carry + xs)[ncarry:]]


@ANALYSIS.register(lax.while_p)
def _while(eqn, ins):
    cond, body, cn, bn = _compat.while_parts(eqn)
    cconsts, bconsts = ins[:cn], ins[cn:cn + bn]

    def step(carry):
        # A loop stopped by the row counts makes everything it carries depend on them.
        stop = ANALYSIS.analyse(cond, cconsts + carry)[0].masked
        return [f._replace(masked=f.masked or stop)
                for f in ANALYSIS.analyse(body, bconsts + carry)]

    return _fixed_point(ins[cn + bn:], step)


@ANALYSIS.register(lax.cond_p)
def _cond(eqn, ins):
    per_branch = [ANALYSIS.analyse(b, ins[1:]) for b in _compat.cond_branches(eqn)]
    outs = [functools.reduce(_join, col) for col in zip(*per_branch)]
    return [f._replace(masked=f.masked or ins[0].masked) for f in outs]


def unmasked_row_reductions(jaxpr, padded_inputs: dict, count_inputs, axis_name,
                            places: dict | None = None) -> list[str]:
    """Where a sum over a padded batch's rows that counts the padding reaches a collective or a
    result of the step, and where an ``all_gather`` gathers the padded rows.

    Args:
        jaxpr: an open per-replica jaxpr.
        padded_inputs: ``{invar position: batch index}`` of the padded batches (rows on axis 0).
        count_inputs: the invar positions of the batches' row counts; whatever depends on them
            counts as masked.
        axis_name: the replica axis; only ``psum``/``pmean``/``all_gather``/``psum_scatter``
            over it are collectives here.
        places: if given, filled with ``{"file:line (function)": (path, line)}`` of the places
            the findings name.

    Returns:
        One ``"<collective> at <file:line (function)> of <reduction> at <file:line (function)>"``
        per offending collective, in jaxpr order, then one ``RETURNED + "<reduction> at ..."``
        per result that is such a sum (``GATHERED + "all_gather at ..."`` for gathered rows);
        empty when there is none.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> def step(x, counts):
        ...     mask = jnp.arange(4) < counts[0]
        ...     return (jax.lax.psum(jnp.mean(x), "r"), jax.lax.psum(jnp.sum(x * mask), "r"),
        ...             jax.lax.psum(jnp.max(x), "r"))
        >>> jaxpr = jax.make_jaxpr(step, axis_env=[("r", 2)])(jnp.ones(4), jnp.ones(2, int))
        >>> [f.split(" at ")[0] for f in unmasked_row_reductions(jaxpr.jaxpr, {0: 0}, [1], "r")]
        ['psum']
    """
    ins = [NOTHING] * len(jaxpr.invars)
    for pos, batch in padded_inputs.items():
        ins[pos] = Flow((batch, 0), False, None)
    for pos in count_inputs:
        ins[pos] = Flow(None, True, None)
    found: list = []
    token = _STATE.set((axis_name, found))
    places_token = _PLACES.set(places)
    try:
        outs = ANALYSIS.analyse(jaxpr, ins)
    finally:
        _PLACES.reset(places_token)
        _STATE.reset(token)
    # A result that is a collective's output already found says nothing new.
    found += [RETURNED + f.unmasked for f in outs if f.unmasked
              and not any(x.endswith(" of " + f.unmasked) for x in found)]
    return list(dict.fromkeys(found))  # a loop's body is walked more than once


def padded_rows_warning(traced, padded: tuple, axis_name) -> PaddedRowsWarning | None:
    """The warning for a traced step whose padded rows reach a collective, or ``None``.

    Args:
        traced: the step's closed jaxpr: one ``shard_map`` fed by constants and the flat inputs,
            the padded batches' row counts last.
        padded: the flat input positions of the padded batches.
        axis_name: the replica axis.

    Returns:
        A ``PaddedRowsWarning`` naming the first offending collective, or ``None``; its
        ``filename``/``lineno`` are the user's line that summed over the rows (or gathered
        them), when known.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxmirror.core import _compat
        >>> mesh = _compat.make_mesh(jax.devices()[:1], "r")
        >>> step = _compat.shard_map(lambda x, counts: jax.lax.psum(jnp.mean(x), "r"), mesh,
        ...                          _compat.P(), _compat.P())
        >>> traced = jax.make_jaxpr(step)(jnp.ones(4), jnp.ones(1, jnp.int32))
        >>> str(padded_rows_warning(traced, (0,), "r"))[:58]
        'run: a sum or mean over the rows of a padded batch reaches'
    """
    if not padded:
        return None
    outer_jaxpr = _compat.open_jaxpr(traced)
    (eqn,) = outer_jaxpr.eqns
    outer = outer_jaxpr.invars
    batch_of = {outer[pos]: k for k, pos in enumerate(padded)}
    counts = set(outer[len(outer) - len(padded):])
    names = [None if isinstance(v, _compat.Literal) else v for v in eqn.invars]
    places: dict = {}
    found = unmasked_row_reductions(
        _compat.shard_map_body(eqn), {i: batch_of[v] for i, v in enumerate(names) if v in batch_of},
        [i for i, v in enumerate(names) if v in counts], axis_name, places)
    if not found:  # nothing counts the padding: a flax layer may still weigh replicas alike
        return _per_replica_means_warning(eqn, names, batch_of, counts, axis_name)
    first = found[0]
    if first.startswith(GATHERED):
        what = (f"all_gather of a padded batch's rows gathers the padded rows too "
                f"({first[len(GATHERED):]}), copies of real rows,")
    elif first.startswith(RETURNED):
        what = (f"a sum or mean over the rows of a padded batch is a result of the step (or a "
                f"value it writes to a variable) ({first[len(RETURNED):]}) and counts the "
                f"padded rows, copies of real rows (so do strategy.reduce and local results of "
                f"it),")
    else:
        what = (f"a sum or mean over the rows of a padded batch reaches a cross-replica "
                f"collective ({first}) and counts the padded rows")
    warning = PaddedRowsWarning(
        f"run: {what} whenever a batch splits unevenly or is partial; leave the padding out: "
        f"use `jaxmirror.compute_average_loss`, weight with "
        f"`jaxmirror.get_replica_context().batch_mask`, gather outside the step with "
        f"`strategy.gather` (it keeps the real rows only), or for BatchNorm use "
        f"`jaxmirror.nn.SyncBatchNorm`.")
    # The reduction (or the all_gather) the first finding names last: the user's line.
    place = places.get(first.rsplit(" at ", 1)[-1])
    if place is not None:
        warning.filename, warning.lineno = place
    return warning


def _per_replica_means_warning(eqn, names, batch_of, counts, axis_name):
    """``masked_stats``' warning (flax's BatchNorm masked by ``batch_mask``), or ``None``."""
    places: dict = {}
    found = masked_stats.per_replica_means(
        _compat.shard_map_body(eqn), [i for i, v in enumerate(names) if v in batch_of],
        [i for i, v in enumerate(names) if v in counts], axis_name, places)
    if not found:
        return None
    warning = PaddedRowsWarning(masked_stats.per_replica_means_message(found))
    if found[0] in places:  # shown at the user's call of the layer
        warning.filename, warning.lineno = places[found[0]]
    return warning


def user_stacklevel() -> int:
    """The ``stacklevel`` making the caller's warning name the first frame outside jax/jaxmirror.

    Returns:
        An int for ``warnings.warn`` (1 is the caller itself).

    Example:
        >>> def warn_here():
        ...     return user_stacklevel()
        >>> warn_here()  # a doctest's frame is outside jaxmirror: the caller itself
        1
    """
    frame, level = inspect.currentframe().f_back, 1  # the caller's frame
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level
