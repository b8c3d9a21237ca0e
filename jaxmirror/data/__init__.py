"""The input pipeline: host batches to ``PerReplica`` values (TF's ``input_lib``).

Named ``data`` rather than ``input`` so that no name of the package shadows the builtin.

Modules:
    ``options``: ``InputOptions``, ``InputContext``, replication and shard modes.
    ``sources``: what a dataset can be: lists, factories, ``tf.data``, torch, grain.
    ``files``: ``FileDataset``: batches read from files, which workers can split by file.
    ``batching``: TF's split of a batch over replicas, padding, and each worker's share.
    ``placer``: ``Placer``: a batch's host blocks onto the replicas' devices in one transfer.
    ``prefetch``: the background thread that runs an iterator ahead.
    ``datasets``: ``DistributedDataset``: batches split, padded, placed and prefetched.
    ``from_function``: ``DistributedDatasetsFromFunction``: batches from ``dataset_fn``.
    ``iterators``: ``DistributedIterator`` and ``get_next_as_optional``'s value.
    ``positions``: a pass's position as a checkpoint saves it.
    ``distribute_values``: ``experimental_distribute_values_from_function``.
"""
