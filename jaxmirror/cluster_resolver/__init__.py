"""Cluster resolvers: which cluster a multi-process job runs in, and which task this process is.

TF's ``tf.distribute.cluster_resolver``: a `ClusterSpec` names the jobs of a cluster
(``"chief"``, ``"worker"``, ``"ps"``, ...) and their tasks' ``"host:port"`` addresses; a
`ClusterResolver` finds the cluster and this process's ``task_type`` and ``task_id``: from the
``TF_CONFIG`` variable (`TFConfigClusterResolver`), from Slurm (`SlurmClusterResolver`), or as
given (`SimpleClusterResolver`); `RayClusterResolver` makes a parameter-server cluster of Ray
actors (Ray is imported only when one is made).

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
