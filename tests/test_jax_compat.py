"""Every accessor of ``jaxmirror/core/_compat.py``, against the JAX installed (0.10.2 to 0.11).

``_compat`` is the one module that reads JAX's and flax's internals (a primitive's parameters,
``jax._src``). Each test here exercises one accessor on a real program, so a JAX upgrade that
moves a fact fails here first, and names it; ``test_every_accessor_is_exercised_here`` keeps the
list whole.
"""

import os
import pathlib
import subprocess
import sys
import textwrap
import threading

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxmirror.core import _compat

HERE = pathlib.Path(__file__)


def _eqns(fn, *args, **kwargs):
    """The top-level equations of ``fn``'s jaxpr."""
    return _compat.open_jaxpr(jax.make_jaxpr(fn, **kwargs)(*args)).eqns


def _only(fn, *args, primitive, **kwargs):
    """The one top-level equation of ``fn``'s jaxpr that binds ``primitive``."""
    (eqn,) = [e for e in _eqns(fn, *args, **kwargs) if e.primitive is primitive]
    return eqn


def test_every_accessor_is_exercised_here():
    source = HERE.read_text()
    missing = [name for name in _compat.__all__ if f"_compat.{name}" not in source]
    assert not missing, f"accessors of core/_compat.py without a test here: {missing}"


# -- jaxprs --------------------------------------------------------------------------------
def test_open_closed_and_constants_of_a_jaxpr():
    c = jnp.arange(3.0)
    closed = jax.make_jaxpr(lambda x: x * c + 1.0)(jnp.ones(3))
    assert isinstance(closed, _compat.ClosedJaxpr)
    body = _compat.open_jaxpr(closed)
    assert isinstance(body, _compat.Jaxpr) and _compat.open_jaxpr(body) is body
    consts = _compat.jaxpr_constants(closed)
    assert len(consts) == len(body.constvars) == 1 and np.array_equal(consts[0], c)
    assert len(body.invars) == 1 and len(body.eqns) == 2
    # JAX 0.11 has one class; 0.10 wraps an open Jaxpr in a ClosedJaxpr.
    assert _compat.JAXPRS_MERGED == (jax.__version_info__ >= (0, 11))
    assert any(isinstance(v, _compat.Literal) for e in body.eqns for v in e.invars)


def test_eval_jaxpr_jaxpr_as_fun_and_close_jaxpr_run_a_program():
    closed = jax.make_jaxpr(lambda x, y: (x * y, x - y))(2.0, 3.0)
    body = _compat.open_jaxpr(closed)
    assert [float(v) for v in _compat.eval_jaxpr(body, _compat.jaxpr_constants(closed),
                                                  2.0, 5.0)] == [10.0, -3.0]
    assert [float(v) for v in _compat.jaxpr_as_fun(closed)(4.0, 1.0)] == [4.0, 3.0]
    plain = jax.make_jaxpr(lambda x: x + 1.0)(1.0)
    reclosed = _compat.close_jaxpr(_compat.open_jaxpr(plain))
    assert [float(v) for v in _compat.jaxpr_as_fun(reclosed)(2.0)] == [3.0]
    c = jnp.arange(2.0)
    with_constant = _compat.open_jaxpr(jax.make_jaxpr(lambda x: x + c)(c))
    with pytest.raises(ValueError, match="close_jaxpr: the jaxpr has constants"):
        _compat.close_jaxpr(with_constant)


def test_eqn_jaxprs_finds_calls_branches_and_loop_bodies():
    def fn(x):
        y = jax.jit(lambda v: v * 2)(x)
        z = lax.cond(x.sum() > 0, lambda v: v + 1, lambda v: v - 1, y)
        return lax.while_loop(lambda v: v.sum() < 10, lambda v: v + 1, z)

    counts = {e.primitive.name: len(_compat.eqn_jaxprs(e)) for e in _eqns(fn, jnp.ones(2))
              if _compat.eqn_jaxprs(e)}
    assert counts == {"jit": 1, "cond": 2, "while": 2}
    assert all(e.primitive.name != "add" or not _compat.eqn_jaxprs(e)
               for e in _eqns(fn, jnp.ones(2)))


