"""Which outputs of a traced step are identical on every replica (Mirrored) and which vary (PerReplica).

``run`` traces the step once under ``shard_map`` and walks the per-replica jaxpr with the rules
below (what shard_map's old ``check_rep`` did): an input is replicated when its spec is ``P()``;
collectives over the replica axis make their outputs replicated; ``axis_index`` and the
permuting collectives make them vary; any other equation varies if any input varies. Calls,
conditionals and loops are followed into their bodies. A primitive with no rule and a body we
cannot follow is treated conservatively: it varies if an input varies or its body holds a
varying primitive.
"""

from __future__ import annotations

from jax import lax

from jaxmirror.core import _compat
from jaxmirror.core.replicated import replicated_p
from jaxmirror.step.analysis.jaxpr_walk import Analysis, sub_jaxprs

# Collectives over the replica axis whose result is the same on every replica.
REPLICATING = (lax.psum_p, lax.pmax_p, lax.pmin_p, lax.all_gather_p, _compat.psum_invariant_p,
               replicated_p)
# Primitives whose result differs by replica even for replicated inputs.
VARYING = (lax.axis_index_p, lax.ppermute_p, lax.all_to_all_p, _compat.reduce_scatter_p,
           _compat.pbroadcast_p, _compat.pvary_p)


def _has_varying_source(jaxpr) -> bool:
    return any(eqn.primitive in VARYING or any(map(_has_varying_source, sub_jaxprs(eqn)))
               for eqn in jaxpr.eqns)


def _conservative(eqn, ins: list[bool]) -> list[bool]:
    varies = any(ins) or any(map(_has_varying_source, sub_jaxprs(eqn)))
    return [varies] * len(eqn.outvars)


# Strict: an unknown variable must not read as "replicated", the unsafe answer.
ANALYSIS = Analysis(constant=False, unknown=_conservative, strict=True)


@ANALYSIS.register(*REPLICATING)
def _replicating(eqn, ins):
    if _compat.collective_groups(eqn) is not None:  # reduces within groups only
        return _conservative(eqn, ins)
    return [False] * len(eqn.outvars)


@ANALYSIS.register(*VARYING)
def _varying(eqn, ins):
    return [True] * len(eqn.outvars)


@ANALYSIS.register(lax.scan_p)
def _scan(eqn, ins):
    body, nc, ncarry = _compat.scan_parts(eqn)
    consts, carry, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
    while True:  # to a fixed point: a carry varies once any iteration makes it vary
        outs = analyse(body, consts + carry + xs)
        new = [a or b for a, b in zip(carry, outs[:ncarry])]
        if new == carry:
            return new + outs[ncarry:]
        carry = new


@ANALYSIS.register(lax.while_p)
def _while(eqn, ins):
    cond, body, cn, bn = _compat.while_parts(eqn)
    cconsts, bconsts, carry = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
    while True:
        if analyse(cond, cconsts + carry)[0]:
            # Replicas may run different numbers of iterations.
            return [True] * len(carry)
        outs = analyse(body, bconsts + carry)
        new = [a or b for a, b in zip(carry, outs)]
        if new == carry:
            return carry
        carry = new


@ANALYSIS.register(lax.cond_p)
def _cond(eqn, ins):
    if ins[0]:  # replicas may take different branches
        return [True] * len(eqn.outvars)
    per_branch = [analyse(b, ins[1:]) for b in _compat.cond_branches(eqn)]
    return [any(col) for col in zip(*per_branch)]


def analyse(jaxpr, in_varying: list[bool]) -> list[bool]:
    """For each output of ``jaxpr``, whether it may differ across replicas.

    Args:
        jaxpr: an open per-replica jaxpr (``jax.extend.core.Jaxpr``).
        in_varying: for each invar, whether it differs across replicas.

    Returns:
        One bool per outvar: ``True`` varies (PerReplica), ``False`` is replicated (Mirrored).

    Example:
        >>> import jax
        >>> jaxpr = jax.make_jaxpr(lambda x, y: (x + 1, x + y))(1.0, 2.0).jaxpr
        >>> analyse(jaxpr, [False, True])
        [False, True]
    """
    return ANALYSIS.analyse(jaxpr, in_varying)
