"""``ClusterCoordinator``: schedule functions onto parameter-server workers (TF's name)."""

from __future__ import annotations

import contextlib
import itertools
import threading
import uuid
import weakref

import jax

from jaxmirror.coordinator import nnx_binding, shipping
from jaxmirror.coordinator.dispatch import Closure, Dispatcher
from jaxmirror.coordinator.per_worker import PerWorkerDataset
from jaxmirror.coordinator.remote_value import RemoteValue

class ClusterCoordinator:
    """Schedule functions onto the workers of a ``ParameterServerStrategy``
    (``tf.distribute.experimental.coordinator.ClusterCoordinator``).

    The process that makes it (often a notebook) is the coordinator: ``schedule`` queues a
    function and returns a ``RemoteValue`` at once; free workers run queued functions, each
    reading the parameter-server variables it uses at its start and sending its changes at its
    end; ``join()`` waits for all. One coordinator per strategy: making another returns it.

    Failures, as TF's, with one promise more:

    * A function that raises: queued functions are cancelled, running ones waited out, and the
      error (original type and message, the worker's traceback as a note) is raised by the next
      ``join()``, ``done()`` or ``schedule()``, then cleared: the coordinator works on.
    * A worker process that dies: its functions re-run on a replacement worker (per-worker
      iterators made again there). Parameter servers apply each function's changes at most
      once, so every function has exactly one effect (TF promises at least one).
    * A parameter server that dies: ``join()``/``fetch()`` raise ``UnavailableError`` naming it.

    Args:
        strategy: a ``ParameterServerStrategy``.
        max_in_flight: calls submitted to each worker at once (more than one lets a worker
            start the next call without waiting for the coordinator).
        max_closures_per_call: when functions wait in the queue, up to this many go to a
            worker in one call (shared fairly among the workers), run there one after another:
            Ray's per-call costs are paid once for them. Nothing else changes.
        fresh_reads: ``True`` (TF's behaviour): every function starts from the parameter
            servers' values and sends its changes when it ends. ``False``: the functions of
            one call send their changes together when the call ends, one message per
            parameter server (each function's changes still apply once, on their own), and
            each starts from the values the one before it left: its own worker's changes but
            not other workers' since the call began. Fewer messages (several times the
            closures per second, see ``benchmarks/RESULTS.md``), but staler reads: like
            having ``max_closures_per_call`` times the workers, so async SGD may need a
            smaller learning rate.

    Raises:
        ValueError: when ``strategy`` is not a ``ParameterServerStrategy``.

    Example:
        (a Ray cluster; see ``jaxmirror.experimental.ParameterServerStrategy``)
        >>> ClusterCoordinator.__name__
        'ClusterCoordinator'
    """

    def __new__(cls, strategy, max_in_flight: int = 2, max_closures_per_call: int = 8,
                fresh_reads: bool = True):
        cluster = getattr(getattr(strategy, "extended", None), "ray_cluster", None)
        if cluster is None:
            raise ValueError(f"ClusterCoordinator: `strategy` must be a "
                             f"ParameterServerStrategy, got {type(strategy).__name__}.")
        for name, value in (("max_in_flight", max_in_flight),
                            ("max_closures_per_call", max_closures_per_call)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ClusterCoordinator: `{name}` must be an integer >= 1, got "
                                 f"{value!r}.")
        if not isinstance(fresh_reads, bool):
            raise TypeError(f"ClusterCoordinator: `fresh_reads` must be True or False, got "
                            f"{fresh_reads!r}.")
        settings = (max_in_flight, max_closures_per_call, fresh_reads)
        existing = strategy.extended.coordinator
        if existing is not None:
            if existing._settings != settings:
                names = ("max_in_flight", "max_closures_per_call", "fresh_reads")
                raise ValueError(
                    f"ClusterCoordinator: this strategy already has a coordinator, made with "
                    f"{dict(zip(names, existing._settings))}; got {dict(zip(names, settings))}. "
                    f"A strategy has one coordinator: use that one.")
            return existing
        self = super().__new__(cls)
        self._strategy = strategy
        self._settings = settings
        self._dispatcher = Dispatcher(cluster, *settings)
        weakref.finalize(self, self._dispatcher.close).atexit = False  # its thread ends too
        self._functions: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._ids = itertools.count()
        self._base = (uuid.uuid4().int >> 80) << 40  # ids of another coordinator never collide
        self._lock = threading.Lock()
        self._checked: dict = {}  # function id -> NNX bundles the strategy had at its check
        strategy.extended.coordinator = self
        return self

    @property
    def strategy(self):
        """The ``ParameterServerStrategy`` it schedules for."""
        return self._strategy

    def _shipped_function(self, fn) -> tuple:
        try:
            cached = self._functions.get(fn)
        except TypeError:  # not weakly referable: shipped every time
            cached = None
        if cached is None:
            cached = (next(self._ids), shipping.ship(fn, self._strategy))
            try:
                self._functions[fn] = cached
            except TypeError:
                pass
        return cached

    def schedule(self, fn, args=None, kwargs=None) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` to run on a worker; return at once.

        ``fn`` is any Python function (TF needs a ``tf.function``). It is pickled once (the
        first time it is scheduled) and kept by each worker, so it compiles once per worker.
        Inside, ``strategy.run`` runs on the worker's devices, and per-worker iterators passed
        or captured are the worker's own.

        Args:
            fn: the function.
            args: a tuple or list of positional arguments (arrays, numbers, per-worker values;
                not ``RemoteValue``s).
            kwargs: a dict of keyword arguments.

        Returns:
            A ``RemoteValue``.

        Raises:
            The pending error of an earlier function (then cleared). ``TypeError`` for a
            non-callable ``fn`` or bad ``args``/``kwargs``; ``ValueError`` for a
            ``RemoteValue`` argument.
        """
        if not callable(fn):
            raise TypeError(f"ClusterCoordinator.schedule: `fn` must be callable, got "
                            f"{type(fn).__name__}.")
        if args is not None and not isinstance(args, (tuple, list)):
            raise TypeError(f"ClusterCoordinator.schedule: `args` must be a tuple or list, "
                            f"got {type(args).__name__}.")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"ClusterCoordinator.schedule: `kwargs` must be a dict, got "
                            f"{type(kwargs).__name__}.")
        if self._strategy.extended.ray_cluster.closed:
            raise RuntimeError("ClusterCoordinator.schedule: the strategy's cluster was shut down "
                               "(resolver.shutdown()); make a new resolver and strategy.")
        self._dispatcher.done()  # raises a pending error first, as TF's schedule does
        nnx_binding.before_schedule(self._strategy)
        fn_id, fn_ship = self._shipped_function(fn)
        args_ship = shipping.ship((tuple(args or ()), dict(kwargs or {})), self._strategy)
        inits = nnx_binding.init_count(self._strategy)
        if self._checked.get(fn_id, 1) < inits:  # a strategy.init since: still current?
            nnx_binding.warn_if_superseded(self._strategy, fn_ship.variables, fn)
        self._checked[fn_id] = inits
        var_ids = sorted(set(fn_ship.variables) | set(args_ship.variables))
        value = RemoteValue()
        with self._lock:
            closure_id = self._base + next(self._ids)
        self._dispatcher.put(Closure(closure_id, fn_id, fn_ship.blob, args_ship.blob, var_ids,
                                     value))
        return value

    def join(self) -> None:
        """Wait for every scheduled function; raise the first error among them (then cleared).

        The NNX objects of ``strategy.init`` get the parameter servers' values.

        Returns:
            ``None``.
        """
        try:
            self._dispatcher.join()
        except BaseException:
            # The closures that did finish count: the objects get their results too, unless
            # the servers cannot be read (then the closure's error is the one to see).
            with contextlib.suppress(Exception):
                nnx_binding.after_join(self._strategy)
            raise
        nnx_binding.after_join(self._strategy)

    def done(self) -> bool:
        """Whether every scheduled function has finished (raises a pending error, cleared).

        Returns:
            A bool.
        """
        return self._dispatcher.done()

    def fetch(self, val):
        """``RemoteValue.fetch()`` of every ``RemoteValue`` in the structure ``val``.

        Args:
            val: a ``RemoteValue`` or a nested structure (list, tuple, dict) holding them.

        Returns:
            The same structure with results in their place.
        """
        return jax.tree.map(lambda v: v.fetch() if isinstance(v, RemoteValue) else v, val,
                            is_leaf=lambda v: isinstance(v, RemoteValue))

    def create_per_worker_dataset(self, dataset_fn) -> PerWorkerDataset:
        """A dataset made on every worker; ``iter()`` it for per-worker iterators.

        Args:
            dataset_fn: a function returning the worker's dataset (given an ``InputContext``
                with the worker's index if it takes one argument), or the result of
                ``strategy.experimental_distribute_dataset`` / ``distribute_datasets_from_function``.

        Returns:
            A ``PerWorkerDataset``.
        """
        return PerWorkerDataset(dataset_fn, self._strategy.extended.ray_cluster.num_workers,
                                self._strategy.num_replicas_in_sync)

    def __repr__(self) -> str:
        cluster = self._strategy.extended.ray_cluster
        return (f"<ClusterCoordinator: {cluster.num_workers} worker(s), {len(cluster.ps)} "
                f"parameter server(s)>")