@pytest.mark.parametrize("case", ["consts-carry-xs", "carry-only", "shapes-alike", "no-carry"])
def test_scan_parts_splits_constants_carry_and_scanned_inputs(case):
    w, b = jnp.ones((3, 3)), jnp.ones((5, 3))  # b: a constant shaped like a scanned input

    def body(carry, x):
        return carry @ w + x.sum() + b.sum(), carry * 2

    if case == "consts-carry-xs":
        fn, args, want = lambda c, xs: lax.scan(body, c, xs), (jnp.ones(3), jnp.ones((5, 3))), (2, 1)
    elif case == "carry-only":
        fn, args, want = (lambda c: lax.scan(lambda c, _: (c + 1.0, None), c, None, length=4),
                          (jnp.ones(2),), (0, 1))
    elif case == "shapes-alike":  # carry (3,), xs (3, 3): a slice has the carry's shape
        fn, args, want = (lambda c, xs: lax.scan(lambda c, x: (c + x, c), c, xs),
                          (jnp.ones(3), jnp.ones((3, 3))), (0, 1))
    else:
        fn, args, want = (lambda xs: lax.scan(lambda c, x: (c, x * w[0]), (), xs)[1],
                          (jnp.ones((5, 3)),), (1, 0))
    eqn = _only(fn, *args, primitive=lax.scan_p)
    scan_body, n_consts, n_carry = _compat.scan_parts(eqn)
    assert (n_consts, n_carry) == want
    assert isinstance(scan_body, _compat.Jaxpr) and len(scan_body.invars) == len(eqn.invars)
    # JAX's own count, under either version's parameters.
    p = eqn.params
    if "num_consts" in p:
        assert (p["num_consts"], p["num_carry"]) == want
    else:
        assert tuple(len(t) for t in p["ft_in"].unpack()[:2]) == want


def test_while_parts_splits_the_condition_and_body_constants():
    limit, step = jnp.float32(10.0), jnp.ones(2)
    eqn = _only(lambda x: lax.while_loop(lambda v: v.sum() < limit, lambda v: v + step, x),
                jnp.zeros(2), primitive=lax.while_p)
    cond, body, n_cond, n_body = _compat.while_parts(eqn)
    assert (n_cond, n_body) == (eqn.params["cond_nconsts"], eqn.params["body_nconsts"]) == (1, 1)
    assert len(cond.outvars) == 1 and len(body.outvars) == len(eqn.outvars) == 1


def test_cond_branches_are_open_jaxprs_in_index_order():
    eqn = _only(lambda i, x: lax.switch(i, [lambda v: v + 1, lambda v: v * 3, jnp.sin], x),
                1, 2.0, primitive=lax.cond_p)
    branches = _compat.cond_branches(eqn)
    assert [b.eqns[0].primitive for b in branches] == [lax.add_p, lax.mul_p, lax.sin_p]


def test_shard_map_body_and_dropping_an_unused_input():
    mesh = _compat.make_mesh(jax.devices()[:2], "r")
    assert isinstance(mesh, _compat.Mesh) and mesh.axis_names == ("r",) and mesh.devices.size == 2
    fn = _compat.shard_map(lambda x, unused, y: lax.psum(x * y, "r"), mesh,
                           (_compat.P("r"), _compat.P(), _compat.P()), _compat.P())
    args = (jnp.arange(4.0), jnp.ones(7), jnp.float32(2.0))
    closed = jax.make_jaxpr(fn)(*args)
    (eqn,) = _compat.open_jaxpr(closed).eqns
    body = _compat.shard_map_body(eqn)
    assert len(body.invars) == 3 and body.eqns[-1].primitive is lax.psum_p
    smaller = _compat.shard_map_without_inputs(closed, {1})
    (small_eqn,) = _compat.open_jaxpr(smaller).eqns
    assert len(_compat.open_jaxpr(smaller).invars) == 2
    assert len(_compat.shard_map_body(small_eqn).invars) == 2
    got = _compat.jaxpr_as_fun(smaller)(args[0], args[2])
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(fn(*args)))


