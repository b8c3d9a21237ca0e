"""The distributed variables: ``MirroredVariable`` and ``SyncOnReadVariable``.

Both hold one component per replica: a mirrored variable as one array replicated over the
strategy's devices (or, once replicas wrote different values with aggregation NONE, a
replica-stacked ``PerReplica``), a sync-on-read variable always as a ``PerReplica``. ``Variable``
(``variable.py``) holds what all variables share and dispatches each read and write, by the
context it happens in, to the ``_replica_*``, ``_traced_cross_*`` and ``_eager_*`` methods
overridden here; each class's docstring states its rules.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmirror.core import binding
from jaxmirror.core.bits import moved
from jaxmirror.core.reduce_op import ReduceOp, VariableAggregation, VariableSynchronization
from jaxmirror.core.values import (DistributedValues, GatheredPerReplica, Mirrored, PerReplica,
                                   components)
from jaxmirror.runtime import ledger
from jaxmirror.variables import display, state
from jaxmirror.variables.assignment import combine, convert, owned_copy
from jaxmirror.variables.variable import Variable

Agg = VariableAggregation
Sync = VariableSynchronization


# -- collectives the rules use (inside the step, over the replica axis) ---------------------------
def _first_replica(x, axis_name):
    """Replica 0's value on every replica."""
    x = jnp.asarray(x)
    keep = lax.axis_index(axis_name) == 0
    if x.dtype == jnp.bool_:
        return lax.psum(jnp.where(keep, x, False).astype(jnp.int32), axis_name).astype(jnp.bool_)
    # A sum with zeros moves integers exactly, floats not (subnormals, -0.0, NaN payloads).
    return moved(lambda a: lax.psum(jnp.where(keep, a, jnp.zeros_like(a)), axis_name), x)


def _aggregate(agg: VariableAggregation, x, axis_name, n: int):
    """What every replica writes when each offers ``x``, by ``agg`` (not NONE)."""
    if agg is Agg.SUM:
        return lax.psum(x, axis_name)
    if agg is Agg.MEAN:
        return lax.psum(x, axis_name) / n
    return _first_replica(x, axis_name)


def _is_constant(x) -> bool:
    """A Python or NumPy constant, as opposed to an array produced in the replica."""
    return isinstance(x, (int, float, complex, np.ndarray, np.generic, list, tuple))


def _non_distributed_sum_error(value) -> ValueError:
    return ValueError(  # TF's wording, on purpose, and what to do
        f"A non-DistributedValues value {value!r} cannot be reduced with the given reduce op "
        f"{ReduceOp.SUM}. Compute the value in the replica (e.g. jnp.asarray(value)) to assign "
        f"each replica's contribution to a SUM variable."
    )


class _DistributedVariable(Variable, DistributedValues):
    """What mirrored and sync-on-read variables share: one component per replica."""

    @property
    def values(self) -> tuple:
        """This process's components, one per local replica, as arrays."""
        return self._components()

    def _components(self, report: bool = True) -> tuple:
        state.settle(self, report)
        if self.stored_per_replica:
            return components(self._state.stacked)
        n = self._placement.num_local_replicas if self._num_replicas > 1 else 1
        return Mirrored(self._state, n).values

    def distributed_view(self):
        """This variable as the DistributedValues ``reduce``/``gather`` see (per context).

        Returns:
            Outside ``run``: its state (a ``PerReplica``, or ``Mirrored``). Inside a
            ``merge_fn``: a ``Mirrored`` of the traced value, or a ``GatheredPerReplica``.
        """
        slot = self._slot()
        n = self._num_replicas
        if slot is None:
            state.settle(self)
            if self.stored_per_replica:
                return self._state
            return Mirrored(self._state, n) if n > 1 else self._state
        if n == 1:
            return slot.value
        if slot.mirrored and not self.always_per_replica:
            return Mirrored(slot.value, n)
        return GatheredPerReplica(slot.value, binding.current().axis_name)

    def __repr__(self) -> str:
        body = ",\n".join(f"  {i}: {r}" for i, r in enumerate(self._components_repr()))
        return f"{type(self).__name__}:{{\n{body}\n}}"


