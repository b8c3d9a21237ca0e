"""``CrossDeviceOps``: how a strategy sums values across its replicas (TF's class family).

A strategy holds one (``MirroredStrategy(devices, cross_device_ops=...)``; ``NcclAllReduce``
by default), and every cross-replica sum it makes goes through it: ``all_reduce`` inside a step,
``reduce``/``reduce_to``/``batch_reduce_to`` (and ``reduce`` in a ``merge_fn``) outside. The
three implementations compile to different collectives (``collectives.algorithms``); packing
(``num_packs``, or ``CommunicationOptions.bytes_per_pack``) decides how many.

Outside a step, a sum is one cached program per strategy and options: ``jax.jit`` of
``shard_map`` over the replica-stacked components, so a whole nest costs one dispatch.
"""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp

from jaxmirror.core import _compat, context
from jaxmirror.core import devices as devices_lib
from jaxmirror.core.replicated import mark_gradient_replicated, mark_replicated
from jaxmirror.core.reduce_op import ReduceOp, as_float, as_reduce_op
from jaxmirror.collectives import algorithms, packing
from jaxmirror.collectives.communication import CommunicationOptions, non_negative_int


# Leaves under this many bytes share one all-reduce in a strategy's default ops in one process:
# 4 small leaves cost 4 rendezvous of every CPU device's thread per step (inside a fused scan,
# 840 against 289 µs a step on 8 CPU devices), and above about 64 KiB a leaf's copy into a pack
# costs more than its own collective (4 leaves of 256 KiB: 6.5 ms packed against 5.7 ms).
SMALL_LEAF_BYTES = 1 << 16


def checked_options(options, method: str) -> CommunicationOptions | None:
    """``options`` if it is ``None`` or a ``CommunicationOptions``; else a ``ValueError``."""
    if options is not None and not isinstance(options, CommunicationOptions):
        raise ValueError(f"{method}: `options` must be a jaxmirror.experimental."
                         f"CommunicationOptions or None; got {options!r}.")
    return options


