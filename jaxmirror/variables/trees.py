"""Pytrees holding variables and/or arrays: read them all, assign them all."""

from __future__ import annotations

import jax

from jaxmirror.variables.operators import value_of
from jaxmirror.variables.handle import VariableHandle
from jaxmirror.variables.variable import Variable


def read_values(tree):
    """``tree`` with every ``Variable`` replaced by its value (arrays stay as they are).

    Use it to hand a pytree of variables to ``jax.grad``, optax or flax, which work on arrays.
    Inside ``run`` the values are the replica's; outside, the cross-replica values.

    Args:
        tree: a pytree whose leaves are variables and/or arrays.

    Returns:
        The same structure with arrays for leaves.

    Example:
        >>> import jaxmirror
        >>> params = {"w": jaxmirror.Variable([1.0, 2.0]), "b": 0.5}
        >>> jaxmirror.read_values(params)["w"].tolist()
        [1.0, 2.0]
    """
    return jax.tree.map(value_of, tree)


def assign_values(tree, new_values):
    """Assign ``new_values`` to the variables of ``tree``; return ``tree`` with its arrays replaced.

    The one update that works for both styles: variables are assigned in place (by their
    aggregation inside ``run``) and kept, plain array leaves are replaced by the new values. So
    ``params = assign_values(params, optax.apply_updates(read_values(params), updates))`` is right
    whether ``params`` holds variables, arrays or both.

    Args:
        tree: a pytree of variables and/or arrays.
        new_values: a pytree of arrays with the same structure.

    Returns:
        A pytree like ``tree``: the same variables, new arrays.

    Example:
        >>> import jaxmirror
        >>> params = {"w": jaxmirror.Variable(1.0), "b": 0.5}
        >>> params = jaxmirror.assign_values(params, {"w": 2.0, "b": 1.5})
        >>> float(params["w"].numpy()), params["b"]
        (2.0, 1.5)
    """

    def assign(target, new):
        if isinstance(target, (Variable, VariableHandle)):
            target.assign(new)
            return target
        return new

    return jax.tree.map(assign, tree, new_values)
