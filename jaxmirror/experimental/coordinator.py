"""``jaxmirror.experimental.coordinator``: TF's ``tf.distribute.experimental.coordinator``.

Example:
    >>> from jaxmirror.experimental import coordinator
    >>> coordinator.RemoteValue.__name__
    'RemoteValue'
"""

from jaxmirror.coordinator.cluster_coordinator import ClusterCoordinator
from jaxmirror.coordinator.errors import CancelledError, OutOfRangeError, UnavailableError
from jaxmirror.coordinator.per_worker import PerWorkerValues
from jaxmirror.coordinator.remote_value import RemoteValue

__all__ = ["CancelledError", "ClusterCoordinator", "OutOfRangeError", "PerWorkerValues",
           "RemoteValue", "UnavailableError"]