class MirroredVariable(_DistributedVariable, synchronization=Sync.ON_WRITE):
    """A variable kept identical on every replica (``tf.distribute.MirroredVariable``).

    Made by ``jaxmirror.Variable(...)`` inside a strategy's scope (synchronization AUTO or
    ON_WRITE). Stored as one array replicated over the strategy's devices. In a replica
    context an assignment is combined by ``aggregation``: SUM (the sum of the replicas' values;
    a Python constant is refused), MEAN, ONLY_FIRST_REPLICA (replica 0's), each written to every
    component; NONE lets each replica write its own component (a cross-replica read then gives
    component 0). In cross-replica context an assignment writes every component.

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with s.scope():
        ...     v = jaxmirror.Variable(0.0, aggregation="mean")
        >>> _ = s.run(lambda: v.assign(jaxmirror.get_replica_context().replica_id_in_sync_group * 1.0))
        >>> [float(c) for c in v.values]
        [0.5, 0.5]
    """

    def _eager_read(self):
        if self.stored_per_replica:  # replicas wrote different values (NONE): component 0
            return self._placement.replicate(components(self._state.stacked)[0])
        return self._state

    def _traced_cross_read(self, slot):
        frame = binding.current()
        if slot.mirrored or frame.num_replicas == 1:
            return slot.value
        return _first_replica(slot.value, frame.axis_name)

    def _replica_write(self, slot, method, value):
        frame = binding.current()
        n = frame.num_replicas
        if self._aggregation is Agg.NONE or n == 1:
            return super()._replica_write(slot, method, value)
        if self._aggregation is Agg.SUM and _is_constant(value):
            raise _non_distributed_sum_error(value)
        delta = convert(self, value, method)
        combined = _aggregate(self._aggregation, delta, frame.axis_name, n).astype(self._dtype)
        slot.write(combine(method, slot.value, combined), slot.mirrored or method == "assign")

    def _eager_write(self, method, value):
        new = owned_copy(convert(self, value, method))
        placement = self._placement
        if method == "assign":
            return placement.store(new)
        old = self._state
        if isinstance(old, PerReplica):
            return PerReplica(placement.place_stacked(
                combine(method, old.stacked, placement.replicate(new))))
        return placement.store(combine(method, old, placement.store(new)))