def test_shard_map_gives_per_replica_gradients_as_pmap_does():
    # check_vma=False: the gradient of a replicated input is per replica, not summed.
    mesh = _compat.make_mesh(jax.devices()[:2], "r")
    fn = _compat.shard_map(lambda w, x: jax.grad(lambda w: (w * x).sum())(w)[None], mesh,
                           (_compat.P(), _compat.P("r")), _compat.P("r"))
    np.testing.assert_array_equal(fn(jnp.float32(1.0), jnp.array([1.0, 2.0])), [1.0, 2.0])


@pytest.mark.parametrize("name", ["psum", "pmax", "pmin", "all_gather", "psum_scatter",
                                  "ppermute", "all_to_all", "psum_invariant"])
def test_collective_axes_and_groups(name):
    ops = {
        "psum": (lambda x: lax.psum(x, "i"), lax.psum_p),
        "pmax": (lambda x: lax.pmax(x, "i"), lax.pmax_p),
        "pmin": (lambda x: lax.pmin(x, "i"), lax.pmin_p),
        "all_gather": (lambda x: lax.all_gather(x, "i"), lax.all_gather_p),
        "psum_scatter": (lambda x: lax.psum_scatter(x, "i"), _compat.reduce_scatter_p),
        "ppermute": (lambda x: lax.ppermute(x, "i", [(0, 1), (1, 0)]), lax.ppermute_p),
        "all_to_all": (lambda x: lax.all_to_all(x, "i", 0, 0), lax.all_to_all_p),
        "psum_invariant": (None, _compat.psum_invariant_p),
    }
    fn, primitive = ops[name]
    assert isinstance(primitive, _compat.Primitive)
    if fn is None:  # what psum binds under check_vma=True
        mesh = _compat.make_mesh(jax.devices()[:2], "i")
        fn = jax.shard_map(lambda x: lax.psum(x, "i"), mesh=mesh, in_specs=_compat.P("i"),
                           out_specs=_compat.P())
        (eqn,) = [e for e in _compat.shard_map_body(_eqns(fn, jnp.ones(2))[0]).eqns
                  if e.primitive is primitive]
    else:
        eqn = _only(fn, jnp.ones(2), primitive=primitive, axis_env=[("i", 2)])
    assert _compat.collective_axes(eqn) == ("i",)
    assert _compat.collective_groups(eqn) is None


def test_pbroadcast_and_pvary_are_primitives_named_as_they_bind():
    assert _compat.pbroadcast_p.name == "pbroadcast" and _compat.pvary_p.name == "pvary"
    mesh = _compat.make_mesh(jax.devices()[:2], "i")
    fn = jax.shard_map(lambda x, y: x + lax.pcast(y, "i", to="varying"), mesh=mesh,
                       in_specs=(_compat.P("i"), _compat.P()), out_specs=_compat.P("i"))
    body = _compat.shard_map_body(_eqns(fn, jnp.ones(2), jnp.ones(1))[0])
    assert _compat.pvary_p in {e.primitive for e in body.eqns}


_OP_AXES_CASES = [
    ("sum", lambda x: x.sum(axis=(0, 2)), (2, 3, 4), lax.reduce_sum_p, (0, 2)),
    ("max", lambda x: x.max(axis=1), (2, 3), lax.reduce_max_p, (1,)),
    ("argmax", lambda x: jnp.argmax(x, axis=1), (2, 3), lax.argmax_p, (1,)),
    ("cumsum", lambda x: lax.cumsum(x, axis=1), (2, 3), lax.cumsum_p, (1,)),
    ("cummax", lambda x: lax.cummax(x, axis=0, reverse=True), (2, 3), lax.cummax_p, (0,)),
    ("split", lambda x: jnp.split(x, 2, axis=1), (2, 4), lax.split_p, (1,)),
    ("sort", lambda x: lax.sort(x, dimension=0), (2, 3), lax.sort_p, (0,)),
    ("top_k", lambda x: lax.top_k(x, 2), (3, 4), lax.top_k_p, (1,)),
    ("concatenate", lambda x: jnp.concatenate([x, x], axis=1), (2, 3), lax.concatenate_p, (1,)),
    ("rev", lambda x: lax.rev(x, (0, 1)), (2, 3), lax.rev_p, (0, 1)),
    ("squeeze", lambda x: lax.squeeze(x, (1,)), (2, 1, 3), lax.squeeze_p, (1,)),
]


