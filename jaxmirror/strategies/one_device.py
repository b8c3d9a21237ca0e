"""``OneDeviceStrategy``: everything on one device, through the same compiled path."""

from __future__ import annotations

from jaxmirror import devices as devices_lib
from jaxmirror.strategy import Strategy, StrategyExtended


class OneDeviceStrategy(Strategy):
    """Place variables and computation on one device (``tf.distribute.OneDeviceStrategy``).

    Code written for ``MirroredStrategy`` runs unchanged with one replica: ``run`` returns plain
    values and ``all_reduce`` is the identity (an integer MEAN still gives floats).

    Args:
        device: a ``jax.Device`` or a TF device string such as "/cpu:0" or "GPU:0".

    Raises:
        ValueError: when ``device`` names no device here.

    Example:
        >>> import jax.numpy as jnp, jaxmirror
        >>> s = jaxmirror.OneDeviceStrategy("/cpu:0")
        >>> float(s.run(lambda x: x * 2, args=(jnp.float32(3),)))
        6.0
    """

    def __init__(self, device):
        dev = devices_lib.resolve(device, "device")
        extended = StrategyExtended(self, [dev])
        extended._distributed_variables = False  # TF: plain variables on the device
        super().__init__(extended)
