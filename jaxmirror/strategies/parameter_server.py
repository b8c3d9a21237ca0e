"""``ParameterServerStrategy``: asynchronous training, variables on parameter servers (Ray).

The coordinator (this process) makes the strategy and a ``ClusterCoordinator``; variables made
in ``scope()`` live on parameter-server actors (round-robin, split into ``ShardedVariable``s by a
``variable_partitioner``); workers run scheduled functions independently. Inside a scheduled
function the strategy is the worker's own ``MirroredStrategy`` over its devices, so
``strategy.run`` there is the ordinary compiled step.
"""

from __future__ import annotations

import itertools
import weakref

import jax
import numpy as np

from jaxmirror.cluster_resolver.base import ClusterResolver
from jaxmirror.cluster_resolver.ray_cluster import RayClusterResolver
from jaxmirror.coordinator import nnx_binding, shipping, worker_runtime
from jaxmirror.coordinator.cluster import RayCluster
from jaxmirror.coordinator.per_worker import DistributeOnWorkers
from jaxmirror.coordinator.ps_variables import PSVariable, call_ps, ps_device
from jaxmirror.core import devices as devices_lib
from jaxmirror.strategies.extended import StrategyExtended
from jaxmirror.strategies.mirrored import MirroredStrategy
from jaxmirror.step.graphs import is_graph_node
from jaxmirror.strategies.strategy import Strategy
from jaxmirror.variables import creation
from jaxmirror.variables.partitioners import num_shards, shard_sizes
from jaxmirror.variables.sharded import ShardedVariable
from jaxmirror.variables.variable import Variable


class WorkerStrategy(MirroredStrategy):
    """What ``ParameterServerStrategy`` is inside a scheduled function: a ``MirroredStrategy``
    over the worker's devices whose ``run`` finds the program of a function made anew on each
    call (TF's ``def replica_fn`` inside the scheduled function) again.

    Programs are kept by function; a nested function is a new object on every call of its
    outer function, and would be traced and compiled every time. Two functions with the same
    code, the same captured objects (by identity), globals and defaults trace to the same
    program, so ``run`` takes the first one seen for all of them (at most ``MAX_KEPT`` kept).

    Args:
        devices: the worker's devices.

    Example:
        >>> s = WorkerStrategy(["CPU:0"])
        >>> def outer(x):
        ...     def replica_fn(v):
        ...         return v * 2
        ...     return s.run(replica_fn, args=(x,))
        >>> float(outer(1.0)), float(outer(2.0)), len(s._same_code)
        (2.0, 4.0, 1)
    """

    MAX_KEPT = 256

    def __init__(self, devices=None):
        super().__init__(devices)
        self._same_code: dict = {}

    def run(self, fn, *args, **kwargs):
        """``MirroredStrategy.run``, with ``fn`` replaced by the first function seen with the
        same code and captures.

        Args:
            fn: the per-replica function.
            *args, **kwargs: as ``MirroredStrategy.run`` (``args``, ``kwargs``, ``options``).

        Returns:
            As ``MirroredStrategy.run``.
        """
        code = getattr(fn, "__code__", None)
        if code is not None and code.co_flags & 0x10:  # CO_NESTED: made anew by its outer call
            key = (code, id(fn.__globals__), fn.__defaults__ and tuple(map(id, fn.__defaults__)),
                   tuple(id(c.cell_contents) for c in fn.__closure__ or ()))
            kept = self._same_code.get(key)
            if kept is None:
                if len(self._same_code) >= self.MAX_KEPT:
                    self._same_code.pop(next(iter(self._same_code)))
                kept = self._same_code[key] = (fn, fn.__closure__)  # holds what the ids name
            fn = kept[0]
        return super().run(fn, *args, **kwargs)


def worker_strategy_factory():
    """A worker's own strategy: one replica per local device (what the strategy is inside a
    scheduled function).

    Returns:
        A ``WorkerStrategy``.

    Example:
        >>> worker_strategy_factory().num_replicas_in_sync >= 1
        True
    """
    return WorkerStrategy(devices_lib.default_local_devices())