class CrossDeviceOps:
    """Base class of cross-device reduction and broadcast algorithms (``tf.distribute.CrossDeviceOps``).

    Subclasses choose the collectives (``NcclAllReduce``, ``HierarchicalCopyAllReduce``,
    ``ReductionToOneDevice``). ``reduce``, ``batch_reduce`` and ``broadcast`` act for the
    strategy that uses this object: the current one when it does (inside its ``scope()``),
    else the one strategy that does.

    Args:
        num_packs: how many packs each dtype's leaves are concatenated and cut into before
            they are summed (one collective per pack); 0 sums every leaf on its own.
        pack_leaves_under: with ``num_packs=0``, leaves of fewer bytes than this share one
            pack per dtype (0: none do). A strategy given no ops sets it to
            ``SMALL_LEAF_BYTES`` in one process: on CPU devices every all-reduce operand is a
            rendezvous of all the devices' threads, and a few small leaves copy for nothing.

    Raises:
        ValueError: for a negative or non-integer ``num_packs`` or ``pack_leaves_under``.

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"],
        ...                                cross_device_ops=jaxmirror.NcclAllReduce())
        >>> isinstance(s.extended.cross_device_ops, jaxmirror.CrossDeviceOps)
        True
    """

    def __init__(self, num_packs: int = 1, *, pack_leaves_under: int = 0):
        self.num_packs = non_negative_int(num_packs, type(self).__name__, "num_packs")
        self.pack_leaves_under = non_negative_int(pack_leaves_under, type(self).__name__,
                                                  "pack_leaves_under")
        self._strategies = weakref.WeakSet()  # the strategies using these ops
        # placement -> {(count, bytes_per_pack, wire): program}; goes with the strategy
        self._programs = weakref.WeakKeyDictionary()

    # -- the algorithm ---------------------------------------------------------------------
    def sum_buffer(self, buf, axis_name, devices: tuple, wire):
        """The sum of every replica's flat ``buf`` (inside the program); subclasses choose how.

        Args:
            buf: this replica's 1-D buffer (padded to a multiple of ``pad_multiple``).
            axis_name: the replica axis.
            devices: the replicas' devices, in replica order.
            wire: the dtype sent, or ``None`` for the buffer's own.

        Returns:
            The sum, the same on every replica.
        """
        return algorithms.all_reduce(buf, axis_name, len(devices), wire)

    def pad_multiple(self, num_replicas: int, wire) -> int:
        """The multiple of elements ``sum_buffer`` needs a buffer padded to (1: none).

        Args:
            num_replicas: how many replicas.
            wire: the dtype sent, or ``None``.

        Returns:
            An int: ``num_replicas`` when a narrower wire reduce-scatters, else 1.
        """
        return num_replicas if wire is not None else 1

    def all_reduce_in_program(self, reduce_op, value, axis_name, devices: tuple,
                              options: CommunicationOptions | None = None):
        """``value`` (a nest) summed or averaged over the replicas, inside the step's program.

        Args:
            reduce_op: ``ReduceOp.SUM`` or ``ReduceOp.MEAN`` (or their names).
            value: a nest of arrays (this replica's).
            axis_name: the replica axis.
            devices: the replicas' devices, in replica order.
            options: ``CommunicationOptions`` (``bytes_per_pack``, ``wire_dtype``) or ``None``.

        Returns:
            The reduced nest, the same on every replica; an integer MEAN gives floats.

        Example:
            >>> import jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> ops = jaxmirror.HierarchicalCopyAllReduce()
            >>> def step():
            ...     ctx = jaxmirror.get_replica_context()
            ...     return ops.all_reduce_in_program("sum", ctx.replica_id_in_sync_group + 1.0,
            ...                                      s.extended.axis_name, s.extended.devices)
            >>> float(s.run(step))
            3.0
        """
        op = as_reduce_op(reduce_op)
        options = options or CommunicationOptions()
        leaves, tree = jax.tree.flatten(value)
        wire, n = options.wire_dtype, len(devices)
        # Integers of a MEAN over a narrow wire go as float32 on a wire of their own.
        exact = [op is ReduceOp.MEAN and wire is not None
                 and not jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in leaves]
        if op is ReduceOp.MEAN:
            leaves = [as_float(x) for x in leaves]
            if wire is not None:  # divided first, so that a mean that fits the wire fits it
                leaves = [x if e else x / n for x, e in zip(leaves, exact)]
        else:  # one rule for every ops: booleans add up as counts, as jnp.sum counts them
            leaves = [_counted(x) for x in leaves]
        # The gradient of a sum across replicas is a sum across replicas: replicated as well.
        leaves = [mark_gradient_replicated(x) for x in leaves]
        sums = [None] * len(leaves)
        for whole in (False, True):
            chosen = [i for i, e in enumerate(exact) if e is whole]
            if chosen:
                on = None if whole else wire
                part = packing.packed_apply(
                    [leaves[i] for i in chosen],
                    lambda b, on=on: self.sum_buffer(b, axis_name, devices, on),
                    self.num_packs, options.bytes_per_pack,
                    multiple_of=self.pad_multiple(n, on),
                    pack_leaves_under=self.pack_leaves_under)
                for i, x in zip(chosen, part):
                    sums[i] = x / n if op is ReduceOp.MEAN and (wire is None or whole) else x
        # Grouped and permuting collectives end replicated here; the analysis cannot see it.
        return jax.tree.unflatten(tree, [mark_replicated(x) for x in sums])

    def sum_components(self, stacked: list, placement, options=None) -> list:
        """The sums over the replicas of replica-stacked arrays, by one program (outside steps).

        Args:
            stacked: arrays of shape ``(num_replicas, ...)``, one component per replica,
                placed on ``placement``'s replicas.
            placement: the strategy's ``Placement``.
            options: ``CommunicationOptions`` or ``None``.

        Returns:
            One array per input: the sum of its components, replicated over the replicas.
        """
        options = options or CommunicationOptions()
        programs = self._programs.setdefault(placement, {})
        key = (len(stacked), options.bytes_per_pack, options.wire_dtype)
        program = programs.get(key)
        if program is None:
            devices, axis = placement.devices, placement.axis_name

            def body(*components):
                return tuple(self.all_reduce_in_program(
                    ReduceOp.SUM, [c[0] for c in components], axis, devices, options))

            program = programs[key] = jax.jit(_compat.shard_map(
                body, placement.mesh, (_compat.P(axis),) * len(stacked), _compat.P()))
        return list(program(*[placement.place_stacked(x) if _needs_placing(x, placement)
                              else x for x in stacked]))

    # -- TF's methods ------------------------------------------------------------------------
    def adopt(self, strategy, devices: tuple) -> None:
        """Act for ``strategy`` from now on (a strategy calls this when it is given the object).

        Args:
            strategy: the strategy that uses these ops.
            devices: its replicas' devices, in replica order.

        Raises:
            ValueError: when these ops cannot run on ``devices``.
        """
        self._strategies.add(strategy)

    def _strategy(self, method: str):
        current = context.current().strategy
        if getattr(current.extended, "cross_device_ops", None) is self:
            return current
        strategies = list(self._strategies)
        if len(strategies) == 1:
            return strategies[0]
        if not strategies:
            raise ValueError(f"{type(self).__name__}.{method}: no strategy uses this "
                             f"CrossDeviceOps; pass it to MirroredStrategy(devices, "
                             f"cross_device_ops=...) first.")
        raise ValueError(f"{type(self).__name__}.{method}: {len(strategies)} strategies use "
                         f"this CrossDeviceOps, so it cannot tell whose values these are; "
                         f"call it inside `strategy.scope()` of the one they belong to, or "
                         f"use that strategy's extended.reduce_to / batch_reduce_to / "
                         f"broadcast_to.")

    def reduce(self, reduce_op, per_replica_value, destinations, options=None):
        """Reduce ``per_replica_value`` across replicas and place the result at ``destinations``.

        Args:
            reduce_op: ``ReduceOp.SUM``/``MEAN`` (or their names).
            per_replica_value: a ``PerReplica``/Mirrored value, a variable, or an array.
            destinations: a variable, a distributed value, an array or a device string.
            options: ``CommunicationOptions`` for this call, or ``None``.

        Returns:
            The reduced value at ``destinations`` (as ``extended.reduce_to``).

        Raises:
            ValueError: for empty ``destinations`` or when no strategy uses these ops.

        Example:
            >>> import jaxmirror
            >>> ops = jaxmirror.ReductionToOneDevice()
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"], cross_device_ops=ops)
            >>> ids = s.run(lambda: jaxmirror.get_replica_context().replica_id_in_sync_group + 1)
            >>> int(ops.reduce("sum", ids, destinations="CPU:0"))
            3
        """
        return self._strategy("reduce").extended.reduce_to(reduce_op, per_replica_value,
                                                             destinations, options)

    def batch_reduce(self, reduce_op, value_destination_pairs, options=None):
        """``reduce`` for several ``(value, destinations)`` pairs, summed by one program.

        Args:
            reduce_op: ``ReduceOp.SUM``/``MEAN`` (or their names).
            value_destination_pairs: a list of ``(value, destinations)`` pairs.
            options: ``CommunicationOptions`` for this call, or ``None``.

        Returns:
            A list with one reduced value per pair.

        Example:
            >>> import jaxmirror
            >>> ops = jaxmirror.NcclAllReduce()
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"], cross_device_ops=ops)
            >>> x = s.run(lambda: jaxmirror.get_replica_context().replica_id_in_sync_group + 1.0)
            >>> [float(v) for v in ops.batch_reduce("mean", [(x, "CPU:0"), (x, "CPU:1")])]
            [1.5, 1.5]
        """
        return self._strategy("batch_reduce").extended.batch_reduce_to(
            reduce_op, value_destination_pairs, options)

    def broadcast(self, tensor, destinations):
        """``tensor`` copied to every device of ``destinations``.

        Args:
            tensor: an array.
            destinations: a variable, a distributed value, an array or a device string.

        Returns:
            The array placed at ``destinations`` (replicated over a distributed destination).

        Example:
            >>> import jax.numpy as jnp, jaxmirror
            >>> ops = jaxmirror.NcclAllReduce()
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"], cross_device_ops=ops)
            >>> with s.scope():
            ...     v = jaxmirror.Variable(0.0)
            >>> len(ops.broadcast(jnp.float32(4.0), v).sharding.device_set)
            2
        """
        return self._strategy("broadcast").extended.broadcast_to(tensor, destinations)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items()
                           if not k.startswith("_") and (k != "pack_leaves_under" or v))
        return f"{type(self).__name__}({fields})"


