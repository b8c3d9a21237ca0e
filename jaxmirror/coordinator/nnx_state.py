"""flax NNX objects whose state lives on parameter servers: their leaves, and a worker's copy.

``ParameterServerStrategy.init`` builds NNX objects (a model, its ``nnx.Optimizer``) and keeps
every numeric array of their state in a parameter-server variable. A worker's copy of the
objects is ``WorkerObjects``: before each closure its state is loaded from the worker's copies of
those variables, and after the closure the state it ended with is copied back into them, from
where the changes go to the parameter servers as differences, as ``assign_add`` would send them
(so an optimizer's steps from several workers add up). PRNG keys are not numbers: each worker
keeps the ones it was sent.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmirror.step.graphs import is_graph_node


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def split_objects(objects: tuple) -> tuple:
    """The objects' graph definition, state structure and ``(path, variable type, value)`` leaves.

    Args:
        objects: NNX objects, split together (so shared submodules stay shared).

    Returns:
        ``(graphdef, treedef, leaves)``.

    Example:
        >>> from flax import nnx
        >>> _, _, leaves = split_objects((nnx.Linear(2, 1, rngs=nnx.Rngs(0)),))
        >>> [(path, kind, value.shape) for path, kind, value in leaves]
        [("[0]['bias']", 'Param', (1,)), ("[0]['kernel']", 'Param', (2, 1))]
    """
    graphdef, state = nnx.split(objects)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_variable)
    leaves = [(jax.tree_util.keystr(path), type(v).__name__, v.get_value()) for path, v in flat]
    return graphdef, treedef, leaves


def is_numeric(value) -> bool:
    """Whether a state leaf can live on a parameter server (numbers, not PRNG keys).

    Args:
        value: an array.

    Returns:
        A bool.

    Example:
        >>> import jax
        >>> is_numeric(np.zeros(2)), is_numeric(jax.random.key(0))
        (True, False)
    """
    return not jnp.issubdtype(jnp.result_type(value), jax.dtypes.prng_key)


def state_of(treedef, values: list):
    """An ``nnx.State`` of the structure ``treedef`` with the leaves ``values``."""
    return jax.tree_util.tree_unflatten(treedef, values)


def leaf_values(objects: tuple) -> list:
    """The objects' state leaves now, in ``split_objects``' order.

    Args:
        objects: the NNX objects.

    Returns:
        A list of arrays.
    """
    state = nnx.state(objects)
    return [v.get_value() for v in jax.tree.leaves(state, is_leaf=_is_variable)]


def _local_variables(handle) -> list:
    return list(handle.variables) if hasattr(handle, "variables") else [handle]


class WorkerObjects:
    """A worker's copy of NNX objects whose numeric state is in parameter-server variables.

    Args:
        graphdef: the objects' graph definition.
        treedef: their state's structure.
        leaves: per state leaf, ``("variable", the worker's copy of its variable)`` (a
            ``jaxmirror.Variable`` or ``ShardedVariable``) or ``("key", a PRNG key)``.
        var_ids: the parameter-server variables behind them.

    Example:
        (made in a worker by ``worker_runtime.nnx_object``)
        >>> WorkerObjects.__name__
        'WorkerObjects'
    """

    def __init__(self, graphdef, treedef, leaves: list, var_ids):
        self.treedef = treedef
        self.leaves = leaves
        self.var_ids = frozenset(var_ids)
        self.objects = nnx.merge(graphdef, state_of(treedef, self._values()))

    def _values(self) -> list:
        return [x.read_value() if kind == "variable" else x for kind, x in self.leaves]

    def load(self) -> None:
        """Give the objects the values their variables hold now (at a closure's start)."""
        nnx.update(self.objects, state_of(self.treedef, self._values()))

    def store(self) -> None:
        """Copy the objects' state into their variables (at a closure's end); not as overwrites,
        so each change goes to the parameter server as a difference."""
        values = leaf_values(self.objects)
        with contextlib.ExitStack() as stack:
            for kind, x in self.leaves:
                for v in _local_variables(x) if kind == "variable" else ():
                    stack.enter_context(v.overwrites_unwatched())
            for (kind, x), value in zip(self.leaves, values):
                if kind == "variable":
                    x.assign(value, read_value=False)


def find_objects(tree) -> list:
    """The NNX objects among ``tree``'s leaves, in order, each once.

    Args:
        tree: a pytree (NNX objects are leaves).

    Returns:
        A list.

    Example:
        >>> from flax import nnx
        >>> m = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> find_objects((m, {"m": m, "x": 1})) == [m]
        True
    """
    found, seen = [], set()
    for x in jax.tree.leaves(tree, is_leaf=is_graph_node):
        if is_graph_node(x) and id(x) not in seen:
            seen.add(id(x))
            found.append(x)
    return found


def as_host(value) -> np.ndarray:
    """A numeric state leaf as a NumPy array (a parameter server's initial value)."""
    return np.asarray(jax.device_get(value))
