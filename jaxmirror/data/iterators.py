"""Iterating a distributed dataset: ``DistributedIterator`` and ``get_next_as_optional``'s value."""

from __future__ import annotations

import collections
import contextlib

import numpy as np

from jaxmirror.core import context
from jaxmirror.core.checkpointable import Checkpointable
from jaxmirror.data import positions

_UNUSED: list = []  # elements given but not used yet, while a checkpoint is saved (see below)


@contextlib.contextmanager
def elements_not_used(values):
    """Inside, an iterator whose last element is one of ``values`` saves its position as if
    that element had not been given: ``handler.run(step, next(iterator))`` saved by a
    preemption before ``step`` ran resumes with that element.

    Args:
        values: the call's arguments (the elements are looked for among them, by identity).

    Example:
        >>> import numpy as np, jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> it = iter(s.experimental_distribute_dataset([np.zeros(2)] * 3))
        >>> batch = next(it)
        >>> with elements_not_used([batch]):
        ...     int(it.checkpoint_state()[1])
        0
    """
    _UNUSED.append(_objects_in(values, 3))
    try:
        yield
    finally:
        _UNUSED.pop()


def _objects_in(values, depth: int) -> dict:
    """``{id: object}`` of ``values`` and what tuples, lists and dicts among them hold, down
    to ``depth`` levels (``run(fn, args=(batch,))`` puts the element one level down)."""
    found = {}
    for v in values:
        found[id(v)] = v
        if isinstance(v, _Optional) and v.has_value():
            v = v.get_value()
            found[id(v)] = v
        if depth > 1 and isinstance(v, (tuple, list, dict)):
            found.update(_objects_in(v.values() if isinstance(v, dict) else v, depth - 1))
    return found


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


