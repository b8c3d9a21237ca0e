"""Cluster resolvers: which cluster a multi-process job runs in, and which task this process is.

TF's ``tf.distribute.cluster_resolver``. A `ClusterSpec` names a cluster's jobs (``"chief"``,
``"worker"``, ``"ps"``, ...) and their tasks' ``"host:port"`` addresses. A `ClusterResolver`
finds the cluster and this process's ``task_type`` and ``task_id``.

Modules:
    ``cluster_spec``: `ClusterSpec`, and `parse_address`, the one ``"host:port"`` rule.
    ``base``: `ClusterResolver`, the base class, and `SimpleClusterResolver` (as given).
    ``tf_config``: `TFConfigClusterResolver`: from the ``TF_CONFIG`` variable.
    ``slurm``: `SlurmClusterResolver`: from a Slurm job step's variables.
    ``ray_support``: Ray, an optional dependency, imported on first use.
    ``ray_cluster``: `RayClusterResolver`: a parameter-server cluster of Ray actors.

Example:
    >>> from jaxmirror.cluster_resolver import ClusterSpec, SimpleClusterResolver
    >>> spec = ClusterSpec({"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]})
    >>> resolver = SimpleClusterResolver(spec, task_type="worker", task_id=0, rpc_layer="grpc")
    >>> resolver.cluster_spec().jobs, resolver.master("worker", 0)
    (['chief', 'worker'], 'grpc://host1:2222')
"""

from jaxmirror.cluster_resolver.base import ClusterResolver, SimpleClusterResolver
from jaxmirror.cluster_resolver.cluster_spec import ClusterSpec, parse_address
from jaxmirror.cluster_resolver.ray_cluster import RayClusterResolver
from jaxmirror.cluster_resolver.slurm import SlurmClusterResolver
from jaxmirror.cluster_resolver.tf_config import TFConfigClusterResolver

__all__ = ["ClusterResolver", "ClusterSpec", "RayClusterResolver", "SimpleClusterResolver",
           "SlurmClusterResolver", "TFConfigClusterResolver", "parse_address"]
