"""Every JAX-version-specific call jaxmirror makes, in one place (jax>=0.10.2,<0.12).

The only module of jaxmirror that touches JAX's and flax's private modules (``jax._src``,
``flax.nnx.graphlib``) or reads a primitive's parameters; each such use says which public
spelling is missing. One accessor per fact (``scan_parts``: a scan's body, constants and carry;
``collective_axes``: the axes a collective spans...), read from a jaxpr's structure where it
can be, so that JAX renaming a parameter (0.11 packs a scan's counts into flat trees) changes one
function. ``tests/test_jax_compat.py`` exercises every accessor against the JAX installed.
"""

from __future__ import annotations

import threading

import jax
import numpy as np
from flax.nnx import graphlib as _graphlib  # flax names no public is_graph_node
from flax.nnx.nn import dtypes as _flax_dtypes  # nor the dtype its layers compute in
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
from jax.interpreters import ad as _ad  # JAX's rule tables for a new primitive (public modules)
from jax.interpreters import batching as _batching
from jax.interpreters import mlir as _mlir
from jax.sharding import Mesh, NamedSharding, PartitionSpec

ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
Literal = jex_core.Literal
Primitive = jex_core.Primitive
jaxpr_as_fun = jex_core.jaxpr_as_fun
# jaxpr_as_fun turns jax_debug_nans off while it evaluates; this is the evaluation without that.
eval_jaxpr = _core.eval_jaxpr  # no public spelling in 0.10

P = PartitionSpec

# Collective primitives that jax.lax does not export (the rest are ``jax.lax.<name>_p``).
psum_invariant_p = _parallel.psum_invariant_p
pbroadcast_p = _parallel.pbroadcast_p
reduce_scatter_p = _parallel.reduce_scatter_p  # what lax.psum_scatter binds
pvary_p = _core.pvary_p


# -- jaxprs: the facts the analyses of a traced step read (one accessor per fact) --------------
# JAX 0.11 merged ``ClosedJaxpr`` into ``Jaxpr`` (a jaxpr carries its constants' values, and
# ``ClosedJaxpr`` is another name for ``Jaxpr``); 0.10 wraps an open ``Jaxpr`` in a
# ``ClosedJaxpr``. A primitive's parameters are read here, and only here.
JAXPRS_MERGED = ClosedJaxpr is Jaxpr


def open_jaxpr(jaxpr):
    """The equations and variables of a jaxpr, closed or open (0.10's ``ClosedJaxpr.jaxpr``).

    Args:
        jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.

    Returns:
        The open ``Jaxpr``: ``invars``, ``constvars``, ``eqns``, ``outvars``.
    """
    if JAXPRS_MERGED or not isinstance(jaxpr, ClosedJaxpr):
        return jaxpr
    return jaxpr.jaxpr


def jaxpr_constants(jaxpr) -> list:
    """The values a closed jaxpr holds for its ``constvars`` (none for an open one).

    Args:
        jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.

    Returns:
        A list of arrays (in ``constvars`` order).
    """
    return list(getattr(jaxpr, "consts", ()) or ())


def close_jaxpr(jaxpr):
    """An open jaxpr without constants, closed (what ``jaxpr_as_fun`` takes).

    Args:
        jaxpr: an open ``Jaxpr`` with no ``constvars``.

    Returns:
        A ``ClosedJaxpr`` (in JAX 0.11, a ``Jaxpr``) of the same program.

    Raises:
        ValueError: the jaxpr has constants (JAX 0.11.1 would make them inputs).
    """
    if jaxpr.constvars:
        raise ValueError("close_jaxpr: the jaxpr has constants; give them their values instead")
    return ClosedJaxpr(jaxpr, ())


def eqn_jaxprs(eqn) -> list:
    """The jaxprs an equation's parameters hold (a call's body, a loop's cond and body, a
    ``cond``'s branches), as they are: closed or open.

    Args:
        eqn: a jaxpr equation.

    Returns:
        A list of jaxprs, in the parameters' order.
    """
    found = []
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, (Jaxpr, ClosedJaxpr)):
                found.append(v)
    return found


def _shape(atom):
    return getattr(atom.aval, "shape", None)


