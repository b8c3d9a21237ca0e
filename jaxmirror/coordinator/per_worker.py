"""Per-worker datasets and iterators: one object on the coordinator, one per worker inside.

``create_per_worker_dataset(fn)`` makes a ``PerWorkerDataset``; ``iter()`` of it a
``PerWorkerIterator``. On the coordinator they are references. Passed to (or captured by) a
scheduled function, each resolves in the worker to that worker's own dataset or iterator, made
there on first use. A worker that is replaced makes them again from the start of the dataset.
"""

from __future__ import annotations

import inspect
import itertools

from jaxmirror.coordinator import shipping, worker_runtime
from jaxmirror.data.options import InputContext
from jaxmirror.data.sources import epoch_factory

_IDS = itertools.count()


class DistributeOnWorkers:
    """What ``ParameterServerStrategy.experimental_distribute_dataset`` (and
    ``distribute_datasets_from_function``) return: a recipe each worker follows with its own
    strategy, for ``ClusterCoordinator.create_per_worker_dataset``.

    Args:
        method: ``"experimental_distribute_dataset"`` or ``"distribute_datasets_from_function"``.
        source: the dataset, or the dataset function.
        options: the ``InputOptions``, or ``None``.

    Example:
        >>> d = DistributeOnWorkers("experimental_distribute_dataset", [1, 2], None)
        >>> iter(d)
        Traceback (most recent call last):
        ...
        TypeError: ParameterServerStrategy.experimental_distribute_dataset: with parameter servers the dataset is distributed on each worker; pass it to coordinator.create_per_worker_dataset(...) and iterate that.
    """

    def __init__(self, method: str, source, options):
        self.method, self.source, self.options = method, source, options

    def make(self):
        """This worker's distributed dataset.

        Returns:
            A ``DistributedDataset`` of the worker's strategy.
        """
        strategy = worker_runtime.worker_strategy()
        return getattr(strategy, self.method)(self.source, self.options)

    def __iter__(self):
        raise TypeError(f"ParameterServerStrategy.{self.method}: with parameter servers the "
                        f"dataset is distributed on each worker; pass it to "
                        f"coordinator.create_per_worker_dataset(...) and iterate that.")


def _takes_input_context(fn) -> bool:
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                         p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(params) == 1


def make_dataset(source, num_workers: int, num_replicas: int):
    """This worker's dataset from what ``create_per_worker_dataset`` was given.

    Args:
        source: a ``DistributeOnWorkers``, or a function of no arguments or of an
            ``InputContext`` (this worker's pipeline id and the number of pipelines).
        num_workers: how many workers (input pipelines).
        num_replicas: replicas in sync.

    Returns:
        The dataset.
    """
    if isinstance(source, DistributeOnWorkers):
        return source.make()
    if _takes_input_context(source):
        return source(InputContext(num_input_pipelines=num_workers,
                                   input_pipeline_id=worker_runtime.worker_index(),
                                   num_replicas_in_sync=num_replicas))
    return source()


def _dataset_here(resource_id, source, num_workers, num_replicas):
    return worker_runtime.resource(
        resource_id, lambda: make_dataset(source, num_workers, num_replicas))


def _iterator_here(resource_id, dataset):
    # Whatever the input pipeline takes as a dataset (a generator function too).
    return worker_runtime.resource(resource_id, lambda: epoch_factory(
        dataset, "ClusterCoordinator.create_per_worker_dataset")())


class PerWorkerValues:
    """Values with one instance per worker (``tf.distribute.experimental.coordinator.
    PerWorkerValues``): passed to a scheduled function, each worker sees its own.

    Example:
        >>> PerWorkerValues.__name__
        'PerWorkerValues'
    """

    def _reference(self):
        raise NotImplementedError

    def __reduce__(self):
        if not shipping.shipping():
            raise TypeError(f"{type(self).__name__} cannot be pickled or copied outside "
                            f"ClusterCoordinator.schedule.")
        return self._reference()


class PerWorkerDataset(PerWorkerValues):
    """A dataset made on every worker (``create_per_worker_dataset``); ``iter()`` it.

    Args:
        source: a dataset function (of no arguments, or of an ``InputContext``), or what
            ``ParameterServerStrategy.experimental_distribute_dataset`` returned.
        num_workers: how many workers.
        num_replicas: replicas in sync on each worker.
    """

    def __init__(self, source, num_workers: int, num_replicas: int):
        if not (callable(source) or isinstance(source, DistributeOnWorkers)):
            raise TypeError(
                f"ClusterCoordinator.create_per_worker_dataset: `dataset_fn` must be a "
                f"function returning a dataset, or strategy.experimental_distribute_dataset("
                f"...)'s result; got a {type(source).__name__}. Wrap a dataset as "
                f"`lambda: dataset`.")
        self._id = next(_IDS)
        self._source, self._workers, self._replicas = source, num_workers, num_replicas

    def __iter__(self):
        return PerWorkerIterator(self)

    def _reference(self):
        return (_dataset_here, (("dataset", self._id), self._source, self._workers,
                                self._replicas))


class PerWorkerIterator(PerWorkerValues):
    """An iterator on every worker; call ``next()`` on it inside a scheduled function.

    Args:
        dataset: its ``PerWorkerDataset``.
    """

    def __init__(self, dataset: PerWorkerDataset):
        self._id = next(_IDS)
        self._dataset = dataset

    def __iter__(self):
        return self

    def __next__(self):
        raise TypeError("next() of a per-worker iterator works inside a function passed to "
                        "ClusterCoordinator.schedule (pass the iterator as an argument or "
                        "capture it), where it is the worker's own iterator.")

    def _reference(self):
        return (_iterator_here, (("iterator", self._id), self._dataset))