class SyncOnReadVariable(_DistributedVariable, synchronization=Sync.ON_READ):
    """A variable each replica updates on its own, aggregated when read (``tf.distribute.SyncOnReadVariable``).

    Made by ``jaxmirror.Variable(..., synchronization="on_read", trainable=False)`` inside a
    strategy's scope; typical for metrics. Stored as one replica-stacked array. In a replica
    context reads and writes touch the replica's own component. In cross-replica context a read
    is the SUM or MEAN of the components (component 0 for ONLY_FIRST_REPLICA; NONE raises); an
    assignment stores ``value / N`` in every component for SUM, ``value`` otherwise;
    ``assign_add`` with SUM raises.

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with s.scope():
        ...     total = jaxmirror.Variable(0.0, synchronization="on_read", aggregation="sum")
        >>> _ = s.run(lambda: total.assign_add(jaxmirror.get_replica_context().replica_id_in_sync_group + 1.0))
        >>> float(total.numpy()), [float(c) for c in total.values]
        (3.0, [1.0, 2.0])
    """

    @property
    def always_per_replica(self) -> bool:
        """True: each replica keeps its own component, aggregated only when read."""
        return True

    def _cross_op(self):
        if self._aggregation is Agg.NONE:
            raise ValueError(  # TF's wording, on purpose (and below)
                f"Could not convert from `VariableAggregation` {Agg.NONE} to `ReduceOp` type: "
                f"SyncOnReadVariable {self._name!r} with aggregation NONE cannot be read in "
                f"cross-replica context; give it aggregation SUM, MEAN or ONLY_FIRST_REPLICA."
            )
        return self._aggregation

    def _eager_read(self):
        agg = self._cross_op()
        if self._placement.multi_process:  # the aggregate is a sum across the workers
            ledger.agree("SyncOnReadVariable.read_value",
                         f"{self._name!r} {jnp.dtype(self._dtype).name}{list(self._shape)}")
        stacked = self._state.stacked if self.stored_per_replica else self._state[None]
        placement = self._placement
        if agg is Agg.ONLY_FIRST_REPLICA:
            return placement.replicate(components(stacked)[0])
        total = stacked.sum(0) if agg is Agg.SUM else stacked.mean(0)
        return placement.replicate(total.astype(self._dtype))

    def _traced_cross_read(self, slot):
        frame = binding.current()
        agg = self._cross_op()
        if frame.num_replicas == 1:
            return slot.value
        return _aggregate(agg, slot.value, frame.axis_name, frame.num_replicas).astype(self._dtype)

    def _replica_write(self, slot, method, value):
        slot.write(combine(method, slot.value, convert(self, value, method)),
                   binding.current().num_replicas == 1)

    def _cross_value(self, method: str, value, n: int):
        if method != "assign" and self._aggregation is Agg.SUM:
            raise ValueError(
                f"SyncOnReadVariable does not support `{method}` in cross-replica context when "
                f"aggregation is set to `VariableAggregation.SUM` (variable {self._name!r}); "
                f"assign the new total instead."
            )
        new = convert(self, value, method)
        if method == "assign" and self._aggregation is Agg.SUM:
            new = (new / n).astype(self._dtype)
        return new

    def _traced_cross_write(self, slot, method, value):
        new = self._cross_value(method, value, binding.current().num_replicas)
        slot.write(combine(method, slot.value, new), slot.mirrored and method == "assign")

    def _eager_write(self, method, value):
        placement = self._placement
        new = owned_copy(self._cross_value(method, value, self._num_replicas))
        if self._num_replicas == 1:
            return placement.replicate(combine(method, self._state, new))
        if method == "assign":
            return placement.stack_copies(new)
        return PerReplica(placement.place_stacked(combine(method, self._state.stacked,
                                                          placement.replicate(new))))


__all__ = ["MirroredVariable", "SyncOnReadVariable"]


class AggregatingVariable(MirroredVariable, synchronization=Sync.ON_WRITE, central=True):
    """A variable stored once, on the parameter device (TF's ``AggregatingVariable``).

    Made by ``jaxmirror.Variable(...)`` inside ``CentralStorageStrategy``'s scope with several
    replicas. Each step broadcasts it to the replicas; assignments in a replica context are
    combined by ``aggregation`` as a ``MirroredVariable``'s are (SUM, MEAN,
    ONLY_FIRST_REPLICA), and the one result goes back to the parameter device. With NONE an
    assignment in a replica context raises: one copy cannot hold every replica's value.
    It prints as the one variable it is.

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.experimental.CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:2")
        >>> with s.scope():
        ...     v = jaxmirror.Variable(0.0, aggregation="sum")
        >>> _ = s.run(lambda: v.assign_add(1.0 + jaxmirror.get_replica_context().replica_id_in_sync_group))
        >>> v
        <jaxmirror.Variable 'Variable:0' shape=() dtype=float32, numpy=3.0>
    """

    @property
    def single_copy(self) -> bool:
        return True

    def _replica_write(self, slot, method, value):
        frame = binding.current()
        if self._aggregation is Agg.NONE and frame.num_replicas > 1:
            raise ValueError(
                f"Variable.{method}: {self.name!r} lives once on the parameter device, so in a "
                f"replica context its replicas' values must be combined, and its aggregation "
                f"is NONE; create it with an aggregation, e.g. jaxmirror.Variable(..., "
                f"aggregation=jaxmirror.VariableAggregation.SUM) (or MEAN, "
                f"ONLY_FIRST_REPLICA), or assign it in cross-replica context.")
        return super()._replica_write(slot, method, value)

    def _components_repr(self) -> list[str]:
        return display.component_reprs(self, lambda: (self.read_value(),), 1)

    def __repr__(self) -> str:
        return self._components_repr()[0]
