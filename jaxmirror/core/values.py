"""Distributed values: ``PerReplica`` (one component per replica) and ``Mirrored`` (one value, N copies).

A ``PerReplica`` holds one global ``jax.Array`` whose leading axis is the replica axis, sharded
over the strategy's devices, so replica ``i``'s component lives on replica ``i``'s device and
passing it to ``run`` costs no copy. A ``Mirrored`` value is a ``jax.Array`` replicated over the
strategy's devices: ``run`` returns such arrays as they are (no wrapper, so they flow into flax,
optax and ``jax.jit`` untouched), and the ``Mirrored`` class below is the explicit, TF-style view of
one. Both classes are pytrees.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmirror.core import _compat, rich_display
from jaxmirror.core.bits import moved


class DistributedValues:
    """Base class of values with one component per replica (``tf.distribute.DistributedValues``).

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> v = s.experimental_distribute_values_from_function(lambda ctx: ctx.replica_id_in_sync_group)
        >>> isinstance(v, jaxmirror.DistributedValues)
        True
    """

    __slots__ = ()

    @property
    def values(self) -> tuple:
        """The components held by this process, one per local replica, in replica order."""
        raise NotImplementedError

    def _repr_components(self) -> str:
        payload = self._payload()
        if isinstance(payload, jax.Array) and not _compat.is_tracer(payload) and \
                payload.is_deleted():
            return f"{{ {rich_display.DELETED} }}"
        try:
            parts = self.values
        except Exception:  # a tracer of unknown length, say
            return f"{{ {payload!r} }}"
        body = ",\n".join(f"  {i}: {v!r}" for i, v in enumerate(parts))
        return "{\n" + body + "\n}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}:{self._repr_components()}"

    def _repr_html_(self) -> str | None:
        # Jupyter's rich display: one row per component this process holds.
        return rich_display.safe_html(lambda: rich_display.table(
            f"{type(self).__name__}", ["replica", "device", "shape", "dtype", "values"],
            self.display_rows()))

    def display_rows(self) -> list:
        """``[replica, device, shape, dtype, values]`` rows of this process's components, as
        the rich display shows them.

        Returns:
            A list of rows of str.
        """
        rows = rich_display.shard_rows(self._payload())
        return [[str(i)] + row for i, row in enumerate(rows)]


def components(stacked) -> tuple:
    """This process's components of a replica-stacked array, in replica order."""
    if _compat.is_tracer(stacked) or not isinstance(stacked, jax.Array):
        return tuple(stacked[i] for i in range(stacked.shape[0]))
    return tuple(jnp.squeeze(s.data, 0) for s in _local_shards(stacked))


def local_replica_indices(stacked) -> tuple:
    """The replicas whose components ``components(stacked)`` gives, in the same order."""
    if _compat.is_tracer(stacked) or not isinstance(stacked, jax.Array):
        return tuple(range(stacked.shape[0]))
    return tuple(s.index[0].start or 0 for s in _local_shards(stacked))


def _local_shards(stacked) -> list:
    """This process's shards of a replica-stacked array, in replica order."""
    return sorted(stacked.addressable_shards, key=lambda s: s.index[0].start or 0)