def _counted(x):
    x = jnp.asarray(x)
    return x.astype(jnp.int32) if x.dtype == jnp.bool_ else x


def _needs_placing(x, placement) -> bool:
    if _compat.is_tracer(x):  # under jax.grad or jax.jit around reduce: JAX places it
        return False
    return not (isinstance(x, jax.Array) and x.sharding == placement.replica_sharding)


class NcclAllReduce(CrossDeviceOps):
    """All-reduce per pack (``tf.distribute.NcclAllReduce``): XLA's all-reduce, NCCL's on GPUs.

    What a mirrored strategy uses when given none: with ``num_packs=0`` within one process
    (XLA's own combiner then merges the per-leaf all-reduces without copying: a concatenated
    pack cost 3x that for a 10M-float gradient tree of 200 leaves on 8 CPU devices), with
    ``num_packs=1`` across processes (gloo pays per operand). Each dtype's leaves are
    concatenated and cut into ``num_packs`` packs, one all-reduce each.

    Args:
        num_packs: packs per dtype; 0 all-reduces every leaf on its own.

    Raises:
        ValueError: for a negative ``num_packs``.

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"],
        ...                                cross_device_ops=jaxmirror.NcclAllReduce(num_packs=2))
        >>> float(s.run(lambda: jaxmirror.get_replica_context().all_reduce("sum", 1.0)))
        2.0
    """


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """Two-level all-reduce (``tf.distribute.HierarchicalCopyAllReduce``).

    The replicas form two groups (``n / 2`` each, for even ``n >= 4``; else the groups are
    single replicas). Each pack is reduce-scattered within each group (every member gathers the
    group's sum of one slice, so each member leads a slice), all-reduced across the groups, and
    all-gathered back within each group.

    Args:
        num_packs: packs per dtype; 0 sums every leaf on its own.

    Raises:
        ValueError: for a negative ``num_packs``.

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"],
        ...                                cross_device_ops=jaxmirror.HierarchicalCopyAllReduce())
        >>> float(s.run(lambda: jaxmirror.get_replica_context().all_reduce("sum", 1.0)))
        4.0
    """

    def sum_buffer(self, buf, axis_name, devices: tuple, wire):
        return algorithms.hierarchical(buf, axis_name, len(devices), wire)

    def pad_multiple(self, num_replicas: int, wire) -> int:
        return num_replicas  # reduce-scatters within the groups