@pytest.mark.parametrize("name,fn,shape,primitive,axes", _OP_AXES_CASES,
                         ids=[c[0] for c in _OP_AXES_CASES])
def test_op_axes(name, fn, shape, primitive, axes):
    eqn = _only(fn, jnp.ones(shape), primitive=primitive)
    assert _compat.op_axes(eqn) == axes


def test_op_axes_of_stack():
    # jnp.stack is a broadcast and a concatenate; lax.stack_p is what a stack of tracers binds
    # inside some flax layers. Bound directly, it names its axis.
    eqn = _only(lambda x, y: lax.stack_p.bind(x, y, axis=1), jnp.ones(2), jnp.ones(2),
                primitive=lax.stack_p)
    assert _compat.op_axes(eqn) == (1,)


def test_cumulative_reverse():
    fwd = _only(lambda x: lax.cumsum(x), jnp.ones(3), primitive=lax.cumsum_p)
    back = _only(lambda x: lax.cumsum(x, reverse=True), jnp.ones(3), primitive=lax.cumsum_p)
    assert (_compat.cumulative_reverse(fwd), _compat.cumulative_reverse(back)) == (False, True)


def test_shape_operations():
    assert _compat.transpose_permutation(
        _only(lambda x: x.transpose(2, 0, 1), jnp.ones((2, 3, 4)), primitive=lax.transpose_p)
    ) == (2, 0, 1)
    assert _compat.broadcast_dimensions(
        _only(lambda x: jnp.broadcast_to(x, (5, 3)), jnp.ones(3),
              primitive=lax.broadcast_in_dim_p)) == (1,)
    assert _compat.slice_bounds(
        _only(lambda x: x[1:3, ::2], jnp.ones((4, 6)), primitive=lax.slice_p)
    ) == ((1, 0), (3, 6), (1, 2))
    assert _compat.slice_bounds(
        _only(lambda x: x[1:3], jnp.ones(4), primitive=lax.slice_p))[2] in (None, (1,))
    assert _compat.slice_sizes(
        _only(lambda x, i: lax.dynamic_slice(x, (i, 0), (2, 3)), jnp.ones((4, 3)), 1,
              primitive=lax.dynamic_slice_p)) == (2, 3)
    assert _compat.padding_config(
        _only(lambda x: lax.pad(x, 0.0, [(1, 2, 0), (0, 0, 1)]), jnp.ones((2, 3)),
              primitive=lax.pad_p)) == ((1, 2, 0), (0, 0, 1))


def test_dot_dimensions():
    eqn = _only(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), jnp.ones((2, 3, 4)),
                jnp.ones((2, 4, 5)), primitive=lax.dot_general_p)
    assert _compat.dot_dimensions(eqn) == (((2,), (1,)), ((0,), (0,)))


def test_gather_and_scatter_dimensions():
    gather = _only(lambda x, i: x[i], jnp.ones((5, 3)), jnp.array([0, 2]), primitive=lax.gather_p)
    dn = _compat.gather_dimensions(gather)
    assert tuple(dn.offset_dims) == (1,) and tuple(dn.collapsed_slice_dims) == (0,)
    assert tuple(dn.operand_batching_dims) == () == tuple(dn.start_indices_batching_dims)
    assert _compat.slice_sizes(gather) == (1, 3)
    scatter = _only(lambda x, i: x.at[i].add(1.0), jnp.ones((5, 3)), jnp.array([0, 2]),
                    primitive=lax.scatter_add_p)
    assert tuple(_compat.scatter_dimensions(scatter).scatter_dims_to_operand_dims) == (0,)


def test_conv_dimensions():
    eqn = _only(lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                                      dimension_numbers=("NHWC", "HWIO", "NHWC")),
                jnp.ones((2, 5, 5, 3)), jnp.ones((3, 3, 3, 4)),
                primitive=lax.conv_general_dilated_p)
    dn, batch_groups = _compat.conv_dimensions(eqn)
    assert (tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec)) == (
        (0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2))
    assert batch_groups == 1


