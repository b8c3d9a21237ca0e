"""``Variable``: a stateful box around one ``jax.Array`` (``tf.Variable``), and pytrees of them.

A plain variable's array lives on one device; inside a strategy's scope ``Variable(...)`` makes a
``MirroredVariable`` or ``SyncOnReadVariable`` (``distributed_variables.py``). Where a read or a
write happens decides what it does (SEMANTICS.md "Variables"):

* inside ``run``'s step, in replica context: ``binding`` gives the variable a traced value;
  writes follow the replica rules (``_replica_write``);
* inside a ``merge_call``'s ``merge_fn`` (cross-replica context in the step): ``_traced_cross_*``;
* outside ``run``: ``_eager_*``, on the stored array;
* inside ``extended.update``'s function: components are read and written as they are.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmirror import _compat, binding, context
from jaxmirror.reduce_op import (
    VariableAggregation,
    VariableSynchronization,
    as_aggregation,
    as_synchronization,
)
from jaxmirror.values import DistributedValues, Mirrored, PerReplica, components

Agg = VariableAggregation
Sync = VariableSynchronization


class Variable:
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
    ``jnp.asarray(v)`` and ``np.asarray(v)``; pass ``v.value()`` to other ``jnp`` functions.
    Variables are not pytrees: ``jax.tree`` treats them as leaves (see ``read_values`` /
    ``assign_values`` for pytrees of them). Inside a step, read variables anywhere, but assign
    them in the step itself, not inside a nested ``jax.jit``, ``jax.grad`` or ``lax`` control
    flow body (compute the value there and assign it after); a step that uses variables cannot
    itself be called inside ``jax.jit``.

    Args:
        initial_value: an array, a Python number, or a callable returning one.
        trainable: whether gradient-based training should update it; ``None`` means True,
            except for ON_READ variables (which must not be trainable).
        synchronization: a ``VariableSynchronization`` or its name.
        aggregation: a ``VariableAggregation`` or its name.
        dtype: the dtype; by default the initial value's.
        name: the variable's name (default ``"Variable"``).

    Raises:
        ValueError: for a missing initial value, an unknown synchronization or aggregation,
            ``trainable=True`` with ON_READ, or ``synchronization=NONE`` inside a scope.
        RuntimeError: when created inside ``run`` (create variables before the step).

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

    __array_priority__ = 100  # NumPy defers to our operators

    def __new__(cls, initial_value=None, trainable=None, synchronization=Sync.AUTO,
                aggregation=Agg.NONE, dtype=None, name=None):
        if cls is not Variable:
            if initial_value is None:  # copy and pickle make the object first, then fill it
                return object.__new__(cls)
            raise TypeError(f"Create variables with jaxmirror.Variable(...): inside a strategy's "
                            f"scope it is a {cls.__name__} when the synchronization says so.")
        sync = as_synchronization(synchronization)
        entry = context.current()
        strategy = entry.strategy if entry.strategy is not context.default_strategy() else None
        if strategy is None:
            return object.__new__(Variable)
        return object.__new__(strategy.extended._variable_class(sync))

    def __init__(self, initial_value=None, trainable=None, synchronization=Sync.AUTO,
                 aggregation=Agg.NONE, dtype=None, name=None):
        sync = as_synchronization(synchronization)
        agg = as_aggregation(aggregation)
        name = "Variable" if name is None else str(name)
        if trainable is None:
            trainable = sync is not Sync.ON_READ
        elif trainable and sync is Sync.ON_READ:
            raise ValueError(
                "Synchronization value can be set to VariableSynchronization.ON_READ only for "
                f"non-trainable variables. You have specified trainable=True and "
                f"synchronization=VariableSynchronization.ON_READ (variable {name!r})."
            )
        entry = context.current()
        if entry.in_run:
            raise RuntimeError(
                f"jaxmirror.Variable {name!r} was created inside `run`. Create variables before "
                f"the step (inside `strategy.scope()`) and use them in it by argument or closure."
            )
        strategy = entry.strategy if entry.strategy is not context.default_strategy() else None
        if strategy is not None and sync is Sync.NONE:
            raise ValueError(
                f"`NONE` variable synchronization mode is not supported with {type(strategy).__name__}. "
                f"Please change the `synchronization` for variable: {name}"
            )
        if initial_value is None:
            raise ValueError(f"initial_value must be specified (variable {name!r}).")
        if callable(initial_value) and not isinstance(initial_value, (jax.Array, Variable)):
            initial_value = initial_value()
        value = _host_value(initial_value)
        if _compat.is_tracer(value):
            raise ValueError(f"initial_value of variable {name!r} is a traced value; create "
                             f"variables outside jax.jit and `run`.")
        value = jnp.asarray(value)
        # An explicit dtype: not weak. A copy: the variable owns its buffer (TF copies too), so
        # donating the initial array elsewhere cannot delete the variable's value.
        value = jnp.array(value, dtype=dtype or value.dtype, copy=True)
        self._strategy = strategy
        self._synchronization = sync
        self._aggregation = agg
        self._trainable = bool(trainable)
        self._name = name
        self._shape = tuple(value.shape)
        self._dtype = value.dtype
        if strategy is None:
            self._state = value
        else:
            self._state = strategy.extended._initial_state(value, on_read=sync is Sync.ON_READ)

    # -- properties -----------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The variable's name."""
        return self._name

    @property
    def shape(self) -> tuple:
        """The shape of the value (of each component)."""
        return self._shape

    @property
    def dtype(self):
        """The dtype of the value."""
        return self._dtype

    @property
    def trainable(self) -> bool:
        """Whether training should update this variable."""
        return self._trainable

    @property
    def synchronization(self) -> VariableSynchronization:
        """When the components are kept in step (ON_WRITE/AUTO, ON_READ, NONE)."""
        return self._synchronization

    @property
    def aggregation(self) -> VariableAggregation:
        """How replica-context assignments are combined."""
        return self._aggregation

    @property
    def distribute_strategy(self):
        """The strategy whose scope made this variable (the default strategy for a plain one)."""
        return self._strategy or context.default_strategy()

    # -- what the rules need ---------------------------------------------------------------------
    @property
    def _num_replicas(self) -> int:
        return self._strategy.num_replicas_in_sync if self._strategy is not None else 1

    @property
    def _is_stacked(self) -> bool:
        return isinstance(self._state, PerReplica)

    @property
    def _on_read(self) -> bool:
        return False

    def _check_usable_in(self, strategy) -> None:
        if self._strategy is not None and self._strategy is not strategy:
            raise ValueError(
                f"Variable {self._name!r} was created in the scope of another strategy object "
                f"({self._strategy!r} at {id(self._strategy):#x}); {strategy!r} at "
                f"{id(strategy):#x} cannot use it. Create it inside `strategy.scope()` of the "
                f"strategy that uses it."
            )

    def _slot(self):
        frame = binding.current()
        return None if frame is None else frame.lookup(self)

    def _convert(self, value, method: str):
        """``value`` checked and cast for this variable (TF's shape and dtype rules)."""
        if isinstance(value, Variable):
            value = value.read_value()
        elif isinstance(value, Mirrored):
            value = value.value
        elif isinstance(value, DistributedValues):
            raise ValueError(
                f"Variable {self._name!r}: `{method}` got a {type(value).__name__} value. In "
                f"cross-replica context a {type(self).__name__} can only be assigned a single "
                f"value or a Mirrored one; reduce per-replica values first "
                f"(strategy.extended.reduce_to or strategy.reduce)."
            )
        x = value if isinstance(value, jax.Array) or _compat.is_tracer(value) else np.asarray(value)
        if tuple(x.shape) != self._shape:
            raise ValueError(
                f"Cannot {method} value to variable {self._name!r}: Shape mismatch. The variable "
                f"shape {self._shape}, and the assigned value shape {tuple(x.shape)} are "
                f"incompatible."
            )
        src = jnp.dtype(x.dtype)
        weak = not isinstance(value, (jax.Array, np.ndarray, np.generic)) and not _compat.is_tracer(value)
        if src != self._dtype and not weak and not np.can_cast(src, self._dtype, "same_kind"):
            raise TypeError(f"Cannot {method} a {src} value to variable {self._name!r} of dtype "
                            f"{self._dtype}.")
        # A strong dtype: a weakly typed new value would change the step's signature.
        return lax.convert_element_type(x, self._dtype)

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
            return self._eager_read()
        if slot.updating or context.current().replica_context is not None:
            return slot.value
        return self._traced_cross_read(slot)

    def value(self):
        """The variable's value; the same as ``read_value()``.

        Returns:
            A ``jax.Array``.

        Example:
            >>> import jaxmirror
            >>> float(jaxmirror.Variable(3.0).value())
            3.0
        """
        return self.read_value()

    def numpy(self):
        """The value as a NumPy array (cross-replica context).

        Returns:
            A ``numpy.ndarray``.

        Example:
            >>> import jaxmirror
            >>> jaxmirror.Variable([1, 2]).numpy()
            array([1, 2], dtype=int32)
        """
        return np.asarray(self.read_value())

    def _eager_read(self):
        return self._state

    def _view(self):
        """This variable as ``reduce``/``gather``/local results see it: its value."""
        return self.read_value()

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
        slot = self._slot()
        if slot is not None and _compat.current_trace() is not binding.current().trace:
            raise ValueError(
                f"Variable {self._name!r}: `{method}` inside a nested JAX transformation "
                f"(jax.jit, jax.grad, lax.scan/fori_loop/cond, ... within the step, or around an "
                f"update) is not supported: its traced value would escape. Compute the new value "
                f"there, return it, and assign it in the step itself."
            )
        if slot is None:
            if _compat.is_tracer(value) or (isinstance(value, Variable) and value._slot()):
                raise ValueError(
                    f"Variable {self._name!r}: `{method}` got a traced value outside `run`. "
                    f"Variables are updated by `strategy.run` steps or eagerly; inside your own "
                    f"jax.jit/grad/scan, work on arrays and return them."
                )
            self._state = self._eager_write(method, value)
        elif slot.updating:
            new = _combine(method, slot.value, self._convert(value, method))
            slot.write(new, slot.mirrored and slot.update_mirrored)
        elif context.current().replica_context is not None:
            self._replica_write(slot, method, value)
        else:
            self._traced_cross_write(slot, method, value)
        return self if read_value else None

    def _eager_write(self, method: str, value):
        new = _combine(method, self._state, _owned(self._convert(value, method)))
        if self._strategy is None:
            return jnp.asarray(new)
        return self._strategy.extended._replicate(new)

    def _check_writable(self, frame, method: str) -> None:
        if self._strategy is None and frame.num_replicas > 1:
            raise ValueError(
                f"Variable {self._name!r} was created outside any strategy's scope: a step of "
                f"{frame.strategy!r} can read it but not `{method}` it. Create it inside "
                f"`strategy.scope()`."
            )

    def _replica_write(self, slot, method: str, value):
        frame = binding.current()
        self._check_writable(frame, method)
        slot.write(_combine(method, slot.value, self._convert(value, method)),
                   frame.num_replicas == 1)

    def _traced_cross_write(self, slot, method: str, value):
        self._check_writable(binding.current(), method)
        slot.write(_combine(method, slot.value, self._convert(value, method)),
                   slot.mirrored or method == "assign")

    # -- Python protocol ------------------------------------------------------------------------
    def __jax_array__(self):
        return self.read_value()

    def __array__(self, dtype=None, copy=None):
        out = np.asarray(self.read_value())
        return out if dtype is None else out.astype(dtype)

    def __float__(self):
        return float(self.read_value())

    def __int__(self):
        return int(self.read_value())

    def __bool__(self):
        return bool(self.read_value())

    def __getitem__(self, index):
        return self.read_value()[index]

    def __iter__(self):
        return iter(self.read_value())

    def __len__(self):
        if not self._shape:
            raise TypeError("len() of a 0-d variable")
        return self._shape[0]

    def _components_repr(self) -> list[str]:
        try:
            comps = [np.asarray(c) for c in self._components()]
        except Exception:  # traced, or not addressable from this process
            comps = [None] * self._num_replicas
        names = [f"{self._name}:0"] + [f"{self._name}/replica_{i}:0" for i in range(1, len(comps))]
        # As TF prints them: numpy=2.0 for a scalar, numpy=array([...], dtype=...) otherwise.
        text = [repr(c.item()) if c is not None and c.ndim == 0 else repr(c) for c in comps]
        return [f"<jaxmirror.Variable '{n}' shape={self._shape} dtype={self._dtype}, numpy={t}>"
                for n, t in zip(names, text)]

    def _components(self) -> tuple:
        return (self._state,)

    def __repr__(self) -> str:
        return self._components_repr()[0]


