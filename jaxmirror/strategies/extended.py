"""``StrategyExtended``: TF's additional APIs for distribution-aware code, and the placement."""

from __future__ import annotations

import contextlib

import jax

from jaxmirror.core import context, inflight
from jaxmirror.core import devices as devices_lib
from jaxmirror.core.placement import Placement
from jaxmirror.collectives.communication import CommunicationOptions
from jaxmirror.collectives.cross_device_ops import (
    SMALL_LEAF_BYTES, CrossDeviceOps, NcclAllReduce, checked_options)
from jaxmirror.step.replica_context import call_as_first_replica, call_in_merge
from jaxmirror.strategies import updates
from jaxmirror.variables import creation
from jaxmirror.variables.variable import Variable


class StrategyExtended:
    """Additional APIs for distribution-aware code (``tf.distribute.StrategyExtended``).

    Reach it as ``strategy.extended``. Besides TF's names it exposes the JAX objects behind the
    strategy: ``mesh`` (a 1-D ``jax.sharding.Mesh``), ``axis_name`` and the two shardings values
    take (``replicated_sharding`` for Mirrored values, ``replica_sharding`` for stacked
    PerReplica values).

    ``placement`` is the named interface the rest of jaxmirror uses: the devices, mesh and
    shardings, and how values are put on them (``core.placement.Placement``).

    Args:
        container_strategy: the ``Strategy`` this object extends.
        devices: the JAX devices that run one replica each, in replica order.
        parameter_devices: where variables live; by default on every compute device.
        distributed_variables: whether ``Variable(...)`` in the strategy's scope makes
            Mirrored/SyncOnRead variables (True) or plain variables (False, as TF's
            OneDeviceStrategy does).
        tasks: for a multi-worker cluster, each process's ``(job, task index)``, which name
            its devices (``/job:worker/replica:0/task:1/device:CPU:0``).
        cross_device_ops: the ``CrossDeviceOps`` every cross-replica sum goes through;
            ``None``: ``NcclAllReduce``, with one pack per dtype across processes (each
            collective costs milliseconds there); within one, each leaf of 64 KiB or more on
            its own (XLA merges them without a copy) and the smaller ones in one pack.
        communication_options: the ``CommunicationOptions`` each call's own options
            override (``CommunicationOptions()`` when ``None``).

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> s.extended.worker_devices
        ('/job:localhost/replica:0/task:0/device:CPU:0', '/job:localhost/replica:0/task:0/device:CPU:1')
        >>> dict(s.extended.mesh.shape)
        {'replica': 2}
    """

    def __init__(self, container_strategy, devices, parameter_devices=None,
                 distributed_variables: bool = True, tasks=None, cross_device_ops=None,
                 communication_options=None):
        self._container_strategy_ref = container_strategy
        self._placement = Placement(devices, parameter_devices, distributed_variables)
        self._tasks = tasks
        self._cross_device_ops = cross_device_ops or (
            NcclAllReduce(num_packs=1) if self._placement.multi_process
            else NcclAllReduce(num_packs=0, pack_leaves_under=SMALL_LEAF_BYTES))
        self._cross_device_ops.adopt(container_strategy, self._placement.devices)
        self._options = communication_options or CommunicationOptions()

    @property
    def cross_device_ops(self) -> CrossDeviceOps:
        """The ``CrossDeviceOps`` that compiles this strategy's cross-replica sums."""
        return self._cross_device_ops

    @property
    def communication_options(self) -> CommunicationOptions:
        """The strategy's default ``CommunicationOptions`` (a call's own override them)."""
        return self._options

    def options_for(self, options, method: str) -> CommunicationOptions:
        """The options a call uses: its ``options`` over the strategy's.

        Args:
            options: the call's ``CommunicationOptions``, or ``None``.
            method: the API name, for the error.

        Returns:
            ``CommunicationOptions``.

        Raises:
            ValueError: when ``options`` is neither.
        """
        return self._options.merge(checked_options(options, method))

    @property
    def variable_creator(self):
        """What ``Variable(...)`` in the strategy's scope calls instead of making a
        ``Variable``; ``None`` (the default) for strategies whose variables live on their
        devices. ``ParameterServerStrategy``'s makes variables stored on parameter servers."""
        return None

    @property
    def placement(self) -> Placement:
        """Where the strategy's values live and how they are put there (``Placement``)."""
        return self._placement

    @property
    def mesh(self):
        """The 1-D ``jax.sharding.Mesh`` (axis ``"replica"``) the programs run on."""
        return self._placement.mesh

    @property
    def axis_name(self) -> str:
        """The mesh axis name collectives run over, for hand-written ``jax.lax`` collectives."""
        return self._placement.axis_name

    @property
    def devices(self) -> tuple:
        """The JAX devices, one per replica, in replica order."""
        return self._placement.devices

    @property
    def replicated_sharding(self):
        """The sharding of Mirrored values: replicated over every replica's device."""
        return self._placement.replicated_sharding

    @property
    def replica_sharding(self):
        """The sharding of stacked PerReplica values: axis 0 split over the replicas."""
        return self._placement.replica_sharding

    @property
    def worker_devices(self) -> tuple:
        """TF-style names of the devices this worker runs replicas on."""
        return tuple(devices_lib.tf_name(d, self._tasks) for d in self._placement.devices
                     if d.process_index == jax.process_index())

    @property
    def parameter_devices(self) -> tuple:
        """TF-style names of the devices variables are placed on."""
        return tuple(devices_lib.tf_name(d, self._tasks)
                     for d in self._placement.parameter_devices)

    @property
    def experimental_require_static_shapes(self) -> bool:
        """False, as for TF's MirroredStrategy (every program is still compiled for static shapes)."""
        return False

    @property
    def should_checkpoint(self) -> bool:
        """Whether this worker should save checkpoints: True on the chief (the only worker
        of a one-machine strategy), as TF's ``extended.should_checkpoint``."""
        return jax.process_index() == 0

    @property
    def should_save_summary(self) -> bool:
        """Whether this worker should write summaries: True on the chief, as TF's."""
        return jax.process_index() == 0

    @property
    def should_init(self) -> bool:
        """Whether this worker should initialize variables: True, as TF's for every worker of
        a mirrored strategy."""
        return True

    def call_for_each_replica(self, fn, args=(), kwargs=None):
        """Run ``fn`` on every replica now (the same as ``strategy.run(fn, args, kwargs)``).

        Inside a ``merge_fn`` (as in TF) ``fn`` is traced once more in the step, in the replica
        context, on each replica's component of ``args``; its results reach the ``merge_fn`` as
        per-replica values. A ``fn`` that creates variables (not possible inside a step's trace)
        is first traced as a step until its first variable; that trace is abandoned and ``fn``
        runs again, eagerly, once, as replica 0 in the strategy's scope, as TF's merged
        variable creators make each variable once with the first replica's value. So the code
        before the first variable runs twice (values it stores outside ``fn`` in the abandoned
        trace are dead tracers; whether ``fn`` creates variables is only known by running it);
        with several replicas, the eager run's ``all_reduce``, ``all_gather`` and
        ``merge_call`` of arrays raise (replica 0 cannot see the other replicas' values), and
        ``fn`` may return only variables.

        Args:
            fn: the per-replica function.
            args: a tuple or list of positional arguments.
            kwargs: a dict of keyword arguments.

        Returns:
            The merged results, as ``Strategy.run`` returns them (the variables ``fn`` made).

        Raises:
            ValueError: when a ``fn`` that creates variables returns anything else.
            RuntimeError: when ``fn`` creates variables inside ``run``, or runs a collective
                (above) as replica 0 of several.

        Example:
            >>> import jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> r = s.extended.call_for_each_replica(
            ...     lambda: jaxmirror.get_replica_context().replica_id_in_sync_group)
            >>> [int(x) for x in s.experimental_local_results(r)]
            [0, 1]
            >>> v = s.extended.call_for_each_replica(lambda: jaxmirror.Variable(1.0))
            >>> type(v).__name__, [float(x) for x in s.experimental_local_results(v)]
            ('MirroredVariable', [1.0, 1.0])
        """
        strategy = self._container_strategy_ref
        entry = context.current()
        if entry.merging is not None and entry.merging.strategy is strategy:  # in its merge_fn
            return call_in_merge(entry.merging, fn, args, kwargs)
        try:
            return strategy.run(fn, args=args, kwargs=kwargs)
        except creation.CreatedInRun:
            if entry.in_run:  # inside a step's trace variables cannot be made
                raise
        return call_as_first_replica(strategy, fn, args, kwargs)  # TF: replica 0 creates them

    # -- variables and their locality (TF's StrategyExtended page) ------------------------
    def reduce_to(self, reduce_op, value, destinations, options=None):
        """Reduce ``value`` across replicas and place the result at ``destinations``.

        Cross-replica context only (eagerly, or inside a ``merge_call``'s ``merge_fn``). To
        all-reduce, pass the same value as ``value`` and ``destinations``. If ``destinations`` is
        a variable the result goes to its devices; the variable is not changed.

        Args:
            reduce_op: a ``ReduceOp`` (or its name), or ``VariableAggregation.SUM``/``MEAN``.
            value: a ``PerReplica``/Mirrored value, a variable, or an array.
            destinations: a variable, a distributed value, an array, or a device string.
            options: ``CommunicationOptions`` for this call (over the strategy's), or ``None``.

        Returns:
            The reduced value: replicated over the strategy's devices for a distributed
            destination, on one device for a device string.

        Raises:
            ValueError: for empty ``destinations``, a bad reduce op, or a non-distributed value
                with SUM on several replicas.
            RuntimeError: in a replica context.

        Example:
            >>> import jax.numpy as jnp, jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> with s.scope():
            ...     v = jaxmirror.Variable(0.0)
            >>> def step_fn(var):
            ...     def merge_fn(strategy, value, var):
            ...         reduced = strategy.extended.reduce_to("sum", value, destinations=var)
            ...         strategy.extended.update(var, lambda var, value: var.assign(value),
            ...                                  args=(reduced,))
            ...     jaxmirror.get_replica_context().merge_call(merge_fn, args=(jnp.asarray(1.0), var))
            >>> _ = s.run(step_fn, args=(v,))
            >>> v
            MirroredVariable:{
              0: <jaxmirror.Variable 'Variable:0' shape=() dtype=float32, numpy=2.0>,
              1: <jaxmirror.Variable 'Variable/replica_1:0' shape=() dtype=float32, numpy=2.0>
            }
        """
        return inflight.tracked(self._placement, updates.reduce_to(
            self._container_strategy_ref, reduce_op, value, destinations, options))

    def batch_reduce_to(self, reduce_op, value_destination_pairs, options=None):
        """``reduce_to`` for several ``(value, destinations)`` pairs at once.

        Args:
            reduce_op: a ``ReduceOp`` (or its name), or ``VariableAggregation.SUM``/``MEAN``.
            value_destination_pairs: a list of ``(value, destinations)`` pairs.
            options: ``CommunicationOptions`` for this call (over the strategy's), or ``None``.

        Returns:
            A list with one reduced value per pair (their sums made by one program).

        Raises:
            ValueError: when a pair is malformed, and as ``reduce_to``.
            RuntimeError: in a replica context.

        Example:
            >>> import jax.numpy as jnp, jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> with s.scope():
            ...     v = jaxmirror.Variable(0.0)
            >>> def step_fn(var):
            ...     def merge_fn(strategy, value, var):
            ...         reduced = strategy.extended.batch_reduce_to("sum", [(value, var)])[0]
            ...         strategy.extended.update(var, lambda var, value: var.assign(value),
            ...                                  args=(reduced,))
            ...     jaxmirror.get_replica_context().merge_call(merge_fn, args=(jnp.asarray(1.0), var))
            >>> _ = s.run(step_fn, args=(v,))
            >>> float(v.numpy())
            2.0
        """
        return inflight.tracked(self._placement, updates.batch_reduce_to(
            self._container_strategy_ref, reduce_op, value_destination_pairs, options))

    def broadcast_to(self, tensor, destinations):
        """Copy ``tensor`` to the devices of ``destinations`` (TF's ``broadcast_to``).

        Args:
            tensor: an array or a number.
            destinations: a variable, a distributed value, an array, or a device string.

        Returns:
            The array at ``destinations``: replicated over a distributed destination's
            devices, on one device for a device string.

        Raises:
            ValueError: for empty ``destinations``.

        Example:
            >>> import jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> x = s.extended.broadcast_to(3.0, "CPU:1")
            >>> float(x), [d.id for d in x.devices()]
            (3.0, [1])
        """
        return updates.broadcast_to(self._container_strategy_ref, tensor, destinations)

    def update(self, var, fn, args=(), kwargs=None, group=True):
        """Apply ``fn(component, *args, **kwargs)`` to every component of the variable ``var``.

        Inside ``fn`` assignments to ``var`` (and to variables passed in ``args``) write the
        component as given, with no aggregation. Mirrored arguments are unwrapped; a
        ``PerReplica`` argument gives each component its own value. In a replica context (inside
        ``run``) this goes through ``merge_call``, as in TF. Nothing is written unless ``fn``
        succeeds on every component.

        Args:
            var: the variable to update.
            fn: called as ``fn(var, *args, **kwargs)``; typically ``lambda v, x: v.assign(x)``.
            args: a tuple or list of extra positional arguments.
            kwargs: a dict of extra keyword arguments.
            group: return the merged result (True) or a tuple of per-replica results (False).

        Returns:
            ``fn``'s result merged across replicas: ``Mirrored`` when it is the same on every
            replica, ``PerReplica`` otherwise (plain with one replica). Variables in the result
            are replaced by their values.

        Raises:
            ValueError: when ``var`` is not a variable of this strategy, or ``args``/``kwargs``
                are malformed.

        Example:
            >>> import jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> with s.scope():
            ...     v = jaxmirror.Variable(5.0, aggregation=jaxmirror.VariableAggregation.SUM)
            >>> def update_fn(v):
            ...     return v.assign(1.0)
            >>> s.extended.update(v, update_fn)
            Mirrored:{
              0: Array(1., dtype=float32),
              1: Array(1., dtype=float32)
            }
        """
        return updates.update(self._container_strategy_ref, var, fn, args, kwargs, group)

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable):
        """Create variables on the same devices as ``colocate_with_variable`` (inside ``scope()``).

        Variables of a mirrored strategy all live on every replica's device, so this checks
        its argument and changes nothing; code written for TF runs unchanged.

        Args:
            colocate_with_variable: a variable created in this strategy's scope.

        Returns:
            A context manager.

        Raises:
            ValueError: when the variable was not created in this strategy's scope.
            RuntimeError: outside this strategy's scope.

        Example:
            >>> import jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> with s.scope():
            ...     var1 = jaxmirror.Variable(1.0)
            ...     with s.extended.colocate_vars_with(var1):
            ...         var2 = jaxmirror.Variable(2.0)
            ...         var3 = jaxmirror.Variable(3.0)
            >>> def fn(v1, v2, v3):
            ...     return v1.assign(v2 + v3)
            >>> _ = s.extended.update(var1, fn, args=(var2, var3))
            >>> float(var1.numpy())
            5.0
        """
        strategy = self._container_strategy_ref
        entry = context.current()
        if entry.strategy is not strategy or entry.replica_context is not None:
            raise RuntimeError("colocate_vars_with: may only be used inside this strategy's "
                               "`scope()` (cross-replica context); enter `with "
                               "strategy.scope():` first.")
        if not self.variable_created_in_scope(colocate_with_variable):
            raise ValueError(f"colocate_vars_with: `colocate_with_variable` must be a variable "
                             f"created in this strategy's scope; got {colocate_with_variable!r}; "
                             f"pass one of its variables.")
        yield

    def value_container(self, value):
        """The container ``value`` belongs to: a variable is its own container.

        Args:
            value: a value returned by ``run``, or a variable created in ``scope()``.

        Returns:
            The distributed variable or value holding ``value``; ``value`` itself when it
            belongs to none (arrays from ``run`` are their own containers in jaxmirror).

        Example:
            >>> import jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> with s.scope():
            ...     v = jaxmirror.Variable(1.0)
            >>> s.extended.value_container(v) is v
            True
        """
        return value

    def variable_created_in_scope(self, v) -> bool:
        """Whether the variable ``v`` was created while this strategy's scope was active.

        Args:
            v: a ``jaxmirror.Variable``.

        Returns:
            True for variables made inside ``scope()``, False otherwise.

        Raises:
            ValueError: when ``v`` is not a variable.

        Example:
            >>> import jaxmirror
            >>> strategy = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> with strategy.scope():
            ...     v = jaxmirror.Variable(1.)
            >>> strategy.extended.variable_created_in_scope(v)
            True
            >>> strategy.extended.variable_created_in_scope(jaxmirror.Variable(1.))
            False
        """
        if not isinstance(v, Variable):
            raise ValueError(f"variable_created_in_scope: `v` must be a jaxmirror Variable; got "
                             f"{type(v).__name__}.")
        # A variable made outside every scope is owned by the default strategy.
        return v.distribute_strategy is self._container_strategy_ref