def test_eqn_frames_name_the_line_that_made_an_equation():
    eqn = _only(lambda x: jnp.sin(x), 1.0, primitive=lax.sin_p)
    frames = _compat.eqn_frames(eqn)
    assert frames and any(f == str(HERE) for f, _, _ in frames)


# -- tracing state ------------------------------------------------------------------------
def test_tracers_traces_and_the_top_level():
    seen = {}

    def fn(x):
        seen["tracer"] = (_compat.is_tracer(x), isinstance(x, _compat.Tracer))
        seen["staging"] = _compat.is_staging(_compat.current_trace())
        seen["clean"] = _compat.trace_state_clean()
        return x

    jax.jit(fn)(1.0)
    assert seen == {"tracer": (True, True), "staging": True, "clean": False}
    assert not _compat.is_tracer(jnp.ones(1)) and _compat.trace_state_clean()
    assert not _compat.is_staging(_compat.current_trace())
    jax.grad(fn)(1.0)
    assert seen["tracer"] == (True, True) and not seen["staging"]


def test_abstract_keys_leave_placement_out():
    x = jax.device_put(jnp.ones((4, 3), jnp.float32), jax.devices()[1])
    assert _compat.abstract_key(x) == ((4, 3), jnp.float32, False)
    assert _compat.abstract_key(1.0)[2] is True  # a Python float is weakly typed
    assert _compat.local_abstract_key(x, stacked=True) == ((3,), jnp.float32, False)
    assert _compat.local_abstract_key(x, stacked=False) == ((4, 3), jnp.float32, False)


def test_identity_primitive_compiles_to_nothing_and_transposes_as_told():
    mark = _compat.identity_primitive("test_compat_mark", lambda ct: ct * 2)
    assert float(mark.bind(jnp.float32(3.0))) == 3.0
    assert float(jax.jit(lambda x: mark.bind(x) + 1)(jnp.float32(1.0))) == 2.0
    assert float(jax.grad(lambda x: mark.bind(x) * 3.0)(jnp.float32(1.0))) == 6.0
    np.testing.assert_array_equal(jax.vmap(mark.bind)(jnp.arange(3.0)), [0.0, 1.0, 2.0])
    text = jax.jit(lambda x: mark.bind(x)).lower(jnp.float32(1.0)).as_text()
    assert "test_compat_mark" not in text


def test_layer_dtype_is_flax_layers_output_dtype():
    x16, w32 = jnp.ones(2, jnp.bfloat16), jnp.ones(2, jnp.float32)
    assert _compat.layer_dtype(x16, w32) == jnp.float32
    assert _compat.layer_dtype(x16, None) == jnp.bfloat16
    assert _compat.layer_dtype(w32, dtype=jnp.float16) == jnp.float16


def test_is_graph_node_knows_flax_modules():
    module = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    assert _compat.is_graph_node(module) and _compat.is_graph_node(nnx.Rngs(0))
    assert not _compat.is_graph_node(jnp.ones(2)) and not _compat.is_graph_node({"a": 1})


class _Box:
    def __init__(self, value):
        self.value = value


def test_register_array_like_and_its_refusal_flag():
    _compat.register_array_like(_Box, lambda b: jnp.asarray(b.value))
    box = _Box(np.arange(3.0, dtype=np.float32))
    assert float(jnp.sum(box)) == 3.0 and float(jax.jit(lambda b: b.sum())(box)) == 3.0

    class Refused(Exception):
        pass

    _compat.array_like_guard.refusal = Refused
    try:
        with pytest.raises(Refused):
            jax.jit(lambda b: b.sum())(box)
        seen = []
        other = threading.Thread(target=lambda: seen.append(float(jnp.sum(box))))
        other.start()
        other.join()
        assert seen == [3.0]  # the flag is per thread
    finally:
        _compat.array_like_guard.refusal = None


def test_optimization_barrier_keeps_values():
    a, b = _compat.optimization_barrier((jnp.float32(1.0), jnp.arange(2.0)))
    assert float(a) == 1.0 and b.tolist() == [0.0, 1.0]


