"""Every JAX-version-specific call jaxmirror makes, in one place (pinned to jax>=0.10.2,<0.11).

The only module of jaxmirror that touches JAX's private modules (``jax._src``); each such use
says which public spelling is missing.
"""

from __future__ import annotations

import threading

import jax
import numpy as np
from jax._src import api as _api  # nor the C++ jit's NaN-check hook (see below)
from jax._src import core as _core  # trace_state_clean has no public spelling in 0.10
from jax._src import dispatch as _dispatch  # nor JAX's per-device effect tokens
from jax._src import distributed as _distributed  # nor the coordinator a process joined
from jax._src import dtypes as _dtypes  # nor registering an array-like type (see below)
from jax._src import xla_bridge as _xla_bridge  # nor whether the backend has started
from jax._src.interpreters import partial_eval as _pe  # nor the jaxpr-recording trace
from jax._src import config as _config  # nor marking a transfer explicit (as device_put)
from jax._src.interpreters import pxla as _pxla  # nor device_put without its Python dispatch
from jax._src.lib import xla_client as _xc  # nor its copy semantics
from jax._src.lax import parallel as _parallel  # nor these collectives' primitives
from jax._src.lib import _jax as _jaxlib  # nor the coordination service on its own
from jax.extend import core as jex_core
from jax.sharding import Mesh, NamedSharding, PartitionSpec

ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
Literal = jex_core.Literal
Primitive = jex_core.Primitive
jaxpr_as_fun = jex_core.jaxpr_as_fun
jaxprs_in_params = jex_core.jaxprs_in_params
# jaxpr_as_fun turns jax_debug_nans off while it evaluates; this is the evaluation without that.
eval_jaxpr = _core.eval_jaxpr  # no public spelling in 0.10

P = PartitionSpec

# Collective primitives that jax.lax does not export (the rest are ``jax.lax.<name>_p``).
psum_invariant_p = _parallel.psum_invariant_p
pbroadcast_p = _parallel.pbroadcast_p
reduce_scatter_p = _parallel.reduce_scatter_p  # what lax.psum_scatter binds
pvary_p = _core.pvary_p


def make_mesh(devices, axis_name: str) -> Mesh:
    """A 1-D mesh with *Auto* axis types (``jax.make_mesh`` defaults to Explicit now)."""
    return Mesh(np.array(list(devices), dtype=object), (axis_name,))


def shard_map(fn, mesh, in_specs, out_specs):
    """``jax.shard_map`` with pmap-style gradients (``check_vma=False``).

    With ``check_vma=True`` the gradient with respect to a replicated input is already summed
    over the replicas, so TF's "all-reduce the gradients" would multiply them by N; with
    ``check_vma=False`` gradients are per replica and the gradient of an all-reduce is the
    all-reduce of the upstream gradient, as in TF.
    """
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


# The public spelling (no jax._src): named here so that version changes have one place.
optimization_barrier = jax.lax.optimization_barrier


def put_host_arrays(arrays: list, shardings: list) -> list:
    """``jax.device_put(arrays, shardings)`` for host NumPy arrays, without its dispatch.

    ``jax.device_put`` checks and routes each value in Python before the transfer (about
    100 µs for a two-leaf batch on 2 CPU devices, 4x the transfer itself); for NumPy arrays it
    ends in ``shard_args``, which this calls directly: the same committed arrays, dtypes
    canonicalized the same way. Anything else goes through ``jax.device_put``.

    Args:
        arrays: the host arrays.
        shardings: one ``jax.sharding.Sharding`` per array.

    Returns:
        The placed ``jax.Array``s, in order.
    """
    if not all(type(a) is np.ndarray for a in arrays):
        return jax.device_put(list(arrays), list(shardings))
    n = len(arrays)
    with _config.explicit_device_put_scope():  # as device_put: transfer guards see it so
        return _pxla.shard_args(list(shardings), [None] * n,
                                [_xc.ArrayCopySemantics.REUSE_INPUT] * n, list(arrays))


