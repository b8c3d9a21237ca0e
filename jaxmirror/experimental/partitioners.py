"""``jaxmirror.experimental.partitioners``: TF's ``tf.distribute.experimental.partitioners``.

Example:
    >>> from jaxmirror.experimental import partitioners
    >>> partitioners.FixedShardsPartitioner(2)(shape=(10, 3), dtype="float32")
    [2, 1]
"""

from jaxmirror.variables.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
)

__all__ = ["FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner", "Partitioner"]
