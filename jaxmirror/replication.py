"""Which outputs of a traced step are identical on every replica (Mirrored) and which vary (PerReplica).

``run`` traces the step once under ``shard_map`` and walks the per-replica jaxpr with the rules
below (what shard_map's old ``check_rep`` did): an input is replicated when its spec is ``P()``;
collectives in ``REPLICATING`` make their outputs replicated; primitives in ``VARYING`` make them
vary; any other equation varies if any input varies. Calls, conditionals and loops are followed
into their bodies. A primitive we have no rule for, with a body we cannot follow, is treated
conservatively: it varies if an input varies or its body holds a varying primitive.
"""

from __future__ import annotations

from jaxmirror import _compat

# Collectives over the replica axis whose result is the same on every replica.
REPLICATING = frozenset({"psum", "pmax", "pmin", "all_gather", "psum_invariant"})
# Primitives whose result differs by replica even for replicated inputs.
VARYING = frozenset({"axis_index", "ppermute", "all_to_all", "reduce_scatter", "psum_scatter",
                     "pbroadcast", "pvary"})


def _varies_by_rule(eqn, ins: list[bool]) -> list[bool] | None:
    name = eqn.primitive.name
    if name in REPLICATING and eqn.params.get("axis_index_groups") is None:
        return [False] * len(eqn.outvars)
    if name in VARYING:
        return [True] * len(eqn.outvars)
    return None


def _scan(eqn, ins):
    p = eqn.params
    nc, ncarry = p["num_consts"], p["num_carry"]
    body = p["jaxpr"].jaxpr
    consts, carry, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
    while True:
        outs = analyse(body, consts + carry + xs)
        new = [a or b for a, b in zip(carry, outs[:ncarry])]
        if new == carry:
            return new + outs[ncarry:]
        carry = new


def _while(eqn, ins):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, carry = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
    while True:
        if analyse(p["cond_jaxpr"].jaxpr, cconsts + carry)[0]:
            # Replicas may run different numbers of iterations.
            return [True] * len(carry)
        outs = analyse(p["body_jaxpr"].jaxpr, bconsts + carry)
        new = [a or b for a, b in zip(carry, outs)]
        if new == carry:
            return carry
        carry = new


def _cond(eqn, ins):
    if ins[0]:
        return [True] * len(eqn.outvars)
    per_branch = [analyse(b.jaxpr, ins[1:]) for b in eqn.params["branches"]]
    return [any(col) for col in zip(*per_branch)]


STRUCTURED = {"scan": _scan, "while": _while, "cond": _cond}


def _open(j):
    return j.jaxpr if isinstance(j, _compat.ClosedJaxpr) else j


def _has_varying_source(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in VARYING:
            return True
        if any(_has_varying_source(_open(sub)) for sub in _compat.jaxprs_in_params(eqn.params)):
            return True
    return False


def _equation(eqn, ins: list[bool]) -> list[bool]:
    by_rule = _varies_by_rule(eqn, ins)
    if by_rule is not None:
        return by_rule
    rule = STRUCTURED.get(eqn.primitive.name)
    if rule is not None:
        return rule(eqn, ins)
    subs = [_open(j) for j in _compat.jaxprs_in_params(eqn.params)]
    if len(subs) == 1 and len(subs[0].invars) == len(ins) and len(subs[0].outvars) == len(eqn.outvars):
        # A call (jit, remat, custom_jvp/vjp, closed_call): its body maps inputs to outputs.
        return analyse(subs[0], ins)
    varies = any(ins) or any(_has_varying_source(s) for s in subs)
    return [varies] * len(eqn.outvars)


def analyse(jaxpr, in_varying: list[bool]) -> list[bool]:
    """For each output of ``jaxpr``, whether it may differ across replicas.

    Args:
        jaxpr: an open per-replica jaxpr (``jax.extend.core.Jaxpr``) with no constvars.
        in_varying: for each invar, whether it differs across replicas.

    Returns:
        One bool per outvar: ``True`` varies (PerReplica), ``False`` is replicated (Mirrored).
    """
    env = dict(zip(jaxpr.invars, in_varying))
    env.update((v, False) for v in jaxpr.constvars)

    def read(v):
        return False if isinstance(v, _compat.Literal) else env[v]

    for eqn in jaxpr.eqns:
        outs = _equation(eqn, [read(v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]
