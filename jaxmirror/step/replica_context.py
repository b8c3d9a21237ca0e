"""``ReplicaContext``: what a step function sees of its replica (``tf.distribute.ReplicaContext``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmirror.core import _compat, context
from jaxmirror.core.reduce_op import as_reduce_op
from jaxmirror.core.stateful import Stateful, is_opaque
from jaxmirror.core.bits import moved
from jaxmirror.core.values import GatheredPerReplica, Mirrored, PerReplica, components


def _check_gather_axis(x, axis) -> int:
    rank = jnp.ndim(x)
    if rank < 1:
        raise ValueError(
            f"all_gather: `value` must have rank >= 1 to be gathered along `axis`, but {x!r} is "
            f"a scalar; reshape it to shape [1] first."
        )
    if not isinstance(axis, int) or not -rank <= axis < rank:
        raise ValueError(f"all_gather: `axis` must be an int in [{-rank}, {rank}) for a rank-{rank} "
                         f"value; got {axis!r}.")
    return axis % rank


class ReplicaContext:
    """A replica's view of the strategy inside ``strategy.run`` (``tf.distribute.ReplicaContext``).

    Get it with ``jaxmirror.get_replica_context()`` inside the step function. Outside every
    strategy the default replica context is replica 0 of 1 and its collectives return their input.

    Args:
        strategy: the strategy this replica belongs to.
        replica_id_in_sync_group: the replica's id (an ``int`` for the default context).
        axis_name: the mesh axis the collectives run over; ``None`` for the default context.
        padded_batches: the padded batches the step got, as ``(padded rows per replica, row
            counts of every replica)`` pairs (``run`` passes them; see ``batch_mask``).

    Example:
        >>> import jax.numpy as jnp, jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> def step():
        ...     ctx = jaxmirror.get_replica_context()
        ...     return ctx.all_reduce("sum", ctx.replica_id_in_sync_group + 1)
        >>> int(s.run(step))
        3
    """

    def __init__(self, strategy, replica_id_in_sync_group=0, axis_name: str | None = None,
                 padded_batches: tuple = ()):
        self._strategy = strategy
        self._replica_id = replica_id_in_sync_group
        self._axis_name = axis_name
        self._batches = tuple(padded_batches)

    @property
    def batch_mask(self):
        """Which rows of this replica's batch are real: a bool array, or ``None``.

        Batches from a distributed dataset are padded to a static number of rows per replica
        (uneven splits, a partial last batch). ``compute_average_loss`` leaves the padding out
        by itself; a reduction written by hand (``jnp.mean(loss)``) would count it, so weight
        such sums with this mask. So would ``all_gather(x, axis=0)`` and anything a
        ``merge_fn`` reduces or gathers: inside the step, values are padded. The mask
        describes the first padded batch among the step's arguments; ``None`` when the step
        got none.

        Returns:
            ``None``, or a bool array of shape ``(padded_rows,)``, True for real rows.

        Example:
            >>> import numpy as np, jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> batch = next(iter(s.experimental_distribute_dataset([np.arange(3.0)])))
            >>> def step(x):
            ...     mask = jaxmirror.get_replica_context().batch_mask
            ...     return mask.sum(), (x * mask).sum()
            >>> real, total = s.run(step, args=(batch,))
            >>> [int(k) for k in s.experimental_local_results(real)], float(s.reduce("sum", total))
            ([2, 1], 3.0)
        """
        return row_mask(self, None)

    @property
    def strategy(self):
        """The strategy running this replica."""
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run the step together (a Python int)."""
        return self._strategy.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self):
        """This replica's id: a traced int32 scalar inside ``run``, the int 0 in the default context."""
        if self._axis_name is None:
            return self._replica_id
        return lax.axis_index(self._axis_name)

    @property
    def devices(self) -> tuple:
        """The TF-style names of this replica's devices (all of them while tracing, SPMD)."""
        return tuple(self._strategy.extended.worker_devices)

    def all_reduce(self, reduce_op, value, options=None):
        """Reduce ``value`` (a nest of arrays) across replicas; every replica gets the result.

        Args:
            reduce_op: ``ReduceOp.SUM`` or ``ReduceOp.MEAN``, or ``"sum"``/``"mean"`` in any case.
            value: an array, a Python number or a nest (pytree) of them.
            options: a ``jaxmirror.experimental.CommunicationOptions`` for this call
                (``bytes_per_pack``, ``wire_dtype``), over the strategy's own; or ``None``.

        Returns:
            The reduced nest, identical on every replica (so ``run`` returns it as Mirrored). An
            integer MEAN gives floats. In the default context ``value`` is returned unchanged.
            The strategy's ``cross_device_ops`` compiles the collectives.

        Raises:
            ValueError: for a reduce op other than SUM or MEAN, or ``options`` that are not
                ``CommunicationOptions``.

        Example:
            >>> import jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> out = s.run(lambda: jaxmirror.get_replica_context().all_reduce("MEAN", {"a": 2}))
            >>> float(out["a"])
            2.0
        """
        op = as_reduce_op(reduce_op)
        extended = self._strategy.extended
        options = extended.options_for(options, "all_reduce")
        if self._axis_name is None:
            return value
        return extended.cross_device_ops.all_reduce_in_program(
            op, value, self._axis_name, extended.devices, options)

    def all_gather(self, value, axis: int, options=None):
        """Concatenate every replica's ``value`` along ``axis``; every replica gets the result.

        Args:
            value: an array of rank >= 1 or a nest of them.
            axis: the axis to concatenate along (negative counts from the end).
            options: accepted for TF compatibility.

        Returns:
            The gathered nest: along ``axis`` its size is the sum of the replicas' sizes, in
            replica order. In the default context ``value`` is returned unchanged.

        Raises:
            ValueError: for a scalar leaf or an ``axis`` outside the leaf's rank.

        Example:
            >>> import jax.numpy as jnp, jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> def step():
            ...     ctx = jaxmirror.get_replica_context()
            ...     return ctx.all_gather(jnp.full((1, 2), ctx.replica_id_in_sync_group), axis=0)
            >>> s.run(step).tolist()
            [[0, 0], [1, 1]]
        """
        del options
        leaves = jax.tree.leaves(value)
        axes = [_check_gather_axis(x, axis) for x in leaves]
        if self._axis_name is None:
            return value
        it = iter(axes)

        def gather(x):
            axis_ = next(it)
            # As bit patterns: XLA on CPU all-gathers bfloat16 through float32 (NaN payloads
            # lost).
            return moved(lambda a: lax.all_gather(a, self._axis_name, axis=axis_, tiled=True), x)

        return jax.tree.map(gather, value)

    def merge_call(self, merge_fn, args=(), kwargs=None):
        """Run ``merge_fn`` once in cross-replica context with every replica's arguments.

        ``merge_fn(strategy, *args, **kwargs)`` runs inside the same compiled program, once per
        trace (not once per replica): arrays computed in the replica arrive as ``PerReplica``
        values (one component per replica) whose ``experimental_local_results``, ``reduce`` and
        ``gather`` work there; variables arrive as themselves; Python values as they are. The
        result goes back to every replica; a ``PerReplica`` in it gives each replica its own
        component, a ``Mirrored`` its value. In the default replica context (no strategy)
        ``merge_fn`` gets the default strategy and the arguments unchanged.

        Args:
            merge_fn: called as ``merge_fn(strategy, *args, **kwargs)``.
            args: a tuple or list of positional arguments.
            kwargs: a dict of keyword arguments.

        Returns:
            ``merge_fn``'s result, with per-replica values unpacked for this replica.

        Raises:
            TypeError: when ``merge_fn`` is not callable.
            ValueError: when ``args`` is not a list or tuple or ``kwargs`` not a dict.
            RuntimeError: outside this replica context (e.g. from inside a ``merge_fn``).

        Example:
            >>> import jax.numpy as jnp, jaxmirror
            >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> def merge_fn(strategy, x):
            ...     return strategy.reduce("sum", x, axis=None)
            >>> def step():
            ...     ctx = jaxmirror.get_replica_context()
            ...     return ctx.merge_call(merge_fn, args=(jnp.float32(ctx.replica_id_in_sync_group + 1),))
            >>> float(s.run(step))
            3.0
        """
        args, kwargs = _checked_merge_arguments(merge_fn, args, kwargs)
        entry = context.current()
        if entry.replica_context is not self:
            raise RuntimeError(
                "merge_call: called outside the replica context it belongs to; call it inside "
                "the step function `run` is running (not inside a merge_fn, which already runs "
                "in cross-replica context, and not after `run` returned)."
            )
        strategy = self._strategy
        distributed = self._axis_name is not None and self.num_replicas_in_sync > 1
        if distributed:
            args, kwargs = jax.tree.map(self._lift, (args, kwargs), is_leaf=is_opaque)
        with context.pushed(context.Entry(strategy, None, in_run=entry.in_run, merging=self)):
            result = merge_fn(strategy, *args, **kwargs)
        if distributed:
            result = jax.tree.map(lambda x: this_replica(x, self._axis_name), result,
                                  is_leaf=is_opaque)
        return result

    def _lift(self, x):
        """A replica-context array as the PerReplica ``merge_fn`` sees."""
        if isinstance(x, jax.Array) or _compat.is_tracer(x):
            return GatheredPerReplica(x, self._axis_name)
        return x

    def __repr__(self) -> str:
        return (f"ReplicaContext(strategy={self._strategy!r}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")