def scan_parts(eqn) -> tuple:
    """A ``scan``'s body and how its inputs split, read from the shapes (JAX 0.11 packs the
    counts into flat trees, 0.10 names them ``num_consts``/``num_carry``): a constant or a
    carry has the same shape outside the body and in it, a scanned input or output has one
    axis more outside (the iterations), and the body takes constants, carry, scanned inputs and
    gives carry, then stacked outputs, in that order.

    Args:
        eqn: a ``lax.scan_p`` equation.

    Returns:
        ``(body, n_consts, n_carry)``: the body's open jaxpr; its first ``n_consts`` inputs are
        constants, the next ``n_carry`` the carry (also its first ``n_carry`` outputs), the
        rest scanned.
    """
    (closed,) = eqn_jaxprs(eqn)
    body = open_jaxpr(closed)
    n_carry = 0
    while (n_carry < len(eqn.outvars)
           and _shape(eqn.outvars[n_carry]) == _shape(body.outvars[n_carry])):
        n_carry += 1
    n_xs = 0
    while (n_xs < len(eqn.invars)
           and _shape(eqn.invars[-1 - n_xs]) != _shape(body.invars[-1 - n_xs])):
        n_xs += 1
    return body, len(eqn.invars) - n_carry - n_xs, n_carry


def while_parts(eqn) -> tuple:
    """A ``while_loop``'s condition and body and how its inputs split, read from the jaxprs
    (not from ``cond_nconsts``/``body_nconsts``): each takes its own constants, then the carry
    (as many as the loop's outputs).

    Args:
        eqn: a ``lax.while_p`` equation.

    Returns:
        ``(cond, body, n_cond_consts, n_body_consts)``: open jaxprs; the equation's inputs are
        the condition's constants, the body's constants, then the carry.
    """
    cond, body = open_jaxpr(eqn.params["cond_jaxpr"]), open_jaxpr(eqn.params["body_jaxpr"])
    n_carry = len(eqn.outvars)
    return cond, body, len(cond.invars) - n_carry, len(body.invars) - n_carry


def cond_branches(eqn) -> list:
    """A ``cond``'s branches (the equation's first input picks one; the rest are theirs).

    Args:
        eqn: a ``lax.cond_p`` equation.

    Returns:
        A list of open jaxprs, one per branch.
    """
    return [open_jaxpr(j) for j in eqn_jaxprs(eqn)]


def shard_map_body(eqn):
    """The per-device program of a ``shard_map`` equation.

    Args:
        eqn: a ``shard_map`` equation.

    Returns:
        Its open jaxpr (no constants: they are the equation's first inputs).
    """
    (body,) = eqn_jaxprs(eqn)
    return open_jaxpr(body)


def shard_map_without_inputs(closed, drop: set):
    """``closed``, a jaxpr that is one ``shard_map`` equation, without its inputs at the
    positions ``drop``, which the body does not use.

    Args:
        closed: the closed jaxpr.
        drop: the outer input positions to leave out.

    Returns:
        The same kind of jaxpr, with fewer inputs.
    """
    outer = open_jaxpr(closed)
    (eqn,) = outer.eqns
    gone = {id(v) for i, v in enumerate(outer.invars) if i in drop}
    keep = [isinstance(v, Literal) or id(v) not in gone for v in eqn.invars]
    inner = shard_map_body(eqn)
    inner = inner.replace(invars=[v for v, k in zip(inner.invars, keep) if k])
    params = dict(eqn.params, jaxpr=inner,
                  in_specs=tuple(s for s, k in zip(eqn.params["in_specs"], keep) if k))
    eqn = eqn.replace(invars=[v for v, k in zip(eqn.invars, keep) if k], params=params)
    outer = outer.replace(invars=[v for i, v in enumerate(outer.invars) if i not in drop],
                          eqns=[eqn])
    return ClosedJaxpr(outer, jaxpr_constants(closed))


# The parameter naming the mesh axes a collective works over.
_COLLECTIVE_AXES = {jax.lax.psum_p: "axes", psum_invariant_p: "axes", jax.lax.pmax_p: "axes",
                    jax.lax.pmin_p: "axes", jax.lax.all_gather_p: "axis_name",
                    reduce_scatter_p: "axis_name", jax.lax.ppermute_p: "axis_name",
                    jax.lax.all_to_all_p: "axis_name"}


