"""``Strategy``: one class for every strategy; strategies differ only in their ``extended``."""

from __future__ import annotations

import contextlib
import copy

import jax

from jaxmirror.core import _compat, context, inflight, rich_display
from jaxmirror.step import cross_replica
from jaxmirror.step.program import Program
from jaxmirror.step.fused import FusedStep
from jaxmirror.step.program import Step
from jaxmirror.step.program import ProgramCache
from jaxmirror.step.program import RunOptions
from jaxmirror.strategies.extended import StrategyExtended
from jaxmirror.strategies.input_methods import InputMethods

_NOT_GIVEN = object()
_DEFAULT_OPTIONS = RunOptions()


class Strategy(InputMethods):
    """A way to run a computation on several devices (``tf.distribute.Strategy``).

    Use a concrete strategy: ``MirroredStrategy`` or ``OneDeviceStrategy``. Write the step for
    one replica and let ``run`` compile it once for all of them. The input methods
    (``experimental_distribute_dataset`` and the rest) are ``InputMethods``'.

    Args:
        extended: the strategy's ``StrategyExtended``.

    Example:
        >>> import jax.numpy as jnp, jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> @s.run
        ... def step(x):
        ...     return jaxmirror.get_replica_context().all_reduce("sum", x)
        >>> float(step(jnp.float32(1.5)))
        3.0
    """

    def __init__(self, extended: StrategyExtended):
        self._extended = extended
        self._programs = ProgramCache(self)

    # -- properties -------------------------------------------------------------------------
    @property
    def extended(self) -> StrategyExtended:
        """The ``StrategyExtended`` with the additional, lower-level APIs."""
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run each step together."""
        return self._extended.placement.num_replicas

    @property
    def cluster_resolver(self):
        """The strategy's cluster resolver; ``None`` for the one-machine strategies
        (``MultiWorkerMirroredStrategy`` has one)."""
        return None

    # -- contexts ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self):
        """Make this strategy current: ``get_strategy()`` returns it, and we are in cross-replica context.

        Re-entering the same strategy's scope (also from inside ``run``) changes nothing; entering
        another strategy's scope inside this one raises.

        Returns:
            A context manager.

        Raises:
            RuntimeError: when another strategy is current ("Mixing different ... Strategy objects").

        Example:
            >>> import jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> with s.scope():
            ...     jaxmirror.get_strategy() is s, jaxmirror.in_cross_replica_context()
            (True, True)
        """
        entry = context.current()
        if entry.strategy is self:
            new = entry  # TF's "same scope again": nothing changes
        elif entry.strategy is context.default_strategy():
            new = context.Entry(self, None)
        else:
            raise context.mixing_error(entry.strategy, self)
        with context.pushed(new):
            yield self

    # -- run ----------------------------------------------------------------------------------
    def _program(self, fn, options: RunOptions) -> Program:
        """``fn``'s compiled program, kept as long as ``fn`` lives (``ProgramCache``)."""
        if isinstance(fn, Step):  # an already decorated step: its function's program
            fn = fn.fn
        return self._programs.get(fn, options.donate_argnums)

    def run(self, fn, args=_NOT_GIVEN, kwargs=None, options=None):
        """Run ``fn`` on every replica, or, used as a decorator, make a step that does.

        ``fn`` is written for one replica and traced once for all of them (SPMD): Python side
        effects in it happen once per trace, not once per replica, and it is compiled once per
        input signature. Inside, ``get_replica_context()`` gives the replica's id and collectives.

        * ``strategy.run(fn, args=(), kwargs=None, options=None)`` runs now, as in TF.
        * ``@strategy.run`` on a function with at least one required positional parameter returns
          a step ``step(*args, **kwargs)`` that runs it on every replica (a function without one
          runs at once, as in TF). ``strategy.function(fn)`` makes a step whatever the signature.

        Arguments: ``PerReplica`` values give each replica its own component; arrays, Python
        numbers and Mirrored values go whole to every replica; nests keep their structure.
        Results: values that differ across replicas come back as ``PerReplica``; values that are
        provably identical on every replica (computed from replicated inputs, constants and
        all-reduced or all-gathered values) come back as plain ``jax.Array``s replicated over the
        devices (Mirrored). With one replica results are plain values. Gradients taken inside
        ``fn`` are per-replica: all-reduce them to combine.

        Args:
            fn: the per-replica function.
            args: a tuple or list of positional arguments.
            kwargs: a dict of keyword arguments.
            options: a ``RunOptions``.

        Returns:
            The merged results of ``fn``; or, in the decorator form, the step callable.

        Raises:
            ValueError: when ``args`` is not a list or tuple.
            RuntimeError: inside another ``run``, or inside another strategy's scope.

        Example:
            >>> import jax.numpy as jnp, jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> def fn(x):
            ...     return x * (jaxmirror.get_replica_context().replica_id_in_sync_group + 1)
            >>> out = s.run(fn, args=(jnp.float32(2),))
            >>> [float(v) for v in s.experimental_local_results(out)]
            [2.0, 4.0]
        """
        if args is not _NOT_GIVEN and not isinstance(args, (list, tuple)):
            # TF's wording, on purpose (also for kwargs).
            raise ValueError(f"positional args must be a list or tuple, got {type(args)}.")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError(f"kwargs must be a dict, got {type(kwargs)}.")
        if options is not None and not isinstance(options, RunOptions):
            raise ValueError(f"run: `options` must be a jaxmirror.RunOptions or None; got "
                             f"{type(options)}.")
        program = self._program(fn, options or _DEFAULT_OPTIONS)
        if args is _NOT_GIVEN:
            if kwargs is None and options is None and program.wants_arguments:
                return Step(program, fn)  # the decorator form
            args = ()
        return program(*args, **(kwargs or {}))

    def function(self, fn=None, *, donate_argnums=(), steps_per_execution=None,
                 carry_argnums=()):
        """Compile ``fn`` into a step that runs it on every replica when called.

        The step shares ``run``'s compiled-program cache: ``step(*args)`` and
        ``strategy.run(fn, args)`` use the same program. It composes with ``jax.jit``,
        ``jax.lax.scan`` and ``jax.grad``. ``step.trace_count`` counts how often ``fn`` was
        traced and ``step.compile_count`` how often a program was built for it: JAX builds a
        second one when only the inputs' placement changed (host arrays on the first call,
        mesh-replicated outputs after it) without tracing ``fn`` again. Place initial params
        with ``jax.device_put(params, strategy.extended.replicated_sharding)`` to build one.

        Args:
            fn: the per-replica function; omitted, ``function`` returns a decorator.
            donate_argnums: positional arguments whose buffers the outputs may reuse.
            steps_per_execution: ``None``, or an int K: the step is called as
                ``step(iterator, *args)`` and runs ``fn(element, *args)`` on the next K
                elements of ``iterator`` in one compiled program, results stacked along a new
                leading axis (see ``FusedStep``; Keras's ``steps_per_execution``). A call
                returns once its steps have run; when one fails (a raising callback, an XLA
                error) the call raises, the variables and NNX objects keep their values, and
                the K elements go back into a distributed iterator: the next call retries
                them (``next(iterator)`` K times skips them); the error's note says how many.
                Arguments it donated are used up by a failed program (keep a copy to retry).
            carry_argnums: with ``steps_per_execution``: positions of ``fn``'s arguments that
                it returns updated, first (``return params, opt_state, loss``), carried from
                step to step.

        Returns:
            The step callable (a ``FusedStep`` with ``steps_per_execution``).

        Example:
            >>> import jax.numpy as jnp, jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> step = s.function(lambda: jaxmirror.get_replica_context().all_reduce("sum", 1))
            >>> int(step())
            2
        """
        options = RunOptions(donate_argnums=donate_argnums)
        if steps_per_execution is not None:
            def make(f):
                return FusedStep(self, f, steps_per_execution,
                                 lambda g, donated: self._program(g, RunOptions(donated)),
                                 options.donate_argnums, carry_argnums)
        else:
            if carry_argnums:
                raise ValueError("function: `carry_argnums` is for fused steps; give "
                                 "`steps_per_execution` too.")

            def make(f):
                return Step(self._program(f, options), f)
        return make if fn is None else make(fn)

    # -- cross-replica ------------------------------------------------------------------------
    def reduce(self, reduce_op, value, axis=None):
        """Reduce ``value`` across replicas (and along ``axis``, if given) in cross-replica context.

        ``axis=None`` combines the replicas' components. With ``axis=k`` each replica's component
        is first summed along ``k``; MEAN then divides by the number of elements along ``k`` over
        all replicas. A Mirrored value counts as N identical components (SUM gives N times it).
        A non-distributed value is returned for MEAN and refused for SUM (with an axis it counts
        as copied to every replica).

        Args:
            reduce_op: ``ReduceOp.SUM`` or ``ReduceOp.MEAN``, or their names in any case.
            value: a ``PerReplica``/Mirrored value, an array, or a nest of them.
            axis: ``None`` or the component axis to reduce along too (negative allowed).

        Returns:
            The reduced value (a nest like ``value``).

        Raises:
            ValueError: for a bad reduce op or axis, or a non-distributed value with SUM.
            RuntimeError: in a replica context (inside ``run``).

        Example:
            >>> import jax.numpy as jnp, jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> v = s.experimental_distribute_values_from_function(
            ...     lambda ctx: jnp.arange(2.0) + ctx.replica_id_in_sync_group)
            >>> s.reduce("sum", v, axis=None).tolist()
            [1.0, 3.0]
            >>> float(s.reduce("mean", v, axis=0))
            1.0
        """
        return inflight.tracked(self._extended.placement,
                                cross_replica.reduce(self, reduce_op, value, axis))

    def gather(self, value, axis):
        """Concatenate the components of ``value`` along ``axis`` (cross-replica context).

        Args:
            value: a ``PerReplica``/Mirrored value (components of rank >= 1) or a nest of them.
            axis: the component axis to concatenate along.

        Returns:
            The concatenation, in replica order.

        Raises:
            ValueError: for scalar components or an ``axis`` outside their rank.
            RuntimeError: in a replica context.

        Example:
            >>> import jax.numpy as jnp, jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> v = s.experimental_distribute_values_from_function(
            ...     lambda ctx: jnp.full((1, 2), ctx.replica_id_in_sync_group))
            >>> s.gather(v, axis=0).tolist()
            [[0, 0], [1, 1]]
        """
        return inflight.tracked(self._extended.placement, cross_replica.gather(self, value, axis))

    def experimental_local_results(self, value) -> tuple:
        """The components of ``value`` held by this process, one per local replica.

        Args:
            value: a value returned by ``run``, a distributed value, or a nest of them.

        Returns:
            A tuple with one entry per local replica (for a nest: a tuple of nests); a value that
            is not distributed gives ``(value,)``.

        Example:
            >>> import jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> v = s.experimental_distribute_values_from_function(
            ...     lambda ctx: {"a": ctx.replica_id_in_sync_group})
            >>> [int(r["a"]) for r in s.experimental_local_results(v)]
            [0, 1]
            >>> s.experimental_local_results(5)
            (5,)
        """
        return cross_replica.local_results(self, value)

    def update_config_proto(self, config=None) -> dict:
        """The JAX/XLA settings this strategy runs with, added to ``config`` (a dict).

        TF returns an updated ``ConfigProto``; JAX has none, so this gives the settings as a
        dict: the ``jax.distributed`` parameters (coordinator address, process id and count),
        the CPU collectives implementation and the replicas' devices, for logging or for
        configuring other tools alike.

        Args:
            config: a dict (or ``None``) to update; it is not modified.

        Returns:
            A new dict.

        Example:
            >>> import jaxmirror
            >>> cfg = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"]).update_config_proto()
            >>> cfg["num_processes"], cfg["devices"]
            (1, ['/job:localhost/replica:0/task:0/device:CPU:0', '/job:localhost/replica:0/task:0/device:CPU:1'])
        """
        out = dict(config or {})
        out.update(
            coordinator_address=_compat.distributed_coordinator_address(),
            num_processes=jax.process_count(), process_id=jax.process_index(),
            jax_cpu_collectives_implementation=jax.config.jax_cpu_collectives_implementation,
            devices=list(self._extended.worker_devices))
        return out

    # -- copies (TF: a strategy is deep-copied, never shallow-copied) -------------------------
    def _constructor_args(self) -> tuple:
        """What ``copy.deepcopy`` passes to the constructor of the copy (each strategy's own)."""
        raise RuntimeError(f"{type(self).__name__} cannot be copied.")

    def __copy__(self):
        # TF's words: a shallow copy would share the extended and its programs.
        raise RuntimeError("Must only deepcopy DistributionStrategy.")

    def __deepcopy__(self, memo):
        """A new strategy of the same kind over the same devices (and cluster); the copy has
        its own programs, and the variables made in this one's scope stay this one's."""
        placement = self._extended.placement
        for device in placement.devices + placement.parameter_devices:
            memo[id(device)] = device  # devices are the machine's: shared, never copied
        return type(self)(*copy.deepcopy(self._constructor_args(), memo))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} with {self.num_replicas_in_sync} replica(s)>"

    def _repr_html_(self) -> str | None:
        # Jupyter's rich display: what the strategy runs on, one property per row.
        return rich_display.safe_html(lambda: rich_display.property_table(
            type(self).__name__, self._display_items()))

    def _display_items(self) -> list:
        """What the rich display shows: ``(property, value)`` pairs (replicas, devices, mesh,
        workers, where variables live, the cross-device ops); strategies add their own."""
        placement = self.extended.placement
        workers = len({d.process_index for d in placement.devices})
        storage = (f"on {rich_display.device_list(placement.parameter_devices)} (central "
                   f"storage)" if placement.central else
                   "a copy on every replica's device" if placement.num_replicas > 1 else
                   "on the one device")
        return [("replicas in sync", self.num_replicas_in_sync),
                ("devices", rich_display.device_list(placement.devices)),
                ("mesh", ", ".join(f"{k}: {v}" for k, v in placement.mesh.shape.items())),
                ("workers", workers),
                ("variables", storage),
                ("cross-device ops", self.extended.cross_device_ops)]
