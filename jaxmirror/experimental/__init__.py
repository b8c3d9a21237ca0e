"""``jaxmirror.experimental``: the names TF keeps under ``tf.distribute.experimental``.

Example:
    >>> import jaxmirror
    >>> jaxmirror.experimental.ValueContext(0, 2).num_replicas_in_sync
    2
"""

from jaxmirror.core.devices import simulate_cpu_devices
from jaxmirror.data.distribute_values import ValueContext
from jaxmirror.data.options import AutoShardPolicy

__all__ = ["AutoShardPolicy", "ValueContext", "simulate_cpu_devices"]