def collective_axes(eqn) -> tuple:
    """The mesh axis names a collective (``psum``, ``all_gather``, ``ppermute``...) spans.

    Args:
        eqn: a collective's equation.

    Returns:
        A tuple of axis names (integer positional axes of a ``vmap`` are left in).
    """
    axes = eqn.params[_COLLECTIVE_AXES[eqn.primitive]]
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def collective_groups(eqn):
    """A collective's ``axis_index_groups`` (it reduces within each group), or ``None``.

    Args:
        eqn: a collective's equation.

    Returns:
        The groups, or ``None`` for the whole axis.
    """
    return eqn.params.get("axis_index_groups")


# The parameter naming the axes an operation works along, and whether it names one or several.
_OP_AXES = {
    **{p: ("axes", True) for p in (
        jax.lax.reduce_sum_p, jax.lax.reduce_max_p, jax.lax.reduce_min_p, jax.lax.reduce_prod_p,
        jax.lax.reduce_and_p, jax.lax.reduce_or_p, jax.lax.reduce_xor_p, jax.lax.argmax_p,
        jax.lax.argmin_p)},
    **{p: ("axis", False) for p in (
        jax.lax.cumsum_p, jax.lax.cumprod_p, jax.lax.cummax_p, jax.lax.cummin_p,
        jax.lax.cumlogsumexp_p, jax.lax.split_p, jax.lax.top_k_p)},
    jax.lax.sort_p: ("dimension", False), jax.lax.concatenate_p: ("dimension", False),
    jax.lax.rev_p: ("dimensions", True), jax.lax.squeeze_p: ("dimensions", True),
    jax.lax.stack_p: ("axis", False),
}


def op_axes(eqn) -> tuple:
    """The axes an operation works along: a reduction's or ``argmax``'s reduced axes, a
    cumulative op's, ``split``'s, ``sort``'s, ``top_k``'s, ``concatenate``'s or ``stack``'s
    axis, ``rev``'s reversed and ``squeeze``'s removed dimensions.

    Args:
        eqn: such an equation.

    Returns:
        A tuple of axis numbers.
    """
    name, many = _OP_AXES[eqn.primitive]
    value = eqn.params[name]
    return tuple(value) if many else (value,)


def cumulative_reverse(eqn) -> bool:
    """Whether a cumulative op (``cumsum``, ``cummax``...) runs from the end of its axis."""
    return bool(eqn.params.get("reverse", False))


def broadcast_dimensions(eqn) -> tuple:
    """A ``broadcast_in_dim``'s output axis for each operand axis."""
    return tuple(eqn.params["broadcast_dimensions"])


def transpose_permutation(eqn) -> tuple:
    """A ``transpose``'s permutation: output axis ``i`` is input axis ``perm[i]``."""
    return tuple(eqn.params["permutation"])


def dot_dimensions(eqn) -> tuple:
    """A ``dot_general``'s ``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))``."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    return (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))


def slice_bounds(eqn) -> tuple:
    """A static ``slice``'s ``(start_indices, limit_indices, strides)`` (``None``: strides 1)."""
    p = eqn.params
    return tuple(p["start_indices"]), tuple(p["limit_indices"]), p["strides"]


def slice_sizes(eqn) -> tuple:
    """A ``dynamic_slice``'s or ``gather``'s slice sizes, one per operand axis."""
    return tuple(eqn.params["slice_sizes"])


def padding_config(eqn) -> tuple:
    """A ``pad``'s ``(low, high, interior)`` per axis."""
    return tuple(tuple(c) for c in eqn.params["padding_config"])


def gather_dimensions(eqn):
    """A ``gather``'s dimension numbers: ``offset_dims``, ``collapsed_slice_dims``,
    ``operand_batching_dims``, ``start_indices_batching_dims``."""
    return eqn.params["dimension_numbers"]


def scatter_dimensions(eqn):
    """A scatter's dimension numbers (``scatter_dims_to_operand_dims``...)."""
    return eqn.params["dimension_numbers"]


