"""Distributed datasets: host batches split over the replicas, padded, placed and prefetched.

One global batch flows: source (``sources.py``) -> checked NumPy leaves -> this worker's rows,
split by TF's rule and padded to a static size (``batching.py``) -> one ``jax.device_put`` of
every leaf plus the row counts (``placer.Placer``) -> a nest of ``PerReplica`` values. A background
thread (``prefetch.py``) runs that ahead of the training loop, so the copy to the devices
overlaps the previous step. The first batch of an epoch is read when the iterator is made, so
a bad dataset fails there and ``element_spec`` is known.
"""

from __future__ import annotations

import base64
import itertools
import pickle
import threading

import jax
import numpy as np

from jaxmirror.core.checkpointable import Checkpointable
from jaxmirror.data import batching, positions, sources
from jaxmirror.data.iterators import DistributedIterator
from jaxmirror.data.options import AutoShardPolicy, InputReplicationMode, check_options
from jaxmirror.data.placer import HostBatch, Placer
from jaxmirror.data.prefetch import Inline, Prefetcher
from jaxmirror.runtime import ledger
from jaxmirror.runtime.exchange import StepExchange

END = object()  # what a source gives after its last batch
_ROUND_STEPS = 16  # steps agreed across workers in one exchange, at most
_ROUND_BYTES = 64 << 20  # of this worker's host batches read ahead for one exchange


