"""jaxmirror: TensorFlow's ``tf.distribute`` programming model on JAX.

The public API, named as in ``tf.distribute`` and re-exported from the layers (``core``,
``cluster_resolver``, ``runtime``, ``variables``, ``step``, ``data`` and ``collectives``,
``coordinator``, ``strategies``, ``nn`` and ``metrics``; see ARCHITECTURE.md). ``launch``
starts local multi-worker runs.

Example:
    >>> import jax.numpy as jnp, jaxmirror
    >>> strategy = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
    >>> @strategy.run
    ... def step(x):
    ...     return jaxmirror.get_replica_context().all_reduce("sum", x)
    >>> float(step(jnp.float32(1)))
    2.0
"""

from jaxmirror import checkpoint, cluster_resolver, errors, experimental, launch
from jaxmirror.collectives.cross_device_ops import (
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)
from jaxmirror.core.context import (
    experimental_set_strategy,
    get_cross_replica_context,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from jaxmirror.core.devices import configure_cpu_devices
from jaxmirror.core.reduce_op import ReduceOp, VariableAggregation, VariableSynchronization
from jaxmirror.core.values import DistributedValues, Mirrored, PerReplica
from jaxmirror.data.datasets import DistributedDataset
from jaxmirror.data.iterators import DistributedIterator
from jaxmirror.data.options import InputContext, InputOptions, InputReplicationMode
from jaxmirror.step.losses import compute_average_loss
from jaxmirror.step.replica_context import ReplicaContext
from jaxmirror.runtime.server import Server
from jaxmirror.step.program import RunOptions
from jaxmirror.strategies import default as _default  # registers the default strategy
from jaxmirror.strategies.extended import StrategyExtended
from jaxmirror.strategies.mirrored import MirroredStrategy
from jaxmirror.strategies.multi_worker import MultiWorkerMirroredStrategy
from jaxmirror.strategies.one_device import OneDeviceStrategy
from jaxmirror.strategies.strategy import Strategy
from jaxmirror.strategies.tpu import TPUStrategy
from jaxmirror.variables.distributed import MirroredVariable, SyncOnReadVariable
from jaxmirror.variables.trees import assign_values, read_values
from jaxmirror.variables.variable import Variable

from jaxmirror import metrics, nn, planned

del _default
planned.install_planned_names(cluster_resolver, "jaxmirror.cluster_resolver")


def __getattr__(name):
    # TF names not built yet (planned.py) say so, instead of a bare AttributeError.
    return planned.planned_attribute("jaxmirror", name)


__version__ = "0.1.0"

__all__ = [
    "CrossDeviceOps", "DistributedDataset", "DistributedIterator", "DistributedValues",
    "HierarchicalCopyAllReduce", "InputContext", "InputOptions", "InputReplicationMode",
    "Mirrored", "MirroredStrategy", "MirroredVariable", "MultiWorkerMirroredStrategy",
    "NcclAllReduce", "OneDeviceStrategy", "PerReplica", "ReduceOp", "ReductionToOneDevice",
    "ReplicaContext", "RunOptions", "Server", "Strategy", "StrategyExtended",
    "SyncOnReadVariable", "TPUStrategy", "Variable", "VariableAggregation",
    "VariableSynchronization", "assign_values", "checkpoint", "cluster_resolver",
    "compute_average_loss", "configure_cpu_devices", "errors", "experimental",
    "experimental_set_strategy",
    "get_cross_replica_context", "get_replica_context", "get_strategy", "has_strategy",
    "in_cross_replica_context", "launch", "metrics", "nn", "read_values",
]
