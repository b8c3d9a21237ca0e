"""``jaxmirror.experimental``: the names TF keeps under ``tf.distribute.experimental``.

Modules:
    ``coordinator``: ``jaxmirror.experimental.coordinator`` (``ClusterCoordinator``, ...).
    ``partitioners``: ``jaxmirror.experimental.partitioners``: TF's variable partitioners.
    ``failure_handling``: ``PreemptionCheckpointHandler`` and ``TerminationConfig``.

Example:
    >>> import jaxmirror
    >>> jaxmirror.experimental.ValueContext(0, 2).num_replicas_in_sync
    2
"""

from jaxmirror import planned
from jaxmirror.experimental import coordinator, partitioners
from jaxmirror.collectives.communication import CommunicationImplementation, CommunicationOptions
from jaxmirror.core.devices import simulate_cpu_devices
from jaxmirror.data.distribute_values import ValueContext
from jaxmirror.data.files import FileDataset
from jaxmirror.data.options import AutoShardPolicy
from jaxmirror.experimental.failure_handling import PreemptionCheckpointHandler, TerminationConfig
from jaxmirror.step.analysis.divergence import ReplicaDivergenceWarning, check_replicas
from jaxmirror.step.analysis.padding_check import PaddedRowsWarning
from jaxmirror.strategies.central_storage import CentralStorageStrategy
from jaxmirror.strategies.multi_worker import MultiWorkerMirroredStrategy
from jaxmirror.strategies.parameter_server import ParameterServerStrategy
from jaxmirror.variables.sharded import ShardedVariable


def __getattr__(name):
    # TF names not built yet (planned.py) say so, instead of a bare AttributeError.
    return planned.planned_attribute("jaxmirror.experimental", name)


__all__ = ["AutoShardPolicy", "CentralStorageStrategy", "CommunicationImplementation",
           "CommunicationOptions",
           "FileDataset", "MultiWorkerMirroredStrategy", "PaddedRowsWarning",
           "ParameterServerStrategy", "PreemptionCheckpointHandler", "ReplicaDivergenceWarning",
           "ShardedVariable", "TerminationConfig", "ValueContext", "check_replicas",
           "coordinator", "partitioners", "simulate_cpu_devices"]
