"""Iterating a distributed dataset: ``DistributedIterator`` and ``get_next_as_optional``'s value."""

from __future__ import annotations

import itertools

from jaxmirror.core import context


class _Optional:
    """``get_next_as_optional``'s result: a value or nothing (TF's ``tf.experimental.Optional``).

    Example:
        >>> import numpy as np, jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> it = iter(s.experimental_distribute_dataset([np.zeros(2)]))
        >>> it.get_next_as_optional().has_value(), it.get_next_as_optional().has_value()
        (True, False)
    """

    def __init__(self, value=None, has_value: bool = False):
        self._value = value
        self._has_value = has_value

    def has_value(self) -> bool:
        """Whether there is a value."""
        return self._has_value

    def get_value(self):
        """The value; raises ``ValueError`` when there is none (the iterator had ended)."""
        if not self._has_value:
            raise ValueError("get_value: this Optional has no value (the distributed iterator "
                             "had reached the end of the dataset); check has_value() first.")
        return self._value

    def __repr__(self) -> str:
        return f"Optional(has_value={self._has_value})"


class DistributedIterator:
    """An iterator over a distributed dataset (``tf.distribute.DistributedIterator``).

    Batches are made and copied to the devices on a background thread, up to
    ``InputOptions.experimental_per_replica_buffer_size`` batches ahead of the one in use
    (on CPU devices they are made in ``next`` instead: ``InputOptions.prefetch_thread``).

    Args:
        strategy: the strategy the batches are for.
        prefetcher: a ``prefetch.Prefetcher`` or ``prefetch.Inline`` yielding placed batches.
        dataset: the distributed dataset iterated (for ``element_spec``).

    Example:
        >>> import numpy as np, jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> it = iter(s.experimental_distribute_dataset([np.arange(2), np.arange(2, 4)]))
        >>> [x.tolist() for x in s.experimental_local_results(it.get_next())]
        [[0], [1]]
    """

    def __init__(self, strategy, prefetcher, dataset, place=None, stack=None):
        self._strategy = strategy
        self._prefetcher = prefetcher
        self._dataset = dataset
        self._place = place  # host batch -> placed element; None: the source yields placed ones
        self._stack = stack  # (first host batch, k) -> a HostStack or None (see take_stacked)

    def __iter__(self):
        return self

    def __repr__(self) -> str:
        return f"<DistributedIterator over {self._dataset!r}>"

    def __next__(self):
        if context.current().in_run:
            raise ValueError("DistributedIterator.next: called inside `run`; fetch the batch "
                             "outside and pass it to `run` as an argument.")
        if self._place is None:
            return next(self._prefetcher)
        return self._place(next(self._prefetcher))

    def take_stacked(self, k: int) -> list:
        """Up to ``k`` next elements for a fused step (``strategy.function(...,
        steps_per_execution=k)``), moved to the devices in one transfer where they can be.

        Args:
            k: how many elements to take.

        Returns:
            Groups, in order: ``("stacked", element, counts)``, a nest whose ``PerReplica``
            components have a leading axis of consecutive elements of one shape (with each
            leaf's ``(elements, replicas)`` row counts or ``None``; see ``placer.HostStack``),
            or ``("each", elements)``, elements as ``next`` gives them. Empty at the end.
        """
        if self._stack is None:
            taken = list(itertools.islice(self, k))
            return [("each", taken)] if taken else []
        if context.current().in_run:
            next(self)  # raises the error above
        groups, stack = [], None
        for batch in itertools.islice(self._prefetcher, k):
            if stack is not None and stack.add(batch):
                continue
            if stack is not None:
                groups.append(("stacked",) + stack.place())
            stack = self._stack(batch, k)
            if stack is None:
                groups.append(("each", [self._place(batch)]))
        if stack is not None:
            groups.append(("stacked",) + stack.place())
        return groups

    def get_next(self):
        """The next element: a nest of ``PerReplica`` values.

        Returns:
            The element (plain arrays with one replica).

        Raises:
            StopIteration: at the end of the dataset.
            ValueError: inside ``run``.
        """
        return next(self)

    def get_next_as_optional(self):
        """The next element wrapped in an optional: ``has_value()`` is False at the end.

        Returns:
            An object with ``has_value()`` and ``get_value()``.
        """
        try:
            return _Optional(next(self), True)
        except StopIteration:
            return _Optional()

    @property
    def element_spec(self):
        """The structure of each replica's component (see ``DistributedDataset.element_spec``)."""
        return self._dataset.element_spec

    def initialize(self) -> list:
        """TF 1's ``initialize()`` of ``make_dataset_iterator``: nothing to do; returns ``[]``."""
        return []

    def close(self) -> None:
        """Stop prefetching; the iterator ends."""
        self._prefetcher.close()