class PerReplica(DistributedValues):
    """A value with its own component on each replica (TF's ``PerReplica``).

    It wraps one global array ``stacked`` of shape ``(num_replicas, *component_shape)`` whose
    leading axis is sharded over the strategy's devices. ``run`` hands replica ``i`` the component
    ``stacked[i]`` and returns every value that differs across replicas as a ``PerReplica``.
    Make them with ``strategy.experimental_distribute_values_from_function`` or
    ``strategy.experimental_distribute_dataset``.

    A batch from a distributed dataset also carries ``row_counts``: how many of each
    component's rows are real. Every component is padded to the same static number of rows (so
    one compiled program serves uneven and partial batches), and ``values``,
    ``experimental_local_results``, ``reduce(..., axis=0)`` and ``gather`` see only the real rows,
    as TF's unpadded components would. ``row_counts`` is a dynamic part of the value (a pytree
    child), so a new partial batch does not recompile the step; ``jax.tree.map`` over such a
    batch therefore reaches the counts too: map over ``value.stacked``, or inside the step.

    Args:
        stacked: the components stacked along a new leading axis.
        row_counts: ``None``, or an int32 array of shape ``(num_replicas,)``: the real rows of
            each component (the rest of its ``stacked[i].shape[0]`` rows are padding).

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> v = s.experimental_distribute_values_from_function(
        ...     lambda ctx: float(ctx.replica_id_in_sync_group))
        >>> [float(c) for c in s.experimental_local_results(v)]
        [0.0, 1.0]
        >>> v.stacked.shape
        (2,)
    """

    __slots__ = ("_stacked", "_row_counts", "_reduced")

    def __init__(self, stacked, row_counts=None):
        self._stacked = stacked
        self._row_counts = row_counts
        self._reduced = None  # a step's sum over the replicas (see attach_sum)

    def __reduce__(self):
        # Pickled and copied without a step's sum (see attach_sum): it names its strategy.
        return (PerReplica, (self._stacked, self._row_counts))

    @property
    def stacked(self):
        """The global array: components stacked along axis 0, sharded over the replicas."""
        return self._stacked

    @property
    def row_counts(self):
        """``None``, or the number of real (unpadded) rows of each component."""
        return self._row_counts

    @property
    def values(self) -> tuple:
        parts = components(self._stacked)
        if self._row_counts is None:
            return parts
        counts = host_counts(self._row_counts)  # every replica's, this worker's or not
        return tuple(parts[j][:counts[i]]
                     for j, i in enumerate(local_replica_indices(self._stacked)))

    def _payload(self):
        return self._stacked

    def display_rows(self) -> list:
        # A batch shows its real rows only; the replica comes from where the shard sits.
        if (_compat.is_tracer(self._stacked) or not isinstance(self._stacked, jax.Array)
                or self._stacked.is_deleted()):
            return [["all"] + row for row in rich_display.shard_rows(self._stacked)]
        counts = None if self._row_counts is None else host_counts(self._row_counts)
        rows = []
        for shard in _local_shards(self._stacked):
            replica = shard.index[0].start or 0
            component = shard.data[0]
            if counts is not None:  # a batch: show its real rows only
                component = component[:counts[replica]]
            rows.append([str(replica), rich_display.device_label(shard.device),
                         str(tuple(component.shape)), str(component.dtype),
                         rich_display.preview(component)])
        return rows

    def __array__(self, dtype=None, copy=None):
        # NumPy would silently make a 0-d object array of the wrapper.
        raise TypeError(
            "PerReplica: cannot convert to one NumPy array; take this process's components "
            "with strategy.experimental_local_results(v), concatenate them with "
            "strategy.gather(v, axis=0), combine them with strategy.reduce, or use the "
            "replica-stacked global array v.stacked."
        )

    def __float__(self):
        # Python's own error would not say what to do (TF's `float(per_replica)` fails too).
        raise TypeError(
            "PerReplica: float() needs one value, and this has one per replica; combine them "
            "first: float(strategy.reduce('sum', v, axis=None)) (or 'mean').")


class GatheredPerReplica(PerReplica):
    """A replica-context value seen from a ``merge_fn``: this replica's component, stacked on demand.

    ``merge_call`` hands array arguments to ``merge_fn`` as these. Inside the SPMD program every
    replica holds its own component; ``stacked`` all-gathers them (once, only if asked), and
    ``reduce`` uses an all-reduce on the component instead, so the common "reduce the gradients
    in merge_fn" costs what ``all_reduce`` costs.

    Args:
        local: this replica's component (a traced array).
        axis_name: the replica axis of the running program.
    """

    __slots__ = ("_local", "_axis_name")

    def __init__(self, local, axis_name: str):
        super().__init__(None)
        self._local = local
        self._axis_name = axis_name

    @property
    def local(self):
        """This replica's component."""
        return self._local

    @property
    def axis_name(self) -> str:
        """The replica axis the component's collectives run over."""
        return self._axis_name

    @property
    def stacked(self):
        if self._stacked is None:
            # As bit patterns: XLA on CPU all-gathers bfloat16 through float32 (NaN payloads
            # lost).
            self._stacked = moved(lambda x: jax.lax.all_gather(x, self._axis_name),
                                  self._local)
        return self._stacked

    @property
    def values(self) -> tuple:
        return components(self.stacked)

    def _payload(self):
        return self._local