def call_in_merge(ctx: ReplicaContext, fn, args: tuple, kwargs: dict):
    """``extended.call_for_each_replica(fn, ...)`` inside ``ctx``'s ``merge_fn``.

    The merge_fn runs inside the step's trace, once for all replicas (SPMD), so ``fn`` is
    traced once more there, in ``ctx``'s replica context, on each replica's component of the
    arguments; its results come back to the merge_fn as per-replica values. Exceptions pass
    through, as in TF.

    Args:
        ctx: the replica context whose ``merge_call`` runs the current ``merge_fn``.
        fn: the per-replica function.
        args: a tuple or list of positional arguments (PerReplica, Mirrored or plain values).
        kwargs: a dict of keyword arguments, or ``None``.

    Returns:
        ``fn``'s results, arrays as per-replica values (as the merge_fn's own arguments).

    Raises:
        TypeError, ValueError: for a ``fn`` that is not callable, or malformed arguments.
    """
    if not callable(fn):
        raise TypeError(f"call_for_each_replica: `fn` must be callable; got {fn!r}.")
    if not isinstance(args, (list, tuple)) or not isinstance(kwargs, (dict, type(None))):
        raise ValueError(f"call_for_each_replica: `args` must be a list or tuple and `kwargs` a "
                         f"dict or None; got {type(args).__name__} and {type(kwargs).__name__}.")
    args, kwargs = tuple(args), kwargs or {}
    entry = context.current()
    distributed = ctx._axis_name is not None and ctx.num_replicas_in_sync > 1
    if distributed:
        args, kwargs = jax.tree.map(lambda x: this_replica(x, ctx._axis_name), (args, kwargs),
                                    is_leaf=is_opaque)
    with context.pushed(context.Entry(ctx.strategy, ctx, in_run=entry.in_run)):
        result = fn(*args, **kwargs)
    if distributed:
        result = jax.tree.map(ctx._lift, result, is_leaf=is_opaque)
    return result