def conv_dimensions(eqn) -> tuple:
    """A ``conv_general_dilated``'s ``(dimension_numbers, batch_group_count)``; the numbers'
    ``lhs_spec``/``rhs_spec``/``out_spec`` list each operand's axes in (batch or out-feature,
    feature or in-feature, spatial...) order."""
    return eqn.params["dimension_numbers"], eqn.params["batch_group_count"]


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


Tracer = jax.core.Tracer


def is_tracer(x) -> bool:
    """Whether ``x`` is a JAX tracer (a value inside a transformation), not an array."""
    return isinstance(x, Tracer)


def identity_primitive(name: str, transpose) -> Primitive:
    """A new primitive that is the identity on one array and compiles to nothing: linear, its
    transpose ``transpose(cotangent)``, kept under ``vmap``. What an analysis reads as a mark.

    Args:
        name: the primitive's name (shown in jaxprs).
        transpose: the cotangent of its input, from its output's.

    Returns:
        The ``Primitive``; ``p.bind(x)`` marks ``x``.
    """
    p = Primitive(name)
    p.def_impl(lambda x: x)
    p.def_abstract_eval(lambda x: x)
    _mlir.register_lowering(p, _mlir.lower_fun(lambda x: x, multiple_results=False))
    _ad.deflinear2(p, lambda ct, x: [transpose(ct)])
    _batching.primitive_batchers[p] = lambda args, dims: (p.bind(*args), dims[0])
    return p


def layer_dtype(*args, dtype=None):
    """The dtype a flax NNX layer gives its output: ``dtype`` when set, else the arrays'
    promoted float dtype (``flax.nnx.nn.dtypes.canonicalize_dtype``).

    Args:
        *args: the layer's input and parameters (``None`` ones are skipped).
        dtype: the layer's ``dtype`` setting.

    Returns:
        A NumPy dtype.
    """
    return _flax_dtypes.canonicalize_dtype(*args, dtype=dtype)


def is_graph_node(x) -> bool:
    """Whether flax NNX treats ``x`` as a graph node (a ``Module``, an ``Optimizer``, a
    ``Variable``, a registered pytree-like node...); ``flax.nnx.graphlib`` is not public."""
    return _graphlib.is_graph_node(x)


def abstract_key(x):
    """Shape, dtype and weak type of an input, without its placement (a hashable key)."""
    aval = jax.typeof(x)
    return (aval.shape, aval.dtype, getattr(aval, "weak_type", False))


def local_abstract_key(x, stacked: bool):
    """``abstract_key`` of what one replica sees of ``x`` (stacked: without its first axis)."""
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
    "abstract_key", "array_like_guard", "backend_started", "broadcast_dimensions", "close_jaxpr",
    "ClosedJaxpr", "collective_axes", "collective_groups", "cond_branches", "conv_dimensions",
    "cumulative_reverse", "current_trace", "distributed_client", "distributed_coordinator_address",
    "dot_dimensions", "eqn_frames", "eqn_jaxprs", "eval_jaxpr", "failure_reported_hooks",
    "forget_failed_effect_tokens", "gather_dimensions", "identity_primitive",
    "initialize_distributed", "is_graph_node", "is_staging", "is_tracer", "Jaxpr", "jaxpr_as_fun",
    "jaxpr_constants", "JAXPRS_MERGED", "kv_delete", "kv_get", "kv_set", "kv_try_get",
    "layer_dtype", "Literal", "local_abstract_key", "make_mesh", "Mesh", "NamedSharding",
    "op_axes", "open_jaxpr", "optimization_barrier", "P", "padding_config", "PartitionSpec",
    "pbroadcast_p", "preemption_service_running", "Primitive", "psum_invariant_p",
    "put_host_arrays", "pvary_p", "reached_preemption_sync_point", "reduce_scatter_p",
    "register_array_like", "scan_parts", "scatter_dimensions", "set_cpu_device_count", "shard_map",
    "shard_map_body", "shard_map_without_inputs", "slice_bounds", "slice_sizes",
    "start_coordination_service", "trace_state_clean", "Tracer", "transpose_permutation",
    "while_parts",
]
