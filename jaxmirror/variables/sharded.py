"""``ShardedVariable``: one variable split along axis 0 into several (``tf.distribute``'s).

``ParameterServerStrategy`` with a ``variable_partitioner`` makes one for every variable the
partitioner splits, each shard on a parameter server (round-robin). Reading concatenates the
shards; assigning splits the value along axis 0. A checkpoint holds the whole value, so it
restores into any number of shards, or into an unsharded variable of another strategy.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxmirror.core import rich_display
from jaxmirror.variables.handle import VariableHandle
from jaxmirror.variables.operators import value_of


class ShardedVariable(VariableHandle):
    """A variable made of shards along axis 0 (``tf.distribute.experimental.ShardedVariable``).

    Args:
        variables: the shards, in order: variables (or variable handles) with one dtype and the
            same shape past axis 0.
        name: the variable's name (default ``"ShardedVariable"``).

    Raises:
        ValueError: for no shards, shards of different dtypes or trailing shapes, or rank-0
            shards.

    Example:
        >>> import jaxmirror
        >>> v = jaxmirror.experimental.ShardedVariable(
        ...     [jaxmirror.Variable([1.0, 2.0]), jaxmirror.Variable([3.0])])
        >>> v.read_value().tolist()
        [1.0, 2.0, 3.0]
        >>> _ = v.assign_sub([1.0, 1.0, 1.0])
        >>> [s.numpy().tolist() for s in v.variables]
        [[0.0, 1.0], [2.0]]
    """

    def __init__(self, variables, name=None):
        variables = list(variables)
        if not variables:
            raise ValueError("ShardedVariable: `variables` must hold at least one variable, "
                             "got none.")
        first = variables[0]
        for v in variables:
            if len(v.shape) == 0:
                raise ValueError(f"ShardedVariable: shards are split along axis 0; got a "
                                 f"rank-0 shard {v.name!r}.")
            if tuple(v.shape[1:]) != tuple(first.shape[1:]) or np.dtype(v.dtype) != np.dtype(
                    first.dtype):
                raise ValueError(
                    f"ShardedVariable: all shards must have the same dtype and shape past axis "
                    f"0; got {first.name!r} {first.dtype}{tuple(first.shape)} and {v.name!r} "
                    f"{v.dtype}{tuple(v.shape)}.")
        self._variables = variables
        self._name = "ShardedVariable" if name is None else str(name)
        self._shape = (sum(v.shape[0] for v in variables),) + tuple(first.shape[1:])
        self._dtype = first.dtype
        self._trainable = getattr(first, "trainable", True)
        self._aggregation = first.aggregation
        self._synchronization = first.synchronization
        self._rows = np.cumsum([v.shape[0] for v in variables])[:-1].tolist()

    @property
    def variables(self) -> list:
        """The shards, in order along axis 0."""
        return list(self._variables)

    @property
    def distribute_strategy(self):
        """The strategy of the shards."""
        return self._variables[0].distribute_strategy

    @property
    def device(self) -> str:
        """The device of the first shard."""
        return self._variables[0].device

    def read_value(self):
        """The whole value: the shards concatenated along axis 0.

        Returns:
            An array of ``shape``.
        """
        return jnp.concatenate([jnp.asarray(value_of(v)) for v in self._variables], axis=0)

    def _apply(self, method: str, value) -> None:
        if np.shape(value) == ():  # a scalar delta applies to every shard
            parts = [value] * len(self._variables)
        else:
            value = value_of(value)
            value = value if hasattr(value, "shape") else np.asarray(value)
            parts = jnp.split(value, self._rows, axis=0) if not isinstance(
                value, np.ndarray) else np.split(value, self._rows, axis=0)
        for v, part in zip(self._variables, parts):
            getattr(v, method)(part, read_value=False)

    def _repr_html_(self) -> str | None:
        # Jupyter's rich display: one row per shard, with its rows of the whole value.
        return rich_display.safe_html(self._html)

    def _html(self) -> str:
        starts = [0] + self._rows
        rows = [[str(i), f"{start}:{start + v.shape[0]}", str(v.device), str(tuple(v.shape)),
                 rich_display.preview(value_of(v))]
                for i, (start, v) in enumerate(zip(starts, self._variables))]
        title = (f"ShardedVariable '{self._name}' shape={self._shape} "
                 f"dtype={np.dtype(self._dtype).name}, {len(rows)} shard(s)")
        return rich_display.table(title, ["shard", "rows", "stored on", "shape", "values"], rows)

    def __repr__(self) -> str:
        shards = ", ".join(str(tuple(v.shape)) for v in self._variables)
        return (f"<ShardedVariable {self._name!r} shape={self._shape} "
                f"dtype={np.dtype(self._dtype).name} shards=[{shards}]>")