class _FirstReplica(ReplicaContext):
    """Replica 0 of ``call_as_first_replica``: with several replicas, what would need the other
    replicas' values (they do not run) raises instead of giving replica 0's alone."""

    def _refuse(self, what: str, values=None) -> None:
        if self.num_replicas_in_sync > 1 and (values is None or any(
                isinstance(x, (jax.Array, np.ndarray, np.generic)) or _compat.is_tracer(x)
                for x in jax.tree.leaves(values, is_leaf=is_opaque))):
            raise RuntimeError(
                f"call_for_each_replica: `fn` creates variables, so it runs once, as replica 0, "
                f"where `{what}` cannot see the other replicas' values (TF runs `fn` on every "
                f"replica); create the variables in `fn` and do the collectives in a step "
                f"(`strategy.run`)."
            )

    def all_reduce(self, reduce_op, value, options=None):
        self._refuse("all_reduce")
        return super().all_reduce(reduce_op, value, options)

    def all_gather(self, value, axis: int, options=None):
        self._refuse("all_gather")
        return super().all_gather(value, axis, options)

    def merge_call(self, merge_fn, args=(), kwargs=None):
        self._refuse("merge_call", (args, kwargs))  # variables and Python values are as in TF
        return super().merge_call(merge_fn, args, kwargs)


