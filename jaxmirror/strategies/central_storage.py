"""``CentralStorageStrategy``: variables kept once on a parameter device, compute mirrored."""

from __future__ import annotations

import jax

from jaxmirror.core import devices as devices_lib
from jaxmirror.strategies.extended import StrategyExtended
from jaxmirror.strategies.strategy import Strategy

_API = "CentralStorageStrategy"


class CentralStorageStrategy(Strategy):
    """Synchronous training with variables on one device (``tf.distribute.experimental.CentralStorageStrategy``).

    Variables, and parameters placed with ``experimental_replicate``/``init``, live once on
    the parameter device. Each step copies them to every compute device (one replica per
    device, as ``MirroredStrategy``), the replicas' results are combined in the step's program
    (gradients all-reduced, assignments aggregated), and the mirrored results (new
    parameters, variables' new values) go back to the parameter device: one copy between
    steps, at the cost of a broadcast and a copy back per step. With several replicas,
    ``Variable(...)`` in its scope makes an ``AggregatingVariable`` (a replica-context
    assignment needs an aggregation); with one compute device the variables are plain, as
    TF's are.

    Args:
        compute_devices: the devices that run replicas (``jax.Device`` objects or TF device
            strings); ``None`` takes every local GPU, or every local CPU device.
        parameter_device: where variables live; ``None`` takes the compute device when there
            is one, else the host CPU (``/device:CPU:0``), as TF.

    Raises:
        ValueError: for an empty or duplicated device list, or a device that is not here.

    Example:
        >>> import jaxmirror
        >>> s = jaxmirror.experimental.CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:2")
        >>> s.extended.parameter_devices
        ('/job:localhost/replica:0/task:0/device:CPU:2',)
        >>> with s.scope():
        ...     v = jaxmirror.Variable(1.0, aggregation="mean")
        >>> [d.id for d in v.read_value().devices()]
        [2]
    """

    def __init__(self, compute_devices=None, parameter_device=None):
        if compute_devices is None:
            compute = devices_lib.default_local_devices()
        else:
            compute = devices_lib.resolve_all(compute_devices, _API, "compute_devices")
        if parameter_device is None:
            parameter = compute[0] if len(compute) == 1 else jax.local_devices(backend="cpu")[0]
        else:
            parameter = devices_lib.resolve(parameter_device, _API, "parameter_device")
        self._parameter_device = parameter
        super().__init__(StrategyExtended(self, compute, parameter_devices=[parameter],
                                          distributed_variables=len(compute) > 1))

    def _constructor_args(self) -> tuple:
        return (list(self.extended.devices), self._parameter_device)