# Called (no arguments) when a caller raises a step's run-time failure itself: the variables'
# state then reports it no more (see ``forget_failed_effect_tokens``).
failure_reported_hooks: list = []


def forget_failed_effect_tokens(reported_here: bool = True) -> None:
    """Drop JAX's per-device effect tokens that carry a failed computation's error.

    JAX keeps the token of the last computation with host callbacks on each device, and waits
    on it in ``jax.effects_barrier()`` and at exit; a failed step's token would raise its error
    again there, from an unrelated place (or print it at exit). Called once a failure is known.

    Args:
        reported_here: the caller raises the failure now (a call that waited for its step):
            ``failure_reported_hooks`` run, so that its variables do not raise it again.
    """
    if reported_here:
        for hook in failure_reported_hooks:
            hook()
    tokens = _dispatch.runtime_tokens.output_runtime_tokens
    for device, token in list(tokens.items()):
        try:
            token.block_until_ready()
        except Exception:  # noqa: BLE001 - that computation failed: its error is reported already
            tokens.pop(device, None)


def is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def abstract_key(x):
    """Shape, dtype and weak type of an input, without its placement (a hashable key)."""
    aval = jax.typeof(x)
    return (aval.shape, aval.dtype, getattr(aval, "weak_type", False))


def local_abstract_key(x, stacked: bool):
    """``abstract_key`` of what one replica sees of ``x`` (a stacked array loses its first axis)."""
    shape, dtype, weak = abstract_key(x)
    return (shape[1:] if stacked else shape), dtype, weak


def eqn_frames(eqn) -> list:
    """``(file name, line, function name)`` of the Python frames that made a jaxpr equation,
    innermost first (empty when JAX kept none); ``SourceInfo`` has no public spelling."""
    tb = getattr(getattr(eqn, "source_info", None), "traceback", None)
    return [(f.file_name, f.line_num, f.function_name)
            for f in (tb.frames if tb is not None else ())]


def current_trace():
    """The JAX trace operations are bound to right now (the eval trace outside transformations)."""
    return _core.trace_ctx.trace


def is_staging(trace) -> bool:
    """Whether ``trace`` records a jaxpr (jit, scan/cond/while bodies, shard_map, remat)."""
    return isinstance(trace, _pe.DynamicJaxprTrace)


# False while a JAX transformation (jit, grad, scan, ...) is tracing. The bound method itself:
# it is on the hot path of steps that use variables.
trace_state_clean = _core.trace_ctx.is_top_level


def set_cpu_device_count(n: int) -> None:
    """Ask XLA for ``n`` host-platform devices; only possible before the backend starts."""
    jax.config.update("jax_num_cpu_devices", n)


class _ArrayLikeGuard(threading.local):
    """A named flag per thread: ``refusal`` is set while a step's own ``jax.jit`` call takes
    its arguments (``step/call_plan.py``), and cleared again while the step is traced (the
    user's function may give variables to its own ``jax.jit``). While set, JAX abstracting an
    array-like (``register_array_like``) raises ``refusal()``: a step must see its variables as
    variables, and JAX taking them as arrays would drop their assignments."""

    refusal = None


array_like_guard = _ArrayLikeGuard()


def register_array_like(cls, to_array) -> None:
    """Let JAX's functions and transformations take ``cls`` (and subclasses) as the array
    ``to_array(x)`` gives: ``jnp.sum(v)``, ``jax.jit(f)(v)``, ``jax.grad(f)(v)``.

    JAX 0.10 no longer abstracts ``__jax_array__`` objects and names no public way to register
    an array-like type; these two tables are what its own array-likes (NumPy scalars, PRNG
    keys) use.
    """
    def aval(x):
        if array_like_guard.refusal is not None:
            raise array_like_guard.refusal()
        return _core.shaped_abstractify(to_array(x))

    def value(x):
        if array_like_guard.refusal is not None:
            raise array_like_guard.refusal()
        return to_array(x)

    _core.pytype_aval_mappings[cls] = aval
    _dtypes.canonicalize_value_handlers[cls] = value


