"""``Placement``: a strategy's devices, mesh and shardings, and how it puts values on them.

Every layer that places arrays for a strategy (variables, the compiled step, the input
pipeline, reduce and gather) asks the strategy's placement, ``strategy.extended.placement``:
one object, made once per strategy, with no behaviour of its own beyond ``jax.device_put``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmirror.core import _compat, across_processes, inflight
from jaxmirror.core._compat import NamedSharding, P
from jaxmirror.core.values import PerReplica

AXIS_NAME = "replica"


class Placement:
    """Where a strategy's values live, and how they are put there.

    Attributes are plain values fixed at construction: ``devices`` (one per replica, in replica
    order), ``parameter_devices``, ``distributed_variables``, ``axis_name``, ``mesh`` (1-D),
    ``device_set``, ``num_replicas``, ``num_local_replicas`` (this process's),
    ``replicated_sharding`` (Mirrored values), ``mirrored_sharding`` (where ``replicate`` puts a
    value: ``replicated_sharding``, or the one device of a one-replica strategy),
    ``replica_sharding`` (stacked PerReplica values), ``bound_in_flight`` (whether steps
    queued on these devices must be bounded), ``multi_process`` (whether other processes
    hold some of the devices), ``central`` (variables live on one parameter device, not on
    the replicas' devices: central storage) and ``storage_sharding`` (where variables and
    mirrored parameters live between steps: the parameter device when ``central``, else
    ``mirrored_sharding``).

    Args:
        devices: the JAX devices that run one replica each, in replica order.
        parameter_devices: where variables live; by default on every compute device. One
            device other than the compute devices makes the placement ``central``.
        distributed_variables: whether ``Variable(...)`` in the strategy's scope makes
            Mirrored/SyncOnRead variables (True) or plain variables on the one device (False,
            as TF's OneDeviceStrategy does).

    Example:
        >>> import jax
        >>> placement = Placement(jax.devices()[:2])
        >>> placement.num_replicas, dict(placement.mesh.shape)
        (2, {'replica': 2})
        >>> placement.stack_copies(1.0).stacked.tolist()
        [1.0, 1.0]
    """

    __slots__ = ("devices", "parameter_devices", "distributed_variables", "axis_name", "mesh",
                 "device_set", "num_replicas", "num_local_replicas", "replicated_sharding",
                 "mirrored_sharding", "replica_sharding", "bound_in_flight", "multi_process",
                 "central", "storage_sharding", "_to_every_device", "__weakref__")

    def __init__(self, devices, parameter_devices=None, distributed_variables: bool = True):
        self.devices = tuple(devices)
        self.parameter_devices = tuple(parameter_devices or devices)
        self.distributed_variables = distributed_variables
        self.axis_name = AXIS_NAME
        self.mesh = _compat.make_mesh(self.devices, AXIS_NAME)
        self.device_set = frozenset(self.devices)
        self.num_replicas = len(self.devices)
        me = jax.process_index()
        self.num_local_replicas = sum(d.process_index == me for d in self.devices)
        self.replicated_sharding = NamedSharding(self.mesh, P())
        self.mirrored_sharding = (jax.sharding.SingleDeviceSharding(self.devices[0])
                                  if self.num_replicas == 1 else self.replicated_sharding)
        self.replica_sharding = NamedSharding(self.mesh, P(AXIS_NAME))
        self.bound_in_flight = inflight.needs_bound(self.devices)
        self.multi_process = self.num_local_replicas < self.num_replicas
        self.central = self.parameter_devices != self.devices
        self.storage_sharding = (jax.sharding.SingleDeviceSharding(self.parameter_devices[0])
                                 if self.central else self.mirrored_sharding)
        # One jitted identity: resharding across processes is a collective XLA compiles.
        self._to_every_device = jax.jit(lambda x: x, out_shardings=self.replicated_sharding)

    def replicate(self, value):
        """``value`` on every replica's device (one device: on it).

        Args:
            value: an array or a nest of arrays.

        Returns:
            The same, as ``jax.Array``s replicated over the mesh.
        """
        return self._put(value, self.mirrored_sharding)

    def _put(self, value, sharding):
        """``jax.device_put(value, sharding)``; across processes without ``device_put``'s own
        check, which is a collective (``core/across_processes.py``)."""
        if not self.multi_process:
            return jax.device_put(value, sharding)
        replicated = sharding == self.replicated_sharding
        reshard = self._to_every_device if replicated else (
            lambda x: jax.device_put(x, sharding))
        return across_processes.put(value, sharding, replicated, reshard)

    def store(self, value, owned: bool = False):
        """``value`` where variables and mirrored parameters live (``storage_sharding``).

        Args:
            value: an array or a nest of arrays.
            owned: give new buffers even where ``value`` already has one on a target device
                (``jax.device_put`` shares it, even with ``may_alias=False`` in JAX 0.10, so
                donating the result would delete the caller's array too).

        Returns:
            The same, on the parameter device (central storage) or as ``replicate`` puts it.
        """
        if owned:
            value = jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, value)
        return self._put(value, self.storage_sharding)

    def to_compute(self, tree):
        """``tree`` with the arrays stored on the parameter device copied to every replica.

        Central storage only: what a step reads from the parameter device, broadcast.

        Args:
            tree: a nest (distributed values are leaves; other leaves pass through).

        Returns:
            The same nest.
        """
        stored = self.storage_sharding.device_set
        return self._moved(tree, lambda s: s.device_set == stored, self.replicated_sharding)

    def to_storage(self, tree):
        """``tree`` with the arrays replicated over the replicas moved to the parameter device.

        Central storage only: a step's mirrored results (new parameters, variables' new
        values) go back to where they live; per-replica values stay.

        Args:
            tree: a nest.

        Returns:
            The same nest.
        """
        return self._moved(
            tree, lambda s: s.is_fully_replicated and s.device_set == self.device_set,
            self.storage_sharding)

    @staticmethod
    def _moved(tree, is_source, target):
        leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, PerReplica))
        chosen = [i for i, x in enumerate(leaves)
                  if isinstance(x, jax.Array) and not _compat.is_tracer(x)
                  and is_source(x.sharding)]
        if not chosen:
            return tree
        moved = jax.device_put([leaves[i] for i in chosen], target)  # one transfer call
        for i, x in zip(chosen, moved):
            leaves[i] = x
        return jax.tree.unflatten(treedef, leaves)

    def readable_everywhere(self, tree):
        """``tree`` with every array readable by every worker (replicated over the devices).

        With one process every array is readable as it is. Across processes a result sharded
        over the replicas would hold parts on other workers' devices, which this worker cannot
        fetch; such leaves are all-gathered onto every device (TF: ``reduce`` and ``gather``
        results are available on every worker).

        Args:
            tree: a nest of arrays (host values pass through).

        Returns:
            The same nest.
        """
        if not self.multi_process:
            return tree

        def leaf(x):
            if (isinstance(x, jax.Array) and not _compat.is_tracer(x)
                    and not x.is_fully_replicated):
                return self._to_every_device(x)
            return x

        return jax.tree.map(leaf, tree)

    def place_stacked(self, stacked):
        """A replica-stacked array (components along axis 0) placed one component per replica.

        Args:
            stacked: an array of shape ``(num_replicas, ...)``.

        Returns:
            The array, sharded along axis 0 over the replicas.
        """
        return self._put(stacked, self.replica_sharding)

    def stack_copies(self, value) -> PerReplica:
        """``num_replicas`` copies of ``value``, one per replica.

        Args:
            value: an array.

        Returns:
            A ``PerReplica`` whose every component is ``value``.
        """
        value = jnp.asarray(value)
        stacked = jnp.broadcast_to(value, (self.num_replicas,) + value.shape)
        return PerReplica(self.place_stacked(stacked))

    def stack_components(self, components: list) -> PerReplica:
        """Host components, one per replica, as a ``PerReplica`` placed replica by replica.

        Args:
            components: one array per replica, all of one shape and dtype.

        Returns:
            A ``PerReplica``.
        """
        return PerReplica(self.place_stacked(np.stack(components)))

    def __repr__(self) -> str:
        return f"Placement({self.num_replicas} replica(s) on {[str(d) for d in self.devices]})"
