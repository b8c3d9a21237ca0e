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


def variables_of(objects: tuple) -> list:
    """The objects' own ``nnx.Variable``s, in ``split_objects``' leaf order.

    Args:
        objects: the NNX objects.

    Returns:
        A list of ``nnx.Variable`` (the objects', not copies).

    Example:
        >>> from flax import nnx
        >>> m = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> variables_of((m,))[1] is m.kernel
        True
    """
    return jax.tree.leaves(nnx.state(objects), is_leaf=_is_variable)


class WorkerObjects:
    """A worker's copy of NNX objects whose numeric state is in parameter-server variables.

    The state's values are host arrays kept by the worker for each variable (no
    ``jaxmirror.Variable`` per leaf): ``load`` puts the values pulled for a closure into the
    objects in one transfer; ``store`` takes the state the closure left in one transfer and
    hands each variable its final value, from which the worker sends differences.

    Args:
        graphdef: the objects' graph definition.
        treedef: their state's structure.
        leaves: per state leaf, ``("variable", specs)`` (the ``VariableSpec`` of each shard,
            in order along axis 0) or ``("key", a PRNG key)``.
        var_ids: the parameter-server variables behind them.
        values: the worker's records by variable id, with ``pulled`` (read) and ``final``
            (written) host values.

    Example:
        (made in a worker by ``worker_runtime.nnx_object``)
        >>> WorkerObjects.__name__
        'WorkerObjects'
    """

    def __init__(self, graphdef, treedef, leaves: list, var_ids, values: dict):
        self.treedef = treedef
        self.leaves = leaves
        self.var_ids = frozenset(var_ids)
        self._values = values
        zeros = [_whole([np.zeros(sp.shape, sp.dtype) for sp in x]) if kind == "variable" else x
                 for kind, x in leaves]
        self.objects = nnx.merge(graphdef, state_of(treedef, zeros))

    def load(self) -> None:
        """Give the objects the values pulled for this closure."""
        values = [_whole([self._values[sp.var_id].pulled for sp in x]) if kind == "variable"
                  else x for kind, x in self.leaves]
        nnx.update(self.objects, state_of(self.treedef, jax.device_put(values)))

    def store(self) -> None:
        """Record the state the closure left, as each variable's final value.

        Raises:
            ValueError: when the closure changed the objects' structure (a Variable made or
                removed); values sown with ``sow`` (``nnx.Intermediate``) are dropped first.
        """
        nnx.pop(self.objects, nnx.Intermediate)  # per-call outputs, not state to keep
        state = nnx.state(self.objects)
        variables, treedef = jax.tree.flatten(state, is_leaf=_is_variable)
        if treedef != self.treedef:
            raise ValueError(
                "a scheduled function changed the structure of NNX objects built by "
                "ParameterServerStrategy.init (a Variable made or removed inside it): their "
                "state on the parameter servers has a fixed structure; create every Variable "
                "in the function given to strategy.init.")
        values = jax.device_get([v.get_value() for v in variables])
        for (kind, specs), value in zip(self.leaves, values):
            if kind != "variable":
                continue
            cuts = np.cumsum([sp.shape[0] for sp in specs])[:-1] if len(specs) > 1 else []
            for sp, part in zip(specs, np.split(np.asarray(value), cuts) if len(specs) > 1
                                else [value]):
                self._values[sp.var_id].final = np.asarray(part, dtype=sp.dtype)


def _whole(parts: list) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


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