def backend_started() -> bool:
    """Whether JAX's backend (and so its device count) is already fixed in this process."""
    return bool(_xla_bridge._backends)


def distributed_client():
    """``jax.distributed``'s client here (its key-value store is the coordination service's),
    or ``None`` when the runtime is not up."""
    return _distributed.global_state.client


def preemption_service_running() -> bool:
    """Whether JAX's preemption sync manager runs here (``jax.distributed.initialize``
    starts it when ``jax_enable_preemption_service`` is on; its notifier catches SIGTERM)."""
    return (_distributed.global_state.client is not None
            and _distributed.global_state.preemption_sync_manager is not None)


def reached_preemption_sync_point(call: int) -> bool:
    """``jax.experimental.multihost_utils.reached_preemption_sync_point(call)``: True at the
    same call on every process once any was told it will be preempted. Every process counts
    its calls from 0 at the same point (JAX's sync point is the largest count + 1)."""
    return _distributed.global_state.preemption_sync_manager.reached_sync_point(call)


def distributed_coordinator_address() -> str | None:
    """The coordinator address ``jax.distributed.initialize`` was given here, or ``None``."""
    return _distributed.global_state.coordinator_address


def start_coordination_service(bind_address: str, num_processes: int, heartbeat_s: int,
                               shutdown_s: int):
    """JAX's coordination service (what ``jax.distributed.initialize`` starts in process 0),
    started here on its own, with failed tasks recoverable: the service keeps serving the
    others instead of ending every client when one dies.

    Args:
        bind_address: where it listens (``[::]:port``).
        num_processes: how many processes join.
        heartbeat_s: seconds without heartbeats after which a process counts as dead.
        shutdown_s: how long it waits for every process at shutdown.

    Returns:
        The service: keep it alive as long as it should run.
    """
    return _jaxlib.get_distributed_runtime_service(
        bind_address, num_processes, heartbeat_timeout=heartbeat_s, shutdown_timeout=shutdown_s,
        recoverable=True)


class _WithoutService:
    """``jax._src.distributed``'s view of ``_jax`` in which process 0 starts no service."""

    def __getattr__(self, name):
        if name == "get_distributed_runtime_service":
            return lambda *args, **kwargs: None
        return getattr(_jaxlib, name)


def initialize_distributed(coordinator_address: str, num_processes: int, process_id: int,
                           heartbeat_s: int, shutdown_s: int, start_service: bool) -> None:
    """``jax.distributed.initialize`` for this process; with ``start_service=False`` process 0
    connects to a service already running (``start_coordination_service``) instead of starting
    its own (JAX 0.10 always starts it in process 0, so that process's death ends every other
    one through the client's fatal error handler).

    Args:
        coordinator_address: the service's ``host:port``.
        num_processes: how many processes join.
        process_id: this one's index.
        heartbeat_s: the heartbeat timeout.
        shutdown_s: how long shutting down waits for the others.
        start_service: whether process 0 starts the service itself (JAX's way).
    """
    kwargs = dict(coordinator_address=coordinator_address, num_processes=num_processes,
                  process_id=process_id, cluster_detection_method="deactivate",
                  initialization_timeout=24 * 3600, heartbeat_timeout_seconds=heartbeat_s,
                  shutdown_timeout_seconds=shutdown_s)
    if start_service or process_id != 0:
        jax.distributed.initialize(**kwargs)
        return
    saved, _distributed._jax = _distributed._jax, _WithoutService()
    try:
        jax.distributed.initialize(**kwargs)
    finally:
        _distributed._jax = saved