def _counts(resolver) -> tuple:
    if isinstance(resolver, RayClusterResolver):
        return resolver.num_workers, resolver.num_ps
    if not isinstance(resolver, ClusterResolver):
        raise ValueError(f"ParameterServerStrategy: `cluster_resolver` must be a "
                         f"ClusterResolver (RayClusterResolver, TFConfigClusterResolver, "
                         f"SimpleClusterResolver), got {type(resolver).__name__}.")
    spec = resolver.cluster_spec()
    jobs = spec.jobs
    if "worker" not in jobs or "ps" not in jobs:
        # TF's words
        raise ValueError(f"ParameterServerStrategy: `cluster_resolver` must have worker and "
                         f"ps jobs in its cluster spec, got jobs {sorted(jobs)}.")
    return spec.num_tasks("worker"), spec.num_tasks("ps")


class ParameterServerExtended(StrategyExtended):
    """``ParameterServerStrategy``'s extended: the Ray cluster, variable placement.

    Args:
        strategy: the strategy.
        cluster: its ``RayCluster``.
        partitioner: the variable partitioner, or ``None``.
        replicas: replicas in sync on each worker.
    """

    def __init__(self, strategy, cluster: RayCluster, partitioner, replicas: int):
        super().__init__(strategy, [jax.local_devices()[0]], distributed_variables=False)
        self.ray_cluster = cluster
        self.coordinator = None  # the ClusterCoordinator, once made
        self.nnx_bundles: list = []  # the NNX objects of ``init`` (``coordinator.nnx_binding``)
        self.nnx_inits = 0  # how many ``init`` calls bound NNX objects (never goes down)
        self._partitioner = partitioner
        self._replicas = replicas
        self._next_ps = itertools.cycle(range(len(cluster.ps)))
        self._ids = itertools.count()

    @property
    def variable_partitioner(self):
        """The strategy's ``variable_partitioner`` (``None``: variables are not split)."""
        return self._partitioner

    @property
    def variable_creator(self):
        """Makes ``PSVariable``s (and ``ShardedVariable``s of them) on the parameter servers."""
        return self._create

    @property
    def parameter_devices(self) -> tuple:
        """The parameter servers' device names."""
        return tuple(ps_device(i) for i in range(len(self.ray_cluster.ps)))

    @property
    def worker_devices(self) -> tuple:
        """The workers' device names (one per replica of each worker)."""
        kind = "GPU" if self._replicas > 1 or _gpus(self) else "CPU"
        return tuple(f"/job:worker/replica:0/task:{w}/device:{kind}:{d}"
                     for w in range(self.ray_cluster.num_workers) for d in range(self._replicas))

    def _create(self, initial_value, trainable, synchronization, aggregation, dtype, name):
        name = "Variable" if name is None else str(name)
        trainable = creation.checked_trainable(trainable, synchronization, name)
        value = np.asarray(creation.initial_array(initial_value, dtype, name))
        shards = 1 if self._partitioner is None else num_shards(self._partitioner, value.shape,
                                                                 value.dtype)
        make = lambda part, part_name: self._place(part, part_name, trainable,  # noqa: E731
                                                   synchronization, aggregation)
        if shards == 1:
            return make(value, name)
        rows = np.cumsum(shard_sizes(value.shape[0], shards))[:-1]
        parts = np.split(value, rows, axis=0)
        return ShardedVariable([make(p, f"{name}/part_{i}") for i, p in enumerate(parts)],
                               name=name)

    def _place(self, value, name, trainable, synchronization, aggregation):
        ps_index = next(self._next_ps)  # TF: round-robin over the parameter servers
        spec = shipping.VariableSpec(next(self._ids), ps_index, tuple(value.shape),
                                     np.dtype(value.dtype).name, name, trainable,
                                     aggregation.value, synchronization.value)
        ps = self.ray_cluster.ps[ps_index]
        call_ps(ps_index, ps.create.remote([(spec.var_id, value)]), f"creating {name!r}")
        return PSVariable(self._container_strategy_ref, spec, ps)


def _gpus(extended) -> int:
    return int((extended.ray_cluster.worker_options.get("num_gpus") or 0))


