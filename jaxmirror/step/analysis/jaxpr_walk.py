"""One forward walk over a jaxpr, shared by the analyses of a traced step.

``replication`` (which outputs are the same on every replica) and ``rows`` (which outputs hold
a padded batch's rows) each propagate one abstract value per jaxpr variable, equation by
equation. What differs is only the rule for each primitive, so each analysis is an ``Analysis``
with its rules in a table keyed by primitive objects (as ``jax/_src`` keys its own rule tables):
a misspelt primitive fails at import instead of silently never matching.
"""

from __future__ import annotations

from typing import Callable

from jaxmirror.core import _compat


def sub_jaxprs(eqn) -> list:
    """The open jaxprs an equation's parameters hold (a call's body, a loop's, ...).

    Args:
        eqn: a jaxpr equation.

    Returns:
        A list of ``Jaxpr``s.
    """
    return [_compat.open_jaxpr(j) for j in _compat.eqn_jaxprs(eqn)]


def all_constants(closed) -> list:
    """The constants of a closed jaxpr and of every closed jaxpr inside it (an inner
    ``jax.jit`` keeps the arrays it closes over as its own constants, which ``sub_jaxprs``
    leaves out).

    Args:
        closed: a ``ClosedJaxpr``.

    Returns:
        A list of its constants, outermost first.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> c = jnp.arange(3.0)
        >>> len(all_constants(jax.make_jaxpr(lambda x: jax.jit(lambda y: y + c)(x))(1.0)))
        1
    """
    out, stack = _compat.jaxpr_constants(closed), [_compat.open_jaxpr(closed)]
    while stack:
        for eqn in stack.pop().eqns:
            for sub in _compat.eqn_jaxprs(eqn):
                out += _compat.jaxpr_constants(sub)
                stack.append(_compat.open_jaxpr(sub))
    return out


def call_body(eqn):
    """The body of a call-like equation (jit, remat, custom_jvp/vjp, closed_call), or ``None``.

    A call's one sub-jaxpr maps the equation's inputs to its outputs, one to one, so an
    analysis can follow it. Loops (scan, while) look the same but are not calls: their analyses
    register rules for them.

    Args:
        eqn: a jaxpr equation.

    Returns:
        The body's open jaxpr, or ``None`` when the equation is not such a call.
    """
    subs = sub_jaxprs(eqn)
    if (len(subs) == 1 and len(subs[0].invars) == len(eqn.invars)
            and len(subs[0].outvars) == len(eqn.outvars)):
        return subs[0]
    return None


class Analysis:
    """A forward data-flow analysis: one abstract value per jaxpr variable.

    Each equation's outputs get their values from the rule registered for its primitive; an
    equation without a rule is followed into its body if it is a call (``call_body``), and
    otherwise given ``unknown(eqn, ins)``. Literals and constants get ``constant``.

    Args:
        constant: the value of literals and closure constants.
        unknown: ``unknown(eqn, ins) -> outs`` for equations with neither a rule nor a body.
        strict: whether a variable no equation gave a value is an error (a rule that returned
            too few values); otherwise it reads as ``constant``, which must then be the safe
            answer.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> constness = Analysis(constant=True,
        ...                      unknown=lambda eqn, ins: [all(ins)] * len(eqn.outvars))
        >>> jaxpr = jax.make_jaxpr(lambda x: x * 2 + 1)(1.0).jaxpr
        >>> constness.analyse(jaxpr, [False])
        [False]
    """

    def __init__(self, constant, unknown: Callable, strict: bool = False):
        self.constant = constant
        self.unknown = unknown
        self.strict = strict
        self.rules: dict = {}

    def register(self, *primitives) -> Callable:
        """A decorator: the decorated rule ``rule(eqn, ins) -> outs`` serves ``primitives``.

        Args:
            *primitives: ``jax.extend.core.Primitive`` objects.

        Returns:
            The decorator (it returns the rule unchanged).
        """
        for p in primitives:
            if not isinstance(p, _compat.Primitive):
                raise TypeError(f"Analysis.register: {p!r} is not a JAX primitive; pass the "
                                f"primitive object (jax.lax.<name>_p, or core._compat's).")

        def add(rule):
            for p in primitives:
                self.rules[p] = rule
            return rule

        return add

    def equation(self, eqn, ins: list) -> list:
        """The values of ``eqn``'s outputs, given those of its inputs."""
        rule = self.rules.get(eqn.primitive)
        if rule is not None:
            return rule(eqn, ins)
        body = call_body(eqn)
        if body is not None:
            return self.analyse(body, ins)
        return self.unknown(eqn, ins)

    def analyse(self, jaxpr, ins: list) -> list:
        """The values of ``jaxpr``'s outputs, given those of its inputs.

        Args:
            jaxpr: an open jaxpr.
            ins: one value per invar.

        Returns:
            One value per outvar.
        """
        env = dict(zip(jaxpr.invars, ins))
        env.update((v, self.constant) for v in jaxpr.constvars)
        constant = self.constant
        lookup = env.__getitem__ if self.strict else lambda v: env.get(v, constant)

        def read(v):
            return constant if isinstance(v, _compat.Literal) else lookup(v)

        for eqn in jaxpr.eqns:
            env.update(zip(eqn.outvars, self.equation(eqn, [read(v) for v in eqn.invars])))
        return [read(v) for v in jaxpr.outvars]