class Mirrored(DistributedValues):
    """One value held identically by every replica (TF's ``Mirrored``).

    ``run`` returns values that are provably the same on every replica (computed only from
    replicated inputs, constants and all-reduced or all-gathered values) as plain ``jax.Array``s
    replicated over the strategy's devices; jaxmirror treats such arrays as Mirrored everywhere
    (``reduce`` counts them N times for SUM, ``experimental_local_results`` gives N copies).
    Wrap one in ``Mirrored`` to see it the TF way or to mark a value as mirrored where its
    placement cannot say so (inside ``jax.jit``).

    Args:
        value: the array every replica holds.
        num_replicas: how many replicas hold it; by default the number of devices ``value`` is
            replicated over.

    Example:
        >>> import jax, jax.numpy as jnp, jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> m = jaxmirror.Mirrored(jax.device_put(jnp.float32(3), s.extended.replicated_sharding))
        >>> float(s.reduce("sum", m, axis=None))
        6.0
        >>> len(m.values)
        2
    """

    __slots__ = ("_value", "_num_replicas")

    def __init__(self, value, num_replicas: int | None = None):
        self._value = value
        self._num_replicas = num_replicas

    @property
    def value(self):
        """The array every replica holds."""
        return self._value

    @property
    def num_replicas(self) -> int:
        if self._num_replicas is not None:
            return self._num_replicas
        sharding = getattr(self._value, "sharding", None)
        return len(sharding.device_set) if sharding is not None else 1

    @property
    def values(self) -> tuple:
        v = self._value
        if isinstance(v, jax.Array) and not _compat.is_tracer(v) and len(v.addressable_shards) > 1:
            return tuple(s.data for s in v.addressable_shards)
        return (v,) * self.num_replicas

    def _payload(self):
        return self._value


def attach_sum(value: PerReplica, owner, total) -> None:
    """Record the cross-replica sum of ``value`` that its step computed along with it.

    A step's program sums its small per-replica results in the same dispatch
    (``step/cross_replica.py``); ``reduce`` then answers from here instead of running a program of
    its own. The sum is kept off the pytree (a ``jax.tree.map`` over ``value`` makes a value
    without it), out of pickles and copies, and names its strategy only weakly.

    Args:
        value: a ``PerReplica`` a step just returned.
        owner: a weak reference to the ``StrategyExtended`` whose step computed it (another
            strategy's ``reduce`` does not use it).
        total: the sum, replicated over the replicas.

    Example:
        >>> import weakref, jax.numpy as jnp
        >>> class Owner: pass
        >>> o, v = Owner(), PerReplica(jnp.arange(2.0))
        >>> attach_sum(v, weakref.ref(o), jnp.float32(1.0))
        >>> float(attached_sum(v, o)), attached_sum(v, Owner())
        (1.0, None)
    """
    value._reduced = (owner, total)


def attached_sum(value, owner):
    """The cross-replica sum of ``value`` that ``owner``'s step computed with it, or ``None``.

    Args:
        value: anything (only a ``PerReplica`` a step returned has one).
        owner: the ``StrategyExtended`` asking.

    Returns:
        The sum, or ``None``.
    """
    found = value._reduced if type(value) is PerReplica else None
    if found is None or found[0]() is not owner:
        return None
    return found[1]


def host_counts(row_counts) -> tuple:
    """Row counts as Python ints (read from one local copy: they are replicated)."""
    if isinstance(row_counts, jax.Array) and not _compat.is_tracer(row_counts):
        row_counts = row_counts.addressable_shards[0].data
    return tuple(int(k) for k in np.asarray(row_counts))


def _flatten_per_replica(v):
    if v._row_counts is None:
        return (v._stacked,), False
    return (v._stacked, v._row_counts), True


def _unflatten_per_replica(padded, children):
    if not padded:
        return PerReplica(children[0])
    counts = children[1]
    dtype = getattr(counts, "dtype", None)
    if dtype is not None and not _compat.is_tracer(counts) and dtype != np.int32:
        # jax.tree.map over a batch reaches its row counts too; refuse a mapped copy of them.
        raise ValueError(
            f"PerReplica: a padded batch's row counts must stay int32, but a jax.tree.map over "
            f"a batch from a distributed dataset turned them into {dtype}; map over "
            f"`value.stacked` instead, or transform the batch inside the step."
        )
    return PerReplica(children[0], counts)


jax.tree_util.register_pytree_node(PerReplica, _flatten_per_replica, _unflatten_per_replica)
# Inside a merge_fn, jax.tree.map over a per-replica value maps its component, as it maps an
# eager PerReplica's stacked array: optax-style code works on both.
jax.tree_util.register_pytree_node(
    GatheredPerReplica,
    lambda v: ((v._local,), v._axis_name),
    lambda axis_name, children: GatheredPerReplica(children[0], axis_name),
)
jax.tree_util.register_pytree_node(
    Mirrored,
    lambda v: ((v._value,), v._num_replicas),
    lambda n, children: Mirrored(children[0], n),
)


def is_per_replica(x) -> bool:
    return isinstance(x, PerReplica)


def is_distributed(x) -> bool:
    return isinstance(x, DistributedValues)