class DistributedDataset(Checkpointable):
    """A dataset split over the replicas (``tf.distribute.DistributedDataset``).

    What ``strategy.experimental_distribute_dataset`` and ``distribute_datasets_from_function``
    return (this class documents the first; see ``DistributedDatasetsFromFunction``).
    Iterating it gives, per global batch, the same nest with each array replaced by a
    ``PerReplica`` value: TF's split (the first ``G mod N`` replicas get one row more), each
    replica's rows on its device, prefetched on a background thread (on GPUs; on CPUs in
    ``next``: see ``InputOptions.prefetch_thread``). Every component is padded to one static
    size (the first batch's ``ceil(G/N)``), so uneven and partial batches reuse the step's
    compiled program; the values carry their real row counts, which
    ``experimental_local_results``, ``reduce``, ``gather`` and ``compute_average_loss`` honour.
    With one replica batches are plain arrays.

    Made by the strategy's methods, not directly: ``experimental_distribute_dataset(dataset,
    options)`` takes a re-iterable of global host batches (nests of arrays batched along axis
    0), a zero-argument function returning an iterable, a one-shot iterator, or a grain,
    ``tf.data`` or ``torch`` dataset/loader.

    Args:
        strategy: the strategy to distribute over.
        options: an ``InputOptions`` or ``None``.

    Raises:
        ValueError: for bad options.

    Example:
        >>> import numpy as np, jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> ds = s.experimental_distribute_dataset([np.arange(4.0), np.arange(4.0, 7.0)])
        >>> [[c.tolist() for c in s.experimental_local_results(b)] for b in ds]
        [[[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0], [6.0]]]
    """

    _what = "experimental_distribute_dataset"

    def __init__(self, strategy, options):
        self._strategy = strategy
        self._options = check_options(options, self._what)
        self._topology = batching.topology(strategy)
        self._placer = Placer(strategy, self._options)
        self._lock = threading.Lock()  # iterators' threads record the first batch and the size
        self._first = None  # (treedef, [(dtype, row shape)]) of the first batch
        self._rows = None  # the static batch size: the largest batch seen
        self._padded = None  # whether batches carry row counts (decided by the first batch)
        self._batch_bytes = 0  # the first batch's host bytes (how far to read ahead)
        self._latest = None  # the latest pass's iterator
        self._resume_at = 0  # where the next pass starts (a restored position)

    def __repr__(self) -> str:
        # The public name, not the implementing class (GlobalBatchDataset is internal).
        return (f"<DistributedDataset from {self._what} over "
                f"{self._strategy.num_replicas_in_sync} replica(s)>")

    def _check(self, element, position: int):
        """One host batch checked against the first; the static size grows to fit it.

        Returns:
            ``(leaves, tree, rows)`` as ``batching.check_element`` gives them.
        """
        leaves, tree, rows = batching.check_element(element, position, self._what)
        with self._lock:
            if self._first is None:
                self._first = (tree, [(a.dtype, a.shape[1:]) for a in leaves])
                self._batch_bytes = sum(a.nbytes for a in leaves)
            else:
                batching.check_same_spec(leaves, tree, self._first, position, self._what)
            if self._rows is None or rows > self._rows:
                self._rows = rows  # a larger batch than any before: a new static size
        return leaves, tree, rows

    def _read_first(self, source):
        """``source`` with its first batch read and checked now (then put back in front)."""
        source = iter(source)
        first = next(source, END)
        if first is END:
            return source
        self._check(first, 0)
        return itertools.chain([first], source)

    def _padding(self, needed: bool) -> bool:
        """Whether this batch carries row counts: once one does, all do (one signature)."""
        if self._padded is None:
            # Counts ride along unless no batch can ever need padding, so a partial batch
            # later does not change the step's signature.
            self._padded = not (self._options.drop_remainder and self._rows % self._parts == 0)
        self._padded = self._padded or needed
        return self._padded

    @property
    def _parts(self) -> int:
        """How many replicas share one batch."""
        raise NotImplementedError

    def __iter__(self) -> DistributedIterator:
        skip, self._resume_at = self._resume_at, 0  # a restored position: the next pass's
        return self.iterator_at(skip)

    def iterator_at(self, steps: int, adopted_by=None) -> DistributedIterator:
        """A new pass that starts after its first ``steps`` elements (a restored position):
        those batches are read and checked on the host, not placed or exchanged.
        ``adopted_by``: the iterator that takes this pass over (the dataset's latest)."""
        it = self._new_iterator(steps)
        # Held (not weakly): TF's loop may drop an epoch's iterator before the save.
        self._latest = adopted_by if adopted_by is not None else it
        return it

    def latest_iterator(self):
        """The iterator of the latest pass (``None`` before the first, or once dropped)."""
        return self._latest

    # -- checkpoints: the latest pass's position (data/positions.py) ------------------------------
    def checkpoint_state(self) -> np.ndarray:
        """The position of the latest pass, or the start of the next once it has ended (TF's
        loop making an iterator per epoch: the first ``iter()`` after a restore continues)."""
        it = self.latest_iterator()
        given = self._resume_at if it is None or it.at_end() else it.given()
        return positions.state(given, self)

    def checkpoint_shape_dtype(self) -> tuple:
        return positions.SHAPE_DTYPE

    def check_checkpoint_state(self, state) -> None:
        positions.check(state, self)

    def restore_checkpoint_state(self, state) -> None:
        self._resume_at = positions.check(state, self)

    @property
    def restorable(self) -> bool:
        """Whether a pass can be read again in a new process (not a one-shot iterator)."""
        return not isinstance(getattr(self, "_factory", None), sources.OneShot)

    def _new_iterator(self, steps: int) -> DistributedIterator:
        stop, rounds = threading.Event(), None
        several = self._topology.num_workers > 1
        if several:
            # A new pass is a call every worker makes; then every step the workers agree on
            # each replica's rows and on whether any worker still has data (TF's way).
            ledger.agree(f"iter() of a DistributedDataset from {self._what}")
            rounds = StepExchange(self._what, cancelled=stop.is_set)
        threaded = self._options.prefetch_thread
        if threaded is None:
            # Several workers: the agreement waits on the network, best done ahead of the step.
            threaded = several or any(d.platform != "cpu"
                                      for d in self._strategy.extended.devices)
        if threaded:
            source = Prefetcher(self._epoch(rounds, steps),
                                self._options.experimental_per_replica_buffer_size, stop=stop)
            return DistributedIterator(self._strategy, source, self, given=steps)
        return self._inline_iterator(rounds, steps)

    def _inline_iterator(self, rounds, skip: int) -> DistributedIterator:
        """An iterator that makes each batch in ``next`` (no thread)."""
        return DistributedIterator(self._strategy, Inline(self._epoch(rounds, skip)), self,
                                   given=skip)

    @property
    def input_pipelines(self) -> tuple:
        """``(count, own)``: how many input pipelines feed this dataset, and whether each
        reads its own data (so that a position means the same data only with as many
        pipelines); the same global batches read by every worker are one pipeline."""
        return 1, False

    @staticmethod
    def _skip(read_one, skip: int) -> None:
        """Read (and drop) the items of the first ``skip`` steps."""
        next(itertools.islice(iter(read_one, END), skip, skip), None)

    @property
    def element_spec(self):
        """The structure of each replica's component: a nest of ``jax.ShapeDtypeStruct``.

        Shapes are the padded per-replica shapes the step function sees, dtypes those of the
        arrays it gets (JAX's: float64 data arrives as float32 unless x64 is enabled). Before
        the first iteration this reads the dataset's first batch.

        Example:
            >>> import numpy as np, jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> s.experimental_distribute_dataset([{"x": np.zeros((6, 3))}]).element_spec
            {'x': ShapeDtypeStruct(shape=(3, 3), dtype=float32)}
        """
        if self._first is None:
            self._peek()
            if self._first is None:
                raise ValueError(f"{self._what}: the dataset is empty, so it has no element_spec; "
                                 f"give a dataset with at least one batch.")
        tree, specs = self._first
        rows = self._rows
        if self._topology.num_replicas > 1:
            rows = batching.padded_size(rows, self._parts)
        if self._options.experimental_fetch_to_device:
            specs = [(jax.dtypes.canonicalize_dtype(dtype), shape) for dtype, shape in specs]
        return jax.tree.unflatten(tree, [jax.ShapeDtypeStruct((rows,) + shape, dtype)
                                         for dtype, shape in specs])

    def _peek(self) -> None:
        """Read the first batch (for ``element_spec``) without losing it."""
        raise NotImplementedError

    def _epoch(self, rounds, skip: int):
        """The placed batches of one epoch: a generator, run on the prefetch thread or in next.

        ``rounds`` is the pass's ``StepExchange`` with the other workers (``None`` alone);
        the first ``skip`` steps are read but not given."""
        raise NotImplementedError

    def _spec_text(self) -> str | None:
        """This worker's element structure for the others (a worker without data needs it)."""
        if self._first is None:
            return None
        tree, specs = self._first
        data = pickle.dumps((tree, [(np.dtype(d).str, tuple(shape)) for d, shape in specs]))
        return base64.b64encode(data).decode("ascii")

    def _adopt_spec(self, shared) -> None:
        """Take another worker's element structure when this worker has seen no batch."""
        if self._first is not None:
            return
        text = next((s["spec"] for s in shared if s.get("spec")), None)
        if text is not None:
            tree, specs = pickle.loads(base64.b64decode(text))
            with self._lock:
                if self._first is None:
                    self._first = (tree, [(np.dtype(d), tuple(shape)) for d, shape in specs])

    def _in_rounds(self, rounds, read_one, info):
        """This worker's items (``read_one()``, until it gives ``END``) agreed with the other
        workers' in rounds: yields ``(item, [(info or None, replicas) per worker])`` per step,
        the item ``None`` once this worker's data has ended; ends when every worker's has.

        A round agrees on several steps at once (1, then twice as many each round, up to 16
        and about 64 MB of this worker's batches read ahead): one exchange through the
        coordination service costs about a millisecond, more than a small model's step.
        """
        ahead, ended, sent_spec = 1, False, False
        while True:
            items = []
            while not ended and len(items) < ahead:
                item = read_one()
                if item is END:
                    ended = True
                else:
                    items.append(item)
            # The next round's length is agreed too: every worker reads as far ahead.
            cap = _ROUND_BYTES // max(1, self._batch_bytes)
            mine = {"steps": [info(i) for i in items], "replicas": len(self._topology.local),
                    "spec": None, "next": max(1, min(2 * ahead, _ROUND_STEPS, cap)),
                    "seen": self._rows}
            if not sent_spec and self._first is not None:
                mine["spec"], sent_spec = self._spec_text(), True
            shared = rounds.share(mine)
            if shared is None:
                return  # closed
            steps = max(len(s["steps"]) for s in shared)
            if steps == 0:
                return  # every worker's data has ended: the epoch ends everywhere
            self._adopt_spec(shared)
            # The largest batch any worker has read, skipped ones of a restored pass included.
            seen = max(s["seen"] or 0 for s in shared)
            with self._lock:
                self._rows = max(self._rows or 0, seen) or None
            self._agreed_size([i for s in shared for i in s["steps"]])
            for k in range(steps):
                yield (items[k] if k < len(items) else None,
                       [(s["steps"][k] if k < len(s["steps"]) else None, s["replicas"])
                        for s in shared])
            ahead = min(s["next"] for s in shared)

    def _agreed_size(self, infos) -> None:
        """The static size after a round agreed on ``infos`` (every worker's steps)."""
        raise NotImplementedError

    def _blank_blocks(self, size: int, replicas: int) -> list:
        """Zero-row blocks for this worker's replicas when its data has ended (only padding)."""
        return [np.zeros((replicas, size) + tuple(shape), dtype) for dtype, shape in
                self._first[1]]