def _owned(x):
    """``x``, or a copy of it when it is an array someone else may hold (and donate)."""
    return x.copy() if isinstance(x, jax.Array) and not _compat.is_tracer(x) else x


def _combine(method: str, old, value):
    """The variable's new value after ``method`` (assign, assign_add, assign_sub) of ``value``."""
    if method == "assign":
        return value
    return old + value if method == "assign_add" else old - value


def _host_value(x):
    if isinstance(x, Variable):
        return x.read_value()
    if isinstance(x, PerReplica):
        return components(x.stacked)[0]  # every component starts from replica 0's value
    if isinstance(x, Mirrored):
        return x.value
    return x


def _unwrap(x):
    return x.read_value() if isinstance(x, Variable) else x


def _binary(op):
    return lambda self, other: op(self.read_value(), _unwrap(other))


def _reflected(op):
    return lambda self, other: op(_unwrap(other), self.read_value())


for _name, _op in [("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
                   ("truediv", operator.truediv), ("floordiv", operator.floordiv),
                   ("mod", operator.mod), ("pow", operator.pow), ("matmul", operator.matmul),
                   ("and", operator.and_), ("or", operator.or_), ("xor", operator.xor)]:
    setattr(Variable, f"__{_name}__", _binary(_op))
    setattr(Variable, f"__r{_name}__", _reflected(_op))
for _name, _op in [("lt", operator.lt), ("le", operator.le), ("gt", operator.gt),
                   ("ge", operator.ge)]:
    setattr(Variable, f"__{_name}__", _binary(_op))
for _name, _op in [("neg", operator.neg), ("pos", operator.pos), ("abs", operator.abs),
                   ("invert", operator.invert)]:
    setattr(Variable, f"__{_name}__", (lambda op: lambda self: op(self.read_value()))(_op))

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
    return jax.tree.map(_unwrap, tree)


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
        if isinstance(target, Variable):
            target.assign(new)
            return target
        return new

    return jax.tree.map(assign, tree, new_values)


def is_variable(x) -> bool:
    return isinstance(x, Variable)


__all__ = ["Variable", "assign_values", "read_values"]