class ParameterServerStrategy(Strategy):
    """Asynchronous parameter-server training (``tf.distribute.experimental.
    ParameterServerStrategy``), on Ray actors.

    Use it with a ``ClusterCoordinator``: variables made in ``scope()`` live on the parameter
    servers, round-robin (a ``variable_partitioner`` splits big ones into ``ShardedVariable``s
    along axis 0); scheduled functions run on the workers, each with its own copy of the
    variables it uses, read at its start; ``assign_add``/``assign_sub`` made there are added to
    the parameter server's current value at its end (so asynchronous SGD written as
    ``v.assign_sub(lr * g)`` loses no update) and ``assign`` overwrites.

    Inside a scheduled function this object is the worker's own ``MirroredStrategy`` (one
    replica per device of the worker; one replica on a CPU worker): ``strategy.run`` compiles the
    step once per worker.

    Args:
        cluster_resolver: a ``RayClusterResolver``, or a resolver whose cluster spec has
            ``worker`` and ``ps`` jobs (their task counts decide the actors, on the Ray cluster
            this process is connected to, or a local one).
        variable_partitioner: ``None`` (no sharding), a partitioner from
            ``jaxmirror.experimental.partitioners``, or a function ``(shape, dtype) -> list``.

    Raises:
        ValueError: for a resolver without ``worker`` and ``ps`` jobs.
        TimeoutError: when a local Ray node did not start in time
            (on a busy machine give it longer: ``RayClusterResolver(startup_timeout_seconds=)``).

    Example:
        >>> import jaxmirror                                                 # doctest: +SKIP
        >>> resolver = jaxmirror.cluster_resolver.RayClusterResolver(2, 1)   # doctest: +SKIP
        >>> strategy = jaxmirror.experimental.ParameterServerStrategy(resolver)  # doctest: +SKIP
        >>> with strategy.scope():                                          # doctest: +SKIP
        ...     counter = jaxmirror.Variable(0.0)
        >>> coordinator = jaxmirror.experimental.coordinator.ClusterCoordinator(strategy)  # doctest: +SKIP
        >>> for _ in range(30):                                              # doctest: +SKIP
        ...     coordinator.schedule(lambda: counter.assign_add(1.0))
        >>> coordinator.join(); float(counter.numpy())                      # doctest: +SKIP
        30.0
    """

    def __init__(self, cluster_resolver, variable_partitioner=None):
        num_workers, num_ps = _counts(cluster_resolver)
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise ValueError(f"ParameterServerStrategy: `variable_partitioner` must be a "
                             f"partitioner, a function or None, got "
                             f"{type(variable_partitioner).__name__}.")
        if not isinstance(cluster_resolver, RayClusterResolver):
            cluster_resolver = RayClusterResolver(num_workers, num_ps)
        worker_options = cluster_resolver.worker_resources or {}
        cluster = RayCluster(num_workers, num_ps, worker_options, cluster_resolver.ps_resources,
                             worker_strategy_factory)
        cluster_resolver.adopt(cluster)
        self._resolver = cluster_resolver
        replicas = max(1, int(worker_options.get("num_gpus") or 0))
        super().__init__(ParameterServerExtended(self, cluster, variable_partitioner, replicas))
        # A strategy nobody refers to any more (a re-run notebook cell) frees its actors.
        weakref.finalize(self, cluster.close).atexit = False

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas that run each step together: the devices of one worker (TF's rule)."""
        return self.extended._replicas

    @property
    def cluster_resolver(self):
        """The ``RayClusterResolver``."""
        return self._resolver

    def run(self, fn, args=(), kwargs=None, options=None):
        """Only inside a function passed to ``ClusterCoordinator.schedule`` (on a worker).

        Raises:
            RuntimeError: always, on the coordinator.
        """
        raise RuntimeError("ParameterServerStrategy.run: call it inside a function passed to "
                           "ClusterCoordinator.schedule, which runs it on a worker.")

    def function(self, fn=None, *, donate_argnums=(), steps_per_execution=None,
                 carry_argnums=()):
        """Not for the coordinator: schedule plain functions (TF needs a ``tf.function``;
        jaxmirror compiles ``strategy.run`` inside them, once per worker).

        Raises:
            ValueError: always, saying what to write instead.
        """
        raise ValueError(
            "ParameterServerStrategy.function: pass the plain Python function to "
            "ClusterCoordinator.schedule (where TF code has @tf.function, write nothing); "
            "strategy.run(replica_fn, args=...) inside it is compiled once per worker.")

    def init(self, fn, *args, **kwargs):
        """Build a model's state on the parameter servers (what ``scope()`` does for a Keras
        model's variables in TF).

        ``fn(*args, **kwargs)`` runs here, on the coordinator. The NNX objects it returns (a
        model, its ``nnx.Optimizer``, built together so shared parts stay shared) come back as
        NNX objects whose numeric state lives in parameter-server variables (split by the
        strategy's partitioner; PRNG keys stay with each worker). In a scheduled function they
        are the worker's copies: loaded from the parameter servers as the function starts, and
        what the function changed (``optimizer.update(model, grads)``, BatchNorm statistics)
        sent back as differences when it ends, so concurrent steps add up and each closure's
        changes land exactly once. The coordinator's objects get the servers' values at every
        ``ClusterCoordinator.join()``; changes made to them here (a restored checkpoint) go to
        the servers at the next ``schedule`` or ``join()``. Other arrays
        ``fn`` returns (a Linen model's params) come back as parameter-server variables.

        Args:
            fn: builds the objects (``lambda: (m := Model(rngs=nnx.Rngs(0)),
                nnx.Optimizer(m, optax.adam(1e-3), wrt=nnx.Param))``).
            *args: ``fn``'s positional arguments.
            **kwargs: its keyword arguments.

        Returns:
            What ``fn`` returns, its state on the parameter servers.

        Example:
            (a Ray cluster; see the class example)
            >>> ParameterServerStrategy.init.__name__
            'init'
        """
        built = fn(*args, **kwargs)
        nnx_binding.bind(self, built)
        with self.scope():
            return jax.tree.map(
                lambda x: Variable(np.asarray(x)) if isinstance(x, (jax.Array, np.ndarray))
                else x, built, is_leaf=is_graph_node)

    def experimental_distribute_dataset(self, dataset, options=None):
        """A dataset to distribute on each worker: pass it to
        ``coordinator.create_per_worker_dataset``.

        Args:
            dataset: the dataset (each worker reads all of it unless it is sharded).
            options: ``InputOptions`` or ``None``.

        Returns:
            A ``DistributeOnWorkers``.
        """
        return DistributeOnWorkers("experimental_distribute_dataset", dataset, options)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """Like ``experimental_distribute_dataset``, from a function of an ``InputContext``.

        Args:
            dataset_fn: the dataset function.
            options: ``InputOptions`` or ``None``.

        Returns:
            A ``DistributeOnWorkers``.
        """
        return DistributeOnWorkers("distribute_datasets_from_function", dataset_fn, options)

    def __reduce__(self):
        if shipping.shipping():  # inside a scheduled function: the worker's own strategy
            return (worker_runtime.worker_strategy, ())
        raise TypeError("ParameterServerStrategy cannot be pickled or copied.")

    def __deepcopy__(self, memo):
        raise TypeError("ParameterServerStrategy cannot be copied: it owns a Ray cluster.")

    def _display_items(self) -> list:
        """What the rich display shows: the cluster, then each worker's replicas."""
        cluster = self.extended.ray_cluster
        return [("workers", cluster.num_workers), ("parameter servers", len(cluster.ps)),
                ("replicas per worker", self.num_replicas_in_sync),
                ("variable partitioner", self.extended.variable_partitioner),
                ("cluster", "shut down" if cluster.closed else "running (Ray actors)")]

    def __repr__(self) -> str:
        cluster = self.extended.ray_cluster
        return (f"<ParameterServerStrategy: {cluster.num_workers} worker(s), {len(cluster.ps)} "
                f"parameter server(s), {self.num_replicas_in_sync} replica(s) per worker>")