class DistributedIterator(Checkpointable):
    """An iterator over a distributed dataset (``tf.distribute.DistributedIterator``).

    Batches are made and copied to the devices on a background thread, up to
    ``InputOptions.experimental_per_replica_buffer_size`` batches ahead of the one in use
    (on CPU devices they are made in ``next`` instead: ``InputOptions.prefetch_thread``).

    Put it in a checkpoint's tree (``jaxmirror.checkpoint.save``, ``CheckpointManager``) to
    save its position, as TF saves a ``tf.data`` iterator: a restore into an iterator of the
    same dataset makes it continue after the elements given before the save, so a resumed
    run sees every element once. The position is a count of elements, re-read (not placed)
    on restore, so the dataset must give the same batches again (a list, arrays, a grain
    dataset, a function making the same pass), and the batches read ahead and not yet given
    are read again. Global batches read by every worker restore onto any number of workers;
    per-worker data (``distribute_datasets_from_function``, ``AutoShardPolicy.OFF``) onto as
    many input pipelines as were saved.

    Args:
        strategy: the strategy the batches are for.
        prefetcher: a ``prefetch.Prefetcher`` or ``prefetch.Inline`` yielding placed batches.
        dataset: the distributed dataset iterated (for ``element_spec``).
        given: how many elements the pass had given before this iterator's first (a
            restored position).

    Example:
        >>> import numpy as np, jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> it = iter(s.experimental_distribute_dataset([np.arange(2), np.arange(2, 4)]))
        >>> [x.tolist() for x in s.experimental_local_results(it.get_next())]
        [[0], [1]]
    """

    def __init__(self, strategy, prefetcher, dataset, place=None, stack=None, given=0):
        self._strategy = strategy
        self._prefetcher = prefetcher
        self._dataset = dataset
        self._place = place  # host batch -> placed element; None: the source yields placed ones
        self._stack = stack  # (first host batch, k) -> a HostStack or None (see take_stacked)
        self._given = given  # elements given so far in this pass (the checkpointed position)
        self._last = None  # the last element given (see elements_not_used)
        # Given next, before the source's: (item, placed) read ahead by at_end, or put back
        # by a failed fused step (put_back); placed items are elements as given.
        self._back: collections.deque = collections.deque()
        self._taken = []  # the latest take_stacked's: placed elements and HostStacks, in order
        self._ended = False  # the source has ended

    def __iter__(self):
        return self

    def __repr__(self) -> str:
        return f"<DistributedIterator over {self._dataset!r}>"

    def __next__(self):
        if context.current().in_run:
            raise ValueError("DistributedIterator.next: called inside `run`; fetch the batch "
                             "outside and pass it to `run` as an argument.")
        element = self._placed(*self._pull())
        self._given += 1
        self._last = element
        return element

    def _pull(self) -> tuple:
        """``(item, placed)``: the next item, put back or read ahead first."""
        if self._back:
            return self._back.popleft()
        if self._ended:
            raise StopIteration
        try:
            return next(self._prefetcher), False
        except StopIteration:
            self._ended = True
            raise

    def _placed(self, item, placed: bool):
        return item if placed or self._place is None else self._place(item)

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
        if context.current().in_run:
            next(self)  # raises the error above
        groups, stack, taken = [], None, []
        self._taken = taken
        for _ in range(k):
            try:
                item, placed = self._pull()
            except StopIteration:
                break
            self._given += 1
            if stack is not None and not placed and stack.add(item):
                continue
            if stack is not None:
                groups.append(("stacked",) + stack.place())
            stack = None if placed or self._stack is None else self._stack(item, k)
            if stack is not None:
                taken.append(stack)
                continue
            element = self._placed(item, placed)
            taken.append(element)
            if groups and groups[-1][0] == "each":
                groups[-1][1].append(element)
            else:
                groups.append(("each", [element]))
        if stack is not None:
            groups.append(("stacked",) + stack.place())
        return groups

    def put_back(self, n: int) -> None:
        """Give the last ``n`` elements of the latest ``take_stacked`` again, next: a fused
        step whose program failed puts back those it did not apply (its position goes back
        too, so a checkpoint saves it as if they had not been taken).

        Args:
            n: how many (at most the number taken); ``0`` once they all took effect, which
                lets the iterator drop them.

        Example:
            >>> import numpy as np, jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> it = iter(s.experimental_distribute_dataset([np.full(2, i) for i in range(3)]))
            >>> _ = it.take_stacked(3)
            >>> it.put_back(2)
            >>> [s.experimental_local_results(b)[0].tolist() for b in it]
            [[1], [2]]
        """
        items = []
        for x in self._taken:
            batches = getattr(x, "batches", None)
            items += [(b, False) for b in batches()] if batches else [(x, True)]
        n = min(n, len(items))
        if n > 0:
            self._back.extendleft(reversed(items[-n:]))
            self._given -= n
        self._taken = []

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
        """TF 1's ``initialize()``: the iterator starts a new pass (TF's eager reset).

        Returns:
            ``[]`` (no initializer ops to run).
        """
        if self._given or self._ended:  # else this pass is new (nothing given yet)
            fresh = self._dataset.iterator_at(0, adopted_by=self)
            self.close()
            vars(self).update(vars(fresh))
        return []

    initializer = property(initialize, doc="TF 1's ``initializer``, as TF's: reading it calls "
                                           "``initialize()``, which starts the pass over.")

    def close(self) -> None:
        """Stop prefetching; the iterator ends."""
        self._prefetcher.close()

    # -- checkpoints (core.checkpointable; data/positions.py) -------------------------------------
    def given(self) -> int:
        """Elements given in this pass, less one taken for a call that has not run yet (see
        ``elements_not_used``): the position a checkpoint saves."""
        if self._last is not None and any(id(self._last) in ids for ids in _UNUSED):
            return self._given - 1  # given again after a restore
        return self._given

    def at_end(self) -> bool:
        """Whether this pass has no element left (the next is read ahead, and kept, if need
        be; every worker asks at the same point, so their exchanges stay paired)."""
        if not self._back and not self._ended:
            try:
                self._back.append((next(self._prefetcher), False))
            except StopIteration:
                self._ended = True
        return not self._back

    def checkpoint_state(self) -> np.ndarray:
        """The position a checkpoint saves (``data/positions.py``).

        Returns:
            A NumPy int64 array of shape (4,).

        Raises:
            ValueError: a newer pass over the dataset was made since this one (save the
                dataset, or the iterator training reads), or the dataset is one-shot.

        Example:
            >>> import numpy as np, jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> it = iter(s.experimental_distribute_dataset([np.zeros(2)] * 3))
            >>> _ = next(it)
            >>> it.checkpoint_state().tolist()
            [1, 1, 1, 0]
        """
        if self._dataset.latest_iterator() is not self:
            raise ValueError(
                "jaxmirror.checkpoint.save: the DistributedIterator in the checkpoint is not "
                "the latest pass over its dataset (iter() was called on the dataset since, "
                "e.g. once per epoch), so its position is not where training is; put the "
                "distributed dataset itself in the checkpoint (its latest pass is saved, and "
                "the first iter() after a restore continues it), or the iterator you train "
                "from.")
        return positions.state(self.given(), self._dataset)

    def checkpoint_shape_dtype(self) -> tuple:
        return positions.SHAPE_DTYPE

    def check_checkpoint_state(self, state) -> None:
        """Raise ``ValueError`` unless ``state`` is a position this dataset can take."""
        positions.check(state, self._dataset)

    def restore_checkpoint_state(self, state) -> None:
        """Continue after the ``state[1]``-th element of a new pass (the batches are read
        again from the dataset's start and dropped; nothing read ahead is kept).

        Example:
            >>> import numpy as np, jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> ds = s.experimental_distribute_dataset([np.full(2, i) for i in range(4)])
            >>> it = iter(ds)
            >>> it.restore_checkpoint_state(np.array([1, 2, 1, 0]))
            >>> [s.experimental_local_results(b)[0].tolist() for b in it]
            [[2], [3]]
        """
        skip = positions.check(state, self._dataset)
        self._prefetcher.close()
        fresh = self._dataset.iterator_at(skip, adopted_by=self)
        self._prefetcher, self._place, self._stack = fresh._prefetcher, fresh._place, fresh._stack
        self._given, self._last, self._ended = skip, None, False
        self._back.clear()
        self._taken = []