# -- devices and transfers ----------------------------------------------------------------
def test_put_host_arrays_places_as_device_put_does():
    mesh = _compat.make_mesh(jax.devices()[:2], "r")
    sharding = _compat.NamedSharding(mesh, _compat.PartitionSpec("r"))
    host = [np.arange(4.0, dtype=np.float64), np.arange(2, dtype=np.int32)]
    placed = _compat.put_host_arrays(host, [sharding, sharding])
    want = jax.device_put(host, [sharding, sharding])
    for got, ref in zip(placed, want):
        assert got.dtype == ref.dtype and got.sharding == ref.sharding and got.committed
        np.testing.assert_array_equal(got, ref)
    placed[0] += 1  # a copy: the host array is untouched
    assert host[0].tolist() == [0.0, 1.0, 2.0, 3.0]
    mixed = _compat.put_host_arrays([jnp.ones(2), host[1]], [sharding, sharding])
    assert [a.sharding for a in mixed] == [sharding, sharding]


def test_backend_started_and_device_count_is_fixed():
    assert _compat.backend_started() and jax.device_count() == 8
    with pytest.raises(Exception, match="jax_num_cpu_devices"):
        _compat.set_cpu_device_count(8)


def test_failed_effect_tokens_are_forgotten():
    def boom(x):
        raise RuntimeError("boom in a callback")

    reported = []
    _compat.failure_reported_hooks.append(lambda: reported.append(True))
    try:
        with pytest.raises(Exception, match="boom in a callback"):
            jax.jit(lambda x: jax.debug.callback(boom, x) or x + 1)(jnp.ones(1)).block_until_ready()
        _compat.forget_failed_effect_tokens()
        jax.effects_barrier()  # raises again without the forgetting
        assert reported == [True]
    finally:
        _compat.failure_reported_hooks.pop()


def test_nan_checks_stay_on_after_a_block_turned_them_off():
    f = jax.jit(lambda x: jnp.log(x))
    f(jnp.float32(1.0))
    jax.config.update("jax_debug_nans", True)
    try:
        with jax.debug_nans(False):
            f(jnp.float32(-1.0))
        for _ in range(2):  # the second call is the C++ cache's
            with pytest.raises(FloatingPointError):
                f(jnp.float32(-1.0))
    finally:
        jax.config.update("jax_debug_nans", False)


# -- jax.distributed: one process on loopback, in a subprocess -----------------------------
_DISTRIBUTED = textwrap.dedent("""
    import socket, jax
    jax.config.update("jax_enable_preemption_service", True)
    from jaxmirror.core import _compat
    assert _compat.distributed_client() is None and not _compat.preemption_service_running()
    assert _compat.distributed_coordinator_address() is None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    service = _compat.start_coordination_service(f"[::]:{port}", 1, heartbeat_s=10, shutdown_s=5)
    _compat.initialize_distributed(f"127.0.0.1:{port}", 1, 0, heartbeat_s=10, shutdown_s=5,
                                   start_service=False)
    client = _compat.distributed_client()
    assert client is not None and _compat.preemption_service_running()
    assert _compat.distributed_coordinator_address() == f"127.0.0.1:{port}"
    _compat.kv_set(client, "jm/a", "1")
    _compat.kv_set(client, "jm/a", "2", overwrite=True)
    assert _compat.kv_get(client, "jm/a", 1000) == "2"
    assert _compat.kv_try_get(client, "jm/b") is None
    assert _compat.kv_get(client, "jm/b", 100) is None
    _compat.kv_delete(client, "jm/a")
    assert _compat.kv_try_get(client, "jm/a") is None
    assert _compat.reached_preemption_sync_point(0) is False
    jax.distributed.shutdown()
    del service
    print("distributed accessors OK")
""")


def test_distributed_accessors_on_one_loopback_process():
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    out = subprocess.run([sys.executable, "-c", _DISTRIBUTED], capture_output=True, text=True,
                         timeout=120, env=env, cwd=HERE.parent.parent)
    assert out.returncode == 0 and "distributed accessors OK" in out.stdout, out.stderr[-3000:]