class ReductionToOneDevice(CrossDeviceOps):
    """Reduce on one device, then broadcast (``tf.distribute.ReductionToOneDevice``).

    Every replica's value is sent to one replica's device (collective-permutes), accumulated
    there by ``accumulation_fn``, and sent back along a doubling tree. Each dtype's leaves go
    as one pack (``CommunicationOptions.bytes_per_pack`` cuts it into several).

    Args:
        reduce_to_device: the device that accumulates: one of the strategy's devices, as a
            ``jax.Device`` or a TF device string; ``None`` takes the first replica's.
        accumulation_fn: called on that device with the list of every replica's buffer (in
            replica order, all of one shape) and returns their combination; ``None`` adds
            them in order (TF's ``add_n``).

    Raises:
        ValueError: for a ``reduce_to_device`` that names no device, or an
            ``accumulation_fn`` that is not callable.

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"],
        ...     cross_device_ops=jaxmirror.ReductionToOneDevice(reduce_to_device="CPU:1"))
        >>> float(s.run(lambda: jaxmirror.get_replica_context().all_reduce("sum", 1.0)))
        2.0
    """

    def __init__(self, reduce_to_device=None, accumulation_fn=None):
        super().__init__(num_packs=1)
        if reduce_to_device is not None:
            devices_lib.resolve(reduce_to_device, "ReductionToOneDevice", "reduce_to_device")
        if accumulation_fn is not None and not callable(accumulation_fn):
            raise ValueError(f"ReductionToOneDevice: `accumulation_fn` must be callable or "
                             f"None; got {accumulation_fn!r}.")
        self.reduce_to_device = reduce_to_device
        self.accumulation_fn = accumulation_fn
        self._targets: dict = {}

    def adopt(self, strategy, devices: tuple) -> None:
        self.target_replica(tuple(devices))  # a device outside the strategy: say so now
        super().adopt(strategy, devices)

    def target_replica(self, devices: tuple) -> int:
        """Which replica of a strategy with ``devices`` accumulates.

        Args:
            devices: the strategy's devices, in replica order.

        Returns:
            The replica index.

        Raises:
            ValueError: when ``reduce_to_device`` is not among ``devices``.
        """
        if self.reduce_to_device is None:
            return 0
        target = self._targets.get(devices)
        if target is None:
            device = devices_lib.resolve(self.reduce_to_device, "ReductionToOneDevice",
                                         "reduce_to_device")
            if device not in devices:
                raise ValueError(
                    f"ReductionToOneDevice: `reduce_to_device` {self.reduce_to_device!r} is "
                    f"{device}, which runs no replica of this strategy ({list(devices)}); "
                    f"the sum is accumulated inside the replicas' program, so name one of "
                    f"their devices, or None for the first.")
            target = self._targets[devices] = devices.index(device)
        return target

    def pad_multiple(self, num_replicas: int, wire) -> int:
        return 1  # whole buffers are sent

    def sum_buffer(self, buf, axis_name, devices: tuple, wire):
        return algorithms.to_one_device(buf, axis_name, len(devices),
                                        self.target_replica(tuple(devices)),
                                        self.accumulation_fn, wire)
