"""``InputMethods``: the ``Strategy`` methods that bring host data onto the replicas.

The dataset and value methods of ``tf.distribute.Strategy`` (TF 2's and TF 1's), kept apart from
``run``/``reduce`` so that each module stays small; ``Strategy`` inherits them.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxmirror.core import context
from jaxmirror.data.datasets import GlobalBatchDataset
from jaxmirror.data.distribute_values import distribute_values_from_function
from jaxmirror.data.files import FileDataset
from jaxmirror.data.from_function import DistributedDatasetsFromFunction
from jaxmirror.data.options import AutoShardPolicy, InputOptions, InputReplicationMode
from jaxmirror.step.arguments import build_replicated, replicate


def _file_sharded(strategy, dataset: FileDataset, options):
    """``dataset`` split by file over the workers: worker ``w`` of ``W`` reads files
    ``w, w + W, ...`` in per-replica batches (TF's auto-shard ``FILE``)."""
    options = options or InputOptions()
    drop = options.drop_remainder or dataset.drop_remainder

    def dataset_fn(context):
        per_replica = context.get_per_replica_batch_size(dataset.batch_size)
        return dataset.shard(context.num_input_pipelines,
                             context.input_pipeline_id).rebatch(per_replica)

    return DistributedDatasetsFromFunction(
        strategy, dataset_fn, dataclasses.replace(options, drop_remainder=drop))


class InputMethods:
    """What a ``Strategy`` does with host data: distributed datasets and values.

    ``Strategy`` inherits these; they use only ``self.run`` and the strategy's placement.

    Example:
        >>> import numpy as np, jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> batch = next(iter(s.experimental_distribute_dataset([np.arange(4.0)])))
        >>> [c.tolist() for c in s.experimental_local_results(batch)]
        [[0.0, 1.0], [2.0, 3.0]]
    """

    def experimental_replicate(self, tree):
        """``tree``'s arrays placed Mirrored on every replica's device, once.

        ``run`` takes parameters and optimizer state as arrays replicated over the strategy's
        devices; arrays made on one device (a model initialized eagerly, a checkpoint restored
        outside ``scope()``, optax's ``count``) are moved by every call that gets them, and the
        first call after cost a second compilation. Place them once here. flax NNX objects
        (modules, optimizers) in ``tree`` are updated in place and returned.

        Args:
            tree: a pytree of arrays (params, optimizer state) and NNX objects.

        Returns:
            The same structure, every array replicated over the strategy's devices.

        Example:
            >>> import jax.numpy as jnp, optax, jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> params = s.experimental_replicate({"w": jnp.ones(3)})
            >>> opt_state = s.experimental_replicate(optax.adam(1e-3).init(params))
            >>> params["w"].sharding.is_fully_replicated, len(opt_state[0].count.devices())
            (True, 2)
        """
        return replicate(self.extended.placement, tree)

    def init(self, fn, *args, **kwargs):
        """Build params, optimizer state or NNX objects directly Mirrored on every replica.

        ``fn(*args, **kwargs)`` runs as one compiled program whose outputs are replicated over
        the strategy's devices: nothing is built on one device and copied, and the first
        ``run`` step compiles once. NNX modules and optimizers ``fn`` returns come back built
        on the devices.

        Args:
            fn: builds what training starts from (``lambda: Model(rngs=nnx.Rngs(0))``, or
                ``model.init`` of a Linen model).
            *args: ``fn``'s positional arguments (arrays, or Python values it uses statically).
            **kwargs: its keyword arguments.

        Returns:
            What ``fn`` returns, replicated over the strategy's devices.

        Example:
            >>> import jax, optax, jaxmirror
            >>> from flax import nnx
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> model, opt = s.init(lambda: (m := nnx.Linear(2, 1, rngs=nnx.Rngs(0)),
            ...                              nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param)))
            >>> len(model.kernel[...].devices()), len(opt.step[...].devices())
            (2, 2)
        """
        return build_replicated(self.extended.placement, fn, args, kwargs)

    def experimental_distribute_values_from_function(self, value_fn):
        """Build a distributed value by calling ``value_fn`` once per local replica.

        Args:
            value_fn: called as ``value_fn(experimental.ValueContext)``; returns an array, a
                number or a nest of them, the same structure, shapes and dtypes for every replica.

        Returns:
            A nest of ``PerReplica`` values (a plain value with one replica).

        Raises:
            ValueError: when replicas return different structures, shapes or dtypes.

        Example:
            >>> import jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> v = s.experimental_distribute_values_from_function(
            ...     lambda ctx: ctx.replica_id_in_sync_group * 10)
            >>> [int(x) for x in s.experimental_local_results(v)]
            [0, 10]
        """
        if context.current().in_run:
            raise RuntimeError(
                "experimental_distribute_values_from_function: called inside `run`; it puts one "
                "value on each replica's device, which a step cannot do while it is traced; call "
                "it outside and pass the result to `run` (inside the step, compute from "
                "get_replica_context().replica_id_in_sync_group).")
        return distribute_values_from_function(self, value_fn)

    def experimental_distribute_dataset(self, dataset, options=None):
        """Distribute a dataset of global batches over the replicas.

        Each global batch of ``G`` rows is split as TF splits it: the first ``G mod N`` replicas
        get ``ceil(G/N)`` rows, the others ``floor(G/N)`` (6 -> 3/3, 3 -> 2/1, 1 -> 1/0),
        also for a partial last batch. Components are padded to one static size with copies
        of a real row and carry their real row counts: ``experimental_local_results``,
        ``reduce(..., axis=0)``, ``gather`` and ``compute_average_loss`` (inside ``run``) see
        only the real rows, and the step compiles once for the epoch. A sum written by hand
        inside the step counts padded rows too: weight it with
        ``get_replica_context().batch_mask``. Batches are copied to the devices on a
        background thread, ahead of the step that uses them (on GPUs and other accelerators;
        with CPU devices in ``next``, see ``InputOptions.prefetch_thread``).

        Args:
            dataset: host batches: a re-iterable (e.g. a list) of nests of arrays batched by
                the global batch size, a zero-argument function returning an iterable (a
                generator function), a one-shot iterator (one epoch), or a grain dataset or
                loader, a ``tf.data.Dataset`` or a ``torch.utils.data.DataLoader``. An
                ``experimental.FileDataset`` on several workers is split by file (auto-shard
                policy ``FILE``, also under ``AUTO``): each worker reads its own files, each
                replica takes ``batch_size / num_replicas_in_sync`` rows per step, and the
                workers agree every step on the rows each replica got, so every example is
                used once per epoch.
            options: an ``InputOptions`` (prefetch depth, ``drop_remainder``, fetching to the
                devices, the auto-shard policy for several workers).

        Returns:
            A ``DistributedDataset``; iterating it gives nests of ``PerReplica`` values (plain
            arrays with one replica).

        Raises:
            ValueError: for something that is not a dataset, or ``InputOptions`` this method
                does not support (``PER_REPLICA``); bad batches raise when they are reached.

        Example:
            >>> import numpy as np, jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> ds = [np.arange(4.0), np.arange(4.0, 7.0)]
            >>> it = iter(s.experimental_distribute_dataset(ds))
            >>> [c.tolist() for c in s.experimental_local_results(next(it))]
            [[0.0, 1.0], [2.0, 3.0]]
            >>> [c.tolist() for c in s.experimental_local_results(next(it))]
            [[4.0, 5.0], [6.0]]
        """
        if isinstance(dataset, FileDataset) and jax.process_count() > 1:
            policy = (options or InputOptions()).auto_shard_policy
            if policy in (AutoShardPolicy.AUTO, AutoShardPolicy.FILE):
                return _file_sharded(self, dataset, options)
        return GlobalBatchDataset(self, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """Distribute datasets made by ``dataset_fn``, already batched per replica.

        ``dataset_fn(InputContext)`` is called once per worker (or, with
        ``InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA)``, once
        per replica); shard and batch by ``ctx.get_per_replica_batch_size(global_batch_size)``
        there. Each step every replica takes the next batch; partial batches are padded with
        row counts as in ``experimental_distribute_dataset``.

        Args:
            dataset_fn: a function taking an ``InputContext`` and returning host batches of
                one replica (any dataset ``experimental_distribute_dataset`` accepts).
            options: an ``InputOptions``.

        Returns:
            A ``DistributedDataset``.

        Raises:
            ValueError: for a non-callable ``dataset_fn`` or bad options.

        Example:
            >>> import numpy as np, jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> def dataset_fn(ctx):
            ...     n = ctx.get_per_replica_batch_size(4)
            ...     return [np.arange(n) + 10 * k for k in range(2)]
            >>> batches = list(s.distribute_datasets_from_function(dataset_fn))
            >>> [c.tolist() for c in s.experimental_local_results(batches[0])]
            [[0, 1], [10, 11]]
        """
        return DistributedDatasetsFromFunction(self, dataset_fn, options)

    def experimental_distribute_datasets_from_function(self, dataset_fn, options=None):
        """TF 2.3's name for ``distribute_datasets_from_function`` (same arguments and result).

        Example:
            >>> import numpy as np, jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> ds = s.experimental_distribute_datasets_from_function(lambda ctx: [np.zeros(1)])
            >>> len(list(ds))
            1
        """
        return self.distribute_datasets_from_function(dataset_fn, options)

    # -- TF 1's input calls (MirroredStrategy page) -------------------------------------------
    def make_dataset_iterator(self, dataset):
        """An iterator over ``dataset``'s global batches, split over the replicas (TF 1).

        The same as ``iter(experimental_distribute_dataset(dataset))``; ``initialize()`` on it
        (or its ``initializer``) starts it over, as TF's does eagerly.

        Args:
            dataset: a dataset of global batches (see ``experimental_distribute_dataset``).

        Returns:
            A ``DistributedIterator``.

        Example:
            >>> import numpy as np, jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> it = s.make_dataset_iterator([np.arange(2.0)])
            >>> it.initialize()
            []
            >>> [c.tolist() for c in s.experimental_local_results(it.get_next())]
            [[0.0], [1.0]]
        """
        return iter(self.experimental_distribute_dataset(dataset))

    def make_input_fn_iterator(self, input_fn, replication_mode=None):
        """An iterator over the datasets ``input_fn(InputContext)`` makes, one per worker (TF 1).

        Args:
            input_fn: a function taking an ``InputContext`` and returning per-replica batches.
            replication_mode: ``InputReplicationMode.PER_WORKER`` (the only mode, as in TF).

        Returns:
            A ``DistributedIterator``.

        Raises:
            ValueError: for another replication mode.

        Example:
            >>> import numpy as np, jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> it = s.make_input_fn_iterator(lambda ctx: [np.ones(1)] * 4)
            >>> [c.tolist() for c in s.experimental_local_results(it.get_next())]
            [[1.0], [1.0]]
        """
        if replication_mode is None:
            replication_mode = InputReplicationMode.PER_WORKER
        if replication_mode is not InputReplicationMode.PER_WORKER:
            raise ValueError(f"make_input_fn_iterator: only InputReplicationMode.PER_WORKER is "
                             f"supported; got {replication_mode!r}.")
        return iter(self.distribute_datasets_from_function(input_fn))

    def experimental_run(self, fn, input_iterator=None):
        """Run ``fn`` on every replica with the next element of ``input_iterator`` (TF 1).

        Args:
            fn: the per-replica function; it takes the element as its one argument (no
                argument without an iterator).
            input_iterator: a ``DistributedIterator``, or ``None``.

        Returns:
            The merged results, as ``run`` returns them.

        Raises:
            StopIteration: when the iterator is at its end.

        Example:
            >>> import numpy as np, jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> it = s.make_dataset_iterator([np.arange(2.0)])
            >>> out = s.experimental_run(lambda x: x * 2, it)
            >>> [c.tolist() for c in s.experimental_local_results(out)]
            [[0.0], [2.0]]
        """
        if input_iterator is None:
            return self.run(fn, args=())
        return self.run(fn, args=(input_iterator.get_next(),))