def call_as_first_replica(strategy, fn, args: tuple, kwargs: dict):
    """``extended.call_for_each_replica(fn, ...)`` of a ``fn`` that creates variables.

    TF runs ``fn`` once per replica and merges their variable creators: the first replica
    creates each variable, the others reuse it. A step's trace cannot create variables, so
    ``fn`` runs here eagerly, once, as replica 0 in ``strategy``'s scope: the variables are
    made with replica 0's initial values, as in TF. With several replicas, its ``all_reduce``,
    ``all_gather`` and ``merge_call`` of arrays raise (they would see replica 0's values only,
    where TF's see every replica's); so that nothing computed from replica 0 alone passes for
    every replica's result, ``fn`` may return only variables (or ``None``).

    Args:
        strategy: the strategy whose ``call_for_each_replica`` was called.
        fn: the function; its arguments get replica 0's component of distributed values.
        args: a tuple of positional arguments.
        kwargs: a dict of keyword arguments, or ``None``.

    Returns:
        ``fn``'s result: the variables it created (or any variables it returns).

    Raises:
        ValueError: when the result holds anything but variables and ``None``.
        RuntimeError: when ``fn`` runs a collective (above) with several replicas.
    """
    args, kwargs = jax.tree.map(_first_component, (tuple(args), kwargs or {}), is_leaf=is_opaque)
    with strategy.scope():
        with context.pushed(context.Entry(strategy, _FirstReplica(strategy, 0))):
            result = fn(*args, **kwargs)
    bad = [x for x in jax.tree.leaves(result, is_leaf=is_opaque) if not isinstance(x, Stateful)]
    if bad:
        raise ValueError(
            f"call_for_each_replica: `fn` created variables, so it ran once, as replica 0 (TF's "
            f"first replica, whose variables the others reuse), but it also returned "
            f"{type(bad[0]).__name__} values, which would be replica 0's only; create the "
            f"variables first (call_for_each_replica or `strategy.scope()`), then compute with "
            f"`strategy.run`."
        )
    return result


def _first_component(x):
    if isinstance(x, PerReplica):
        return components(x.stacked)[0]
    if isinstance(x, Mirrored):
        return x.value
    return x


def this_replica(x, axis_name):
    """A cross-replica value (in a ``merge_fn``) as this replica sees it: its component."""
    if isinstance(x, GatheredPerReplica):
        return x.local
    if isinstance(x, PerReplica):
        return lax.dynamic_index_in_dim(x.stacked, lax.axis_index(axis_name), 0, keepdims=False)
    if isinstance(x, Mirrored):
        return x.value
    return x


def _checked_merge_arguments(merge_fn, args, kwargs) -> tuple:
    """``(args, kwargs)`` of a ``merge_call`` as a tuple and a dict; raises for bad ones."""
    if not callable(merge_fn):
        raise TypeError(f"merge_call: `merge_fn` must be callable; got {merge_fn!r}.")
    if not isinstance(args, (list, tuple)):  # TF's wording after the API name (also kwargs)
        raise ValueError(f"merge_call: positional args must be a list or tuple, got {type(args)}.")
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, dict):
        raise ValueError(f"merge_call: kwargs must be a dict, got {type(kwargs)}.")
    return tuple(args), kwargs


def padded_batch(ctx: ReplicaContext, rows) -> tuple:
    """The first padded batch ``ctx``'s step got with ``rows`` rows per replica (any, for None).

    Args:
        ctx: the replica context of a running step.
        rows: the padded rows per replica to look for, or ``None``.

    Returns:
        ``(padded rows, row counts of every replica)``, or ``(None, None)`` when there is none.
    """
    for size, counts in ctx._batches:
        if rows is None or size == rows:
            return size, counts
    return None, None


def row_mask(ctx: ReplicaContext, rows):
    """Which rows of this replica's batch ``padded_batch(ctx, rows)`` are real, or ``None``.

    Args:
        ctx: the replica context of a running step.
        rows: as for ``padded_batch``.

    Returns:
        A bool array of shape ``(padded rows,)`` (True for real rows), or ``None``.
    """
    size, counts = padded_batch(ctx, rows)
    if size is None:
        return None
    return jnp.arange(size) < counts[lax.axis_index(ctx._axis_name)]
