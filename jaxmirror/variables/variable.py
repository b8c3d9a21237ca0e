"""``Variable``: a stateful box around one ``jax.Array`` (``tf.Variable``); it owns its state.

A plain variable's array lives on one device; inside a strategy's scope ``Variable(...)`` makes a
``MirroredVariable`` or ``SyncOnReadVariable`` (``distributed.py``). Where a read or a write
happens decides what it does:

* inside ``run``'s step, in replica context: ``core.binding`` gives the variable a traced value;
  writes follow the replica rules (``_replica_write``);
* inside a ``merge_call``'s ``merge_fn`` (cross-replica context in the step): ``_traced_cross_*``;
* outside ``run``: ``_eager_*``, on the stored array;
* inside ``extended.update``'s function: components are read and written as they are.

A variable's state (one array, or a ``PerReplica`` of components) is a ``state.VariableState``
the variable owns: a compiled step's writes stay open until the step is known to have
succeeded, so every eager use of a variable here first settles them (``state.settle``), and
every eager read-modify-write holds ``state.lock``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxmirror.core import _compat, binding, context, rich_display
from jaxmirror.core.reduce_op import (
    VariableAggregation,
    VariableSynchronization,
    as_aggregation,
    as_synchronization,
)
from jaxmirror.core.stateful import Stateful
from jaxmirror.core.values import PerReplica
from jaxmirror.variables import creation, display, state
from jaxmirror.variables.identity import Identity
from jaxmirror.variables.assignment import combine, convert, owned_copy
from jaxmirror.variables.operators import ArrayOperators
from jaxmirror.variables.overwrites import OverwriteWatch

Agg = VariableAggregation
Sync = VariableSynchronization
# What ``Variable(...)`` makes in a strategy's scope, by synchronization (ON_WRITE, ON_READ)
# and whether the strategy stores variables centrally (``Placement.central``).
# The distributed classes register themselves when they are defined (``__init_subclass__``):
# they subclass Variable, so this module cannot import them.
_DISTRIBUTED_CLASSES: dict = {}


class Variable(ArrayOperators, Identity, OverwriteWatch, Stateful):
    """A variable: one array you can read and assign (``tf.Variable``).

    Created inside a strategy's ``scope()`` it becomes a distributed variable: a
    ``MirroredVariable`` (``synchronization`` AUTO or ON_WRITE) or a ``SyncOnReadVariable``
    (ON_READ) of that strategy, with every component starting from the initial value. Outside
    any scope it is a plain variable on JAX's default device.

    Variables work inside ``strategy.run`` whether passed as arguments or captured by closure:
    the step reads their values and its assignments are written back after the call, all or
    nothing. Inside the step, assignments follow ``aggregation`` (SUM, MEAN, ONLY_FIRST_REPLICA
    combine the replicas' values and write the result to every component; NONE lets each replica
    write its own). Operators (``v + 1``, ``v @ w``, ``v[0]``) act on the value, and so do
    ``jnp`` functions, ``np.asarray(v)``, and ``jax.jit(f)(v)``/``jax.grad(f)(v)`` (which get
    the value as an array; a step still gets the variable). ``v.ref()`` is TF's hashable key.
    Variables are not pytrees: ``jax.tree`` treats them as leaves (see ``read_values`` /
    ``assign_values`` for pytrees of them). Inside a step, read variables anywhere, but assign
    them in the step itself, not inside a nested ``jax.jit``, ``jax.grad`` or ``lax`` control
    flow body (compute the value there and assign it after); a step that uses variables cannot
    itself be called inside ``jax.jit``.

    Every assignment (eager, by ``extended.update``, or by a whole step) is one atomic
    read-modify-write, so threads sharing variables lose no update; between threads they apply
    in the order they take the variables' lock. A step that fails at run time leaves every
    variable it wrote with its previous value (its error is raised by its results).

    Args:
        initial_value: an array, a Python number, or a callable returning one.
        trainable: whether gradient-based training should update it; ``None`` means True,
            except for ON_READ variables (which may still be made trainable, as in TF 2).
        synchronization: a ``VariableSynchronization`` or its name.
        aggregation: a ``VariableAggregation`` or its name.
        dtype: the dtype; by default the initial value's.
        name: the variable's name (default ``"Variable"``).

    Raises:
        ValueError: for a missing initial value, an unknown synchronization or aggregation,
            or ``synchronization=NONE`` inside a scope.
        RuntimeError: when created inside ``run`` (create variables before the step), or in
            another strategy's scope entered inside the default strategy's scope.

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with s.scope():
        ...     v = jaxmirror.Variable(1.0, aggregation="sum")
        >>> type(v).__name__
        'MirroredVariable'
        >>> @s.function
        ... def step():
        ...     v.assign_add(jaxmirror.get_replica_context().replica_id_in_sync_group + 1.0)
        >>> step()
        >>> float(v.numpy())
        4.0
    """

    def __init_subclass__(cls, synchronization=None, central=False, **kwargs):
        super().__init_subclass__(**kwargs)
        if synchronization is not None:
            _DISTRIBUTED_CLASSES[synchronization, central] = cls

    def __new__(cls, initial_value=None, trainable=None, synchronization=Sync.AUTO,
                aggregation=Agg.NONE, dtype=None, name=None):
        if cls is not Variable:
            if initial_value is None:  # copy and pickle make the object first, then fill it
                return object.__new__(cls)
            raise TypeError(f"{cls.__name__}: not created directly; create variables with "
                            f"jaxmirror.Variable(...), which is a {cls.__name__} inside a "
                            f"strategy's scope when the synchronization says so.")
        sync = as_synchronization(synchronization)
        strategy = creation.owning_strategy()
        if strategy is not None and strategy.extended.variable_creator is not None:
            # Stored elsewhere (parameter servers): not a Variable, so __init__ does not run.
            return strategy.extended.variable_creator(initial_value, trainable, sync,
                                                      as_aggregation(aggregation), dtype, name)
        if strategy is None or not strategy.extended.placement.distributed_variables:
            return object.__new__(Variable)
        kind = Sync.ON_READ if sync is Sync.ON_READ else Sync.ON_WRITE
        central = kind is Sync.ON_WRITE and strategy.extended.placement.central
        return object.__new__(_DISTRIBUTED_CLASSES[kind, central])

    def __init__(self, initial_value=None, trainable=None, synchronization=Sync.AUTO,
                 aggregation=Agg.NONE, dtype=None, name=None):
        sync = as_synchronization(synchronization)
        agg = as_aggregation(aggregation)
        name = "Variable" if name is None else str(name)
        trainable = creation.checked_trainable(trainable, sync, name)
        strategy = creation.checked_owner(sync, name)
        value = creation.initial_array(initial_value, dtype, name)
        self._strategy = strategy
        self._synchronization = sync
        self._aggregation = agg
        self._trainable = bool(trainable)
        self._name = name
        self._shape = tuple(value.shape)
        self._dtype = value.dtype
        self._held = state.VariableState(self._placed(value))
        if strategy is not None:
            creation.register(strategy, self)

    def __getstate__(self):
        return state.detached_attributes(self)  # copy and pickle: the settled state

    # -- properties -----------------------------------------------------------------------------
    @property
    def distribute_strategy(self):
        """The strategy whose scope made this variable (the default strategy for a plain one)."""
        return self._strategy or context.default_strategy()

    # -- what compiled steps need (core.stateful.Stateful) -----------------------------------
    @property
    def variable_state(self) -> "state.VariableState":
        """The ``VariableState`` this variable owns: its stored value (``.value``, which may
        be a step's open write) and what undoing a failed step needs (``variables/state.py``).
        For steps, tests and diagnostics; read values with ``read_value()``."""
        return self._held

    @property
    def _state(self):
        return self._held.value

    @property
    def stored_per_replica(self) -> bool:
        """Whether the state holds one component per replica (a replica-stacked array)."""
        return isinstance(self._state, PerReplica)

    @property
    def single_copy(self) -> bool:
        """Whether the variable holds one copy for all replicas (central storage), which no
        per-replica value may be written to."""
        return False

    @property
    def always_per_replica(self) -> bool:
        """Whether the components stay one per replica even when they agree (sync-on-read)."""
        return False

    def check_usable_in(self, strategy) -> None:
        """Raise ``ValueError`` unless a step of ``strategy`` may use this variable.

        Args:
            strategy: the strategy whose step met the variable.
        """
        if self._strategy is not None and self._strategy is not strategy:
            raise ValueError(
                f"Variable {self._name!r}: created in the scope of another strategy object "
                f"({self._strategy!r} at {id(self._strategy):#x}), so {strategy!r} at "
                f"{id(strategy):#x} cannot use it; create it inside `strategy.scope()` of the "
                f"strategy that uses it. In a notebook this usually means the cell that creates "
                f"the strategy ran again after this variable was made: run the cells after it "
                f"again too, those that make the variables and models and those that define "
                f"the steps (a step made by @strategy.run keeps the strategy of its cell)."
            )

    def distributed_view(self):
        """This variable as ``reduce``/``gather``/local results see it: its value.

        Returns:
            ``read_value()`` (distributed variables give a distributed value instead).
        """
        return self.read_value()

    # -- what the rules need ---------------------------------------------------------------------
    @property
    def _num_replicas(self) -> int:
        return self._strategy.num_replicas_in_sync if self._strategy is not None else 1

    @property
    def _placement(self):
        return self._strategy.extended.placement


    def _placed(self, value):
        """The state holding ``value`` in every component, placed as this variable's is."""
        if self._strategy is None:
            return jnp.asarray(value)
        placement = self._placement
        if self.always_per_replica and placement.num_replicas > 1:
            return placement.stack_copies(value)
        return placement.store(value)

    def _slot(self):
        frame = binding.current()
        return None if frame is None else frame.lookup(self)

    # -- reads ----------------------------------------------------------------------------------
    def read_value(self):
        """The variable's value, as the current context sees it.

        In a replica context inside ``run``: this replica's component. In cross-replica
        context: a mirrored variable's value (component 0) or a sync-on-read variable's
        aggregate (SUM or MEAN of the components, or component 0 for ONLY_FIRST_REPLICA).

        Returns:
            A ``jax.Array`` (replicated over the devices for a distributed variable).

        Raises:
            ValueError: reading a sync-on-read variable with aggregation NONE in cross-replica
                context.

        Example:
            >>> import jaxmirror
            >>> jaxmirror.Variable([1.0, 2.0]).read_value().tolist()
            [1.0, 2.0]
        """
        slot = self._slot()
        if slot is None:
            state.settle(self)
            return self._eager_read()
        if slot.updating or context.current().replica_context is not None:
            return slot.value
        return self._traced_cross_read(slot)

    def _eager_read(self):
        return self._state

    def _traced_cross_read(self, slot):
        return slot.value

    # -- writes ---------------------------------------------------------------------------------
    def assign(self, value, use_locking=None, name=None, read_value=True):
        """Set the variable to ``value`` (by the aggregation rules in a replica context).

        Args:
            value: the new value: same shape; a dtype castable to the variable's.
            use_locking: ignored (TF compatibility).
            name: ignored (TF compatibility).
            read_value: return the variable when True, ``None`` otherwise.

        Returns:
            The variable, or ``None``.

        Raises:
            ValueError: for a shape mismatch, a Python constant assigned with SUM aggregation in
                a replica context, or a per-replica value in cross-replica context.

        Example:
            >>> import jaxmirror
            >>> v = jaxmirror.Variable(1.0)
            >>> float(v.assign(5.0).numpy())
            5.0
        """
        return self._write("assign", value, read_value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        """Add ``delta`` to the variable (``old + aggregate(delta)`` in a replica context).

        Args:
            delta: the amount to add.
            use_locking: ignored (TF compatibility).
            name: ignored (TF compatibility).
            read_value: return the variable when True, ``None`` otherwise.

        Returns:
            The variable, or ``None``.

        Raises:
            ValueError: as ``assign``; also for a SUM sync-on-read variable in cross-replica
                context.

        Example:
            >>> import jaxmirror
            >>> v = jaxmirror.Variable(1.0)
            >>> float(v.assign_add(2.0).numpy())
            3.0
        """
        return self._write("assign_add", delta, read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        """Subtract ``delta`` from the variable (``old - aggregate(delta)`` in a replica context).

        Args:
            delta: the amount to subtract.
            use_locking: ignored (TF compatibility).
            name: ignored (TF compatibility).
            read_value: return the variable when True, ``None`` otherwise.

        Returns:
            The variable, or ``None``.

        Raises:
            ValueError: as ``assign_add``.

        Example:
            >>> import jaxmirror
            >>> v = jaxmirror.Variable(1.0)
            >>> float(v.assign_sub(0.25).numpy())
            0.75
        """
        return self._write("assign_sub", delta, read_value)

    def _write(self, method: str, value, read_value: bool):
        self.note_assignment(method)
        slot = self._slot()
        if slot is not None and _compat.current_trace() is not binding.current().trace:
            raise ValueError(
                f"Variable.{method}: {self._name!r} assigned inside a nested JAX transformation "
                f"(jax.jit, jax.grad, lax.scan/fori_loop/cond, ... within the step, or around an "
                f"update), where its traced value would escape; compute the new value there, "
                f"return it, and assign it in the step itself."
            )
        if slot is None:
            if _compat.is_tracer(value) or (isinstance(value, Variable) and value._slot()):
                raise ValueError(
                    f"Variable.{method}: {self._name!r} got a traced value outside `run`; "
                    f"variables are updated by `strategy.run` steps or eagerly, so inside your "
                    f"own jax.jit/grad/scan work on arrays and return them."
                )
            with state.lock:
                state.settle(self)
                self._held.set(self._eager_write(method, value))
        elif slot.updating:
            new = combine(method, slot.value, convert(self, value, method))
            slot.write(new, slot.mirrored and slot.update_mirrored)
        elif context.current().replica_context is not None:
            self._replica_write(slot, method, value)
        else:
            self._traced_cross_write(slot, method, value)
        return self if read_value else None

    def _eager_write(self, method: str, value):
        new = combine(method, self._state, owned_copy(convert(self, value, method)))
        if self._strategy is None:
            return jnp.asarray(new)
        return self._placement.store(new)

    def _check_writable(self, frame, method: str) -> None:
        if self._strategy is None and frame.num_replicas > 1:
            raise ValueError(
                f"Variable.{method}: {self._name!r} was created outside any strategy's scope, "
                f"so a step of {frame.strategy!r} can read it but not assign it; create it "
                f"inside `strategy.scope()`."
            )

    def _replica_write(self, slot, method: str, value):
        frame = binding.current()
        self._check_writable(frame, method)
        slot.write(combine(method, slot.value, convert(self, value, method)),
                   frame.num_replicas == 1)

    def _traced_cross_write(self, slot, method: str, value):
        self._check_writable(binding.current(), method)
        slot.write(combine(method, slot.value, convert(self, value, method)),
                   slot.mirrored or method == "assign")

    def _components_repr(self) -> list[str]:
        return display.component_reprs(self, lambda: self._components(report=False),
                                       self._num_replicas)

    def _components(self, report: bool = True) -> tuple:
        state.settle(self, report)
        return (self._state,)

    def __repr__(self) -> str:
        return self._components_repr()[0]

    def _repr_html_(self) -> str | None:
        # Jupyter's rich display: where the stored value lives, device by device.
        return rich_display.safe_html(self._html)

    def _html(self) -> str:
        state.settle(self, False)
        stored = self._state
        if isinstance(stored, PerReplica):
            headers, rows = ["replica", "device", "shape", "dtype", "values"], stored.display_rows()
        else:
            headers = ["device", "shape", "dtype", "values"]
            rows = rich_display.shard_rows(stored)
        title = (f"{type(self).__name__} '{self.name}' shape={self.shape} dtype={self.dtype} "
                 f"({self.synchronization.name}, aggregation {self.aggregation.name})")
        how = ("one component per replica" if isinstance(stored, PerReplica) else
               f"one value, a copy on each of {len(rows)} devices" if len(rows) > 1 else
               "one value on one device")
        return rich_display.table(title, headers, rows, [f"stored as {how}"])


# jnp functions, jax.jit and jax.grad take a variable as its value (as TF ops take tf.Variable).
_compat.register_array_like(Variable, Variable.read_value)


def state_from_components(var, values: list):
    """The state ``var`` holds when its components are ``values``.

    Args:
        var: the variable.
        values: one value for every component, or one value per replica, in replica order.

    Returns:
        The new state, placed like ``var``'s (copied where the caller may still hold it).
    """
    if var._strategy is not None and len(values) > 1:
        return var._placement.stack_components([np.asarray(x) for x in values])
    # A plain variable has one component: every round of an update wrote the same value.
    return var._placed(owned_copy(values[0]))
