"""``MirroredStrategy``: synchronous data parallelism over the devices of one machine."""

from __future__ import annotations

from jaxmirror.core import devices as devices_lib
from jaxmirror.collectives.cross_device_ops import CrossDeviceOps
from jaxmirror.strategies.extended import StrategyExtended
from jaxmirror.strategies.strategy import Strategy


class MirroredStrategy(Strategy):
    """Synchronous training across several devices on one machine (``tf.distribute.MirroredStrategy``).

    One replica per device; parameters are replicated on every device, each replica takes a
    slice of the global batch, and gradients are combined with all-reduce. The step is compiled
    once into one SPMD program (``jax.jit`` of ``jax.shard_map``) over a 1-D mesh.

    Args:
        devices: the devices to use: ``jax.Device`` objects or TF device strings ("GPU:0",
            "/gpu:1", "/device:CPU:0", ...). ``None`` takes every local GPU, or every local
            CPU device when there is no GPU.
        cross_device_ops: the ``CrossDeviceOps`` that compiles the cross-replica sums
            (``NcclAllReduce``, ``HierarchicalCopyAllReduce``, ``ReductionToOneDevice``);
            ``None`` takes ``NcclAllReduce(num_packs=0, pack_leaves_under=65536)``: an
            all-reduce per leaf of 64 KiB or more (XLA merges them without copying) and one
            for all smaller leaves together.

    Raises:
        ValueError: for an empty or duplicated device list, an unknown device, or a
            ``cross_device_ops`` that is not a ``CrossDeviceOps``.

    Example:
        >>> import jax.numpy as jnp, jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> s.num_replicas_in_sync
        2
        >>> float(s.run(lambda: jaxmirror.get_replica_context().all_reduce("sum", 1.0)))
        2.0
    """

    def __init__(self, devices=None, cross_device_ops=None):
        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise ValueError(f"MirroredStrategy: `cross_device_ops` must be a jaxmirror "
                             f"CrossDeviceOps or None; got {cross_device_ops!r}.")
        if devices is None:
            devs = devices_lib.default_local_devices()
        else:
            devs = devices_lib.resolve_all(devices, "MirroredStrategy", "devices")
        self._cross_device_ops = cross_device_ops
        super().__init__(StrategyExtended(self, devs, cross_device_ops=cross_device_ops))

    def _constructor_args(self) -> tuple:
        return (list(self.extended.devices), self._cross_device_ops)