class GlobalBatchDataset(DistributedDataset):
    """What ``experimental_distribute_dataset`` returns: global batches split by TF's rule.

    Args:
        strategy: the strategy to distribute over.
        dataset: the host batches (see ``sources.epoch_factory`` for what it can be).
        options: an ``InputOptions`` or ``None``.

    Raises:
        ValueError: for something that is not a dataset, or options this method refuses.
    """

    def __init__(self, strategy, dataset, options=None):
        super().__init__(strategy, options)
        what = self._what
        if self._options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            # TF's wording, on purpose.
            raise ValueError("InputReplicationMode.PER_REPLICA is only supported in "
                             "`distribute_datasets_from_function`.")
        policy = self._options.auto_shard_policy
        if policy is AutoShardPolicy.FILE and self._topology.num_workers > 1:
            raise ValueError(
                f"{what}: AutoShardPolicy.FILE needs a file-based dataset, and this one is "
                f"batches, not files; give a jaxmirror.experimental.FileDataset, use "
                f"AutoShardPolicy.DATA (or AUTO), or shard by file yourself in "
                f"`distribute_datasets_from_function`."
            )
        self._off = policy is AutoShardPolicy.OFF
        self._factory = sources.epoch_factory(dataset, what)
        self._plans = {}  # (rows, static rows) -> (size, share, row index)

    @property
    def _parts(self) -> int:
        topo = self._topology  # all replicas, or (OFF) this worker's
        return len(topo.local) if self._off and topo.num_workers > 1 else topo.num_replicas

    def _peek(self) -> None:
        self._factory = sources.peeked(self._factory, self._read_first, self._what)

    @property
    def input_pipelines(self) -> tuple:
        if self._off and self._topology.num_workers > 1:
            return self._topology.num_workers, True  # each worker's own batches
        return 1, False

    def _epoch(self, rounds, skip: int):
        return map(self._placer.place_batch, self._host_batches(rounds, skip))

    def _inline_iterator(self, rounds, skip: int) -> DistributedIterator:
        # Batches stay on the host until asked for: one at a time by ``next``, or several
        # stacked into one transfer by a fused step (``DistributedIterator.take_stacked``).
        source = Inline(self._host_batches(rounds, skip))
        return DistributedIterator(self._strategy, source, self, place=self._placer.place_batch,
                                   stack=self._placer.stack, given=skip)

    def _host_batches(self, rounds, skip: int):
        """The epoch's batches split and padded on the host (``placer.HostBatch``); the first
        is read and checked now (a bad one raises from ``iter``)."""
        source = self._read_first(self._factory())
        if rounds is None:
            return self._split_all(source, skip)
        return self._split_agreed(source, rounds, skip)

    def _reader(self, source):
        """A function giving the next checked batch ``(leaves, tree, rows)`` of ``source`` that
        is not dropped (``drop_remainder``), or ``END``."""
        source, position = iter(source), 0

        def read_one():
            nonlocal position
            for element in source:
                leaves, tree, rows = self._check(element, position)
                position += 1
                if not (rows < self._rows and self._options.drop_remainder):
                    return leaves, tree, rows
            return END
        return read_one

    def _split_all(self, source, skip: int):
        read_one = self._reader(source)
        self._skip(read_one, skip)
        for leaves, tree, rows in iter(read_one, END):
            yield self._split(tree, leaves, rows)

    def _split(self, tree, leaves, rows) -> HostBatch:
        if self._topology.num_replicas == 1:
            return HostBatch(tree, leaves, None, single=True)
        size, share, index = self._plan(rows)
        padded = self._padding(index is not None)
        blocks = [batching.local_block(a, share, size, index) for a in leaves]
        return HostBatch(tree, blocks, tuple(share.counts) if padded else None)

    def _split_agreed(self, source, rounds, skip: int):
        """``_split_all`` across workers that may read different data: every step the workers
        agree on each replica's real rows, the static size, and whether any worker still has
        a batch; one whose data has ended gets zero rows until every worker's has."""
        topo, read_plain = self._topology, self._reader(source)

        def read_one():
            item = read_plain()
            return item if item is END else item + (batching.share(item[2], topo, self._off),)

        def info(item):
            return {"counts": [item[3].counts[i] for i in topo.local], "rows": item[2]}

        self._skip(read_one, skip)
        for item, steps in self._in_rounds(rounds, read_one, info):
            counts = tuple(c for s, n in steps for c in (s["counts"] if s else [0] * n))
            size = batching.padded_size(self._rows, self._parts)
            padded = self._padding(any(c != size for c in counts))
            if item is None:  # this worker's data has ended: zero rows, padding only
                yield HostBatch(self._first[0], self._blank_blocks(size, len(topo.local)),
                                counts if padded else None)
                continue
            leaves, tree, _, sh = item
            index = batching.row_index(sh, size)
            blocks = [batching.local_block(a, sh, size, index) for a in leaves]
            yield HostBatch(tree, blocks, counts if padded else None)

    def _agreed_size(self, infos) -> None:
        """Every worker pads to the same size: the largest batch anywhere (this round's)."""
        with self._lock:
            self._rows = max([self._rows or 0] + [i["rows"] for i in infos])

    def _plan(self, rows):
        """How a batch of ``rows`` rows is split and padded (an epoch has few distinct sizes)."""
        key = (rows, self._rows)
        plan = self._plans.get(key)
        if plan is None:
            size = batching.padded_size(self._rows, self._parts)
            share = batching.share(rows, self._topology, self._off)
            plan = self._plans[key] = (size, share, batching.row_index(share, size))
        return plan