# -- the coordination service's key-value store (what jax.distributed's client offers) --------
def kv_set(client, key: str, value: str, overwrite: bool = False) -> None:
    """Write ``value`` at ``key`` in the coordination service's store.

    Args:
        client: ``distributed_client()``.
        key: the key.
        value: a string.
        overwrite: replace a value already there.

    Raises:
        Exception: JAX's runtime error when ``key`` exists and ``overwrite`` is False, or the
            service does not answer.
    """
    client.key_value_set(key, value, allow_overwrite=overwrite)


def kv_get(client, key: str, timeout_ms: int) -> str | None:
    """The value at ``key``, waiting up to ``timeout_ms`` for it to be written.

    Args:
        client: ``distributed_client()``.
        key: the key.
        timeout_ms: how long to wait.

    Returns:
        The string, or ``None`` when it was not written in time (or the service did not
        answer).
    """
    try:
        return client.blocking_key_value_get(key, timeout_ms)
    except Exception:  # noqa: BLE001 - DEADLINE_EXCEEDED, or the client is shut down
        return None


def kv_try_get(client, key: str) -> str | None:
    """The value at ``key`` now.

    Args:
        client: ``distributed_client()``.
        key: the key.

    Returns:
        The string, or ``None``.
    """
    try:
        return client.key_value_try_get(key)
    except Exception:  # noqa: BLE001 - NOT_FOUND
        return None


def kv_delete(client, key: str) -> None:
    """Delete ``key`` (and the keys below it, as a directory).

    Args:
        client: ``distributed_client()``.
        key: the key.
    """
    client.key_value_delete(key)


def _keep_nan_checks_on() -> None:
    """Keep ``jax_debug_nans``/``jax_debug_infs`` checking every ``jax.jit`` call on a thread
    where ``with jax.debug_nans(False):`` (or ``debug_infs``) was left before.

    JAX 0.10.2 checks the outputs of a call that its C++ cache dispatches (every call after a
    signature's first) through a hook that leaving such a block sets to ``None`` for the
    thread, not back to unset; JAX leaves one in every ``jaxpr_as_fun`` call, eager
    ``shard_map`` and some ``jnp`` reductions, so from then on a NaN went unchecked. Here the
    hook goes back to unset (the global setting) once neither flag is set for the thread.
    """
    unset = getattr(getattr(_config, "config_ext", None), "unset", None)
    flags = (_config.debug_nans, _config.debug_infs)
    if (unset is None or not hasattr(_api, "_post_hook_state")
            or not all(hasattr(f, "_update_thread_local_hook") for f in flags)):
        return  # another JAX: its own hooks, left as they are

    def after(jax_hook):
        def hook(value):
            jax_hook(value)
            if all(flag.get_local() is unset for flag in flags):
                _api._post_hook_state.set_local(unset)
        return hook

    for flag in flags:
        flag._update_thread_local_hook = after(flag._update_thread_local_hook)
    if all(flag.get_local() is unset for flag in flags):  # a block left before this import
        _api._post_hook_state.set_local(unset)


_keep_nan_checks_on()


__all__ = [
    "ClosedJaxpr", "Jaxpr", "Literal", "Mesh", "NamedSharding", "P", "PartitionSpec", "Primitive",
    "abstract_key", "array_like_guard", "backend_started", "current_trace", "distributed_client",
    "distributed_coordinator_address", "eqn_frames", "eval_jaxpr", "forget_failed_effect_tokens",
    "initialize_distributed", "is_staging", "is_tracer", "jaxpr_as_fun", "jaxprs_in_params",
    "kv_delete", "kv_get", "kv_set", "kv_try_get", "local_abstract_key", "make_mesh",
    "pbroadcast_p", "preemption_service_running", "psum_invariant_p", "pvary_p",
    "reached_preemption_sync_point", "reduce_scatter_p", "register_array_like", "set_cpu_device_count", "shard_map",
    "start_coordination_service",
    "trace_state_clean",
]
