"""``Strategy.run`` and its decorator forms (TF's rules for ``run`` and ``ReplicaContext``)."""

import collections

import jax
import jax.numpy as jnp
from flax import nnx
import numpy as np
import optax
import pytest

import jaxmirror as jm
from conftest import mirrored
from jaxmirror.core import inflight

NS = [2, 4, 8]


def rid():
    return jm.get_replica_context().replica_id_in_sync_group


def per_replica(s, fn):
    return s.experimental_distribute_values_from_function(lambda c: fn(c.replica_id_in_sync_group))


def local(s, v):
    return [np.asarray(x).tolist() for x in s.experimental_local_results(v)]


def is_mirrored_array(s, x):
    return (isinstance(x, jax.Array) and x.sharding.is_fully_replicated
            and x.sharding.device_set == set(s.extended.devices))


# -- the two spellings ----------------------------------------------------------------------
def test_zero_argument_function_runs_now():
    s = mirrored(2)
    out = s.run(lambda: jm.get_replica_context().all_reduce("sum", 1.0))
    assert float(out) == 2.0


def test_decorator_on_function_with_positional_parameter_returns_step():
    s = mirrored(2)

    @s.run
    def step(params, batch):
        return params + jm.get_replica_context().all_reduce("sum", batch)

    assert callable(step) and isinstance(step, jm.step.program.Step)
    b = per_replica(s, lambda i: np.float32(i + 1))
    assert float(step(jnp.float32(10), b)) == 13.0


def test_function_makes_a_step_whatever_the_signature():
    s = mirrored(4)
    step = s.function(lambda: rid() * 2)
    assert local(s, step()) == [0, 2, 4, 6]

    @s.function(donate_argnums=())
    def with_kw(x, *, scale=1):
        return x * scale

    assert float(with_kw(jnp.float32(2), scale=3)) == 6.0


def test_decorator_run_and_function_share_one_program():
    s = mirrored(2)
    calls = []

    def fn(x):
        calls.append(1)  # a Python side effect: once per trace, not once per replica
        return x + rid()

    step = s.run(fn)
    assert s.function(fn).program is step.program
    step(jnp.ones(3))
    s.run(fn, args=(jnp.ones(3),))
    s.run(fn, args=[jnp.zeros(3)])
    assert len(calls) == 1 and step.trace_count == 1
    step(jnp.ones(4))  # a new signature traces again
    assert len(calls) == 2 and step.trace_count == 2


def test_args_must_be_list_or_tuple():
    s = mirrored(2)
    with pytest.raises(ValueError, match=r"positional args must be a list or tuple, got <class 'int'>"):
        s.run(lambda x: x, args=1)
    with pytest.raises(ValueError, match="kwargs must be a dict"):
        s.run(lambda x: x, args=(1,), kwargs=[1])
    with pytest.raises(ValueError, match="RunOptions"):
        s.run(lambda: 1, options={"donate_argnums": 0})


def test_args_given_explicitly_run_now_even_for_positional_functions():
    s = mirrored(2)
    out = s.run(lambda x: x * 2, args=(jnp.float32(4),))
    assert float(out) == 8.0
    out = s.run(lambda x, y=1: x + y, kwargs={"x": jnp.float32(1), "y": 2})
    assert float(out) == 3.0


# -- arguments and results -------------------------------------------------------------------
@pytest.mark.parametrize("n", NS)
def test_per_replica_args_give_each_replica_its_component(n):
    s = mirrored(n)
    v = per_replica(s, lambda i: np.full((2,), i, np.float32))
    out = s.run(lambda x, c: x * 10 + c, args=(v, jnp.float32(1)))
    assert isinstance(out, jm.PerReplica)
    assert local(s, out) == [[10.0 * i + 1] * 2 for i in range(n)]


@pytest.mark.parametrize("n", NS)
def test_replicated_results_are_mirrored_arrays(n):
    s = mirrored(n)
    v = per_replica(s, lambda i: np.float32(i))

    def fn(x, w):
        total = jm.get_replica_context().all_reduce("sum", x)
        return {"sum": total, "w2": w * 2, "local": x + w, "const": 3.0, "id": rid()}

    out = s.run(fn, args=(v, jnp.arange(3.0)))
    assert is_mirrored_array(s, out["sum"]) and float(out["sum"]) == sum(range(n))
    assert is_mirrored_array(s, out["w2"]) and out["w2"].tolist() == [0.0, 2.0, 4.0]
    assert is_mirrored_array(s, out["const"]) and float(out["const"]) == 3.0
    assert isinstance(out["local"], jm.PerReplica)
    assert local(s, out["local"]) == [[float(i), i + 1.0, i + 2.0] for i in range(n)]
    assert local(s, out["id"]) == list(range(n))
    # Mirrored counts as N identical components.
    assert local(s, out["sum"]) == [sum(range(n))] * n


def test_structures_are_preserved_both_ways():
    s = mirrored(2)
    Pair = collections.namedtuple("Pair", "a b")
    arg = {"p": Pair(jnp.float32(1), [jnp.float32(2), (jnp.float32(3),)]), "none": None}

    def fn(tree):
        assert isinstance(tree["p"], Pair) and tree["none"] is None
        return Pair(tree["p"].a + rid(), {"nested": tree["p"].b})

    out = s.run(fn, args=(arg,))
    assert isinstance(out, Pair)
    assert local(s, out.a) == [1.0, 2.0]
    assert float(out.b["nested"][0]) == 2.0 and float(out.b["nested"][1][0]) == 3.0


def test_python_numbers_and_numpy_passed_whole():
    s = mirrored(4)
    out = s.run(lambda a, b: a + b.sum(), args=(2, np.arange(3)))
    assert is_mirrored_array(s, out) and int(out) == 5


def test_bad_output_type_is_a_clear_error():
    s = mirrored(2)
    with pytest.raises(TypeError, match=r"must return arrays.*got str at \['name'\]"):
        s.run(lambda: {"name": "x"})


@pytest.mark.parametrize("strategy", ["one_device", "mirrored1"])
def test_one_replica_returns_plain_values(strategy):
    s = jm.OneDeviceStrategy("CPU:3") if strategy == "one_device" else mirrored(1)

    def fn(x):
        ctx = jm.get_replica_context()
        return x + ctx.replica_id_in_sync_group, ctx.all_reduce("sum", x), ctx.all_reduce("mean", 3)

    a, b, c = s.run(fn, args=(jnp.float32(5),))
    for v in (a, b, c):
        assert isinstance(v, jax.Array) and not isinstance(v, jm.DistributedValues)
    assert (float(a), float(b), float(c)) == (5.0, 5.0, 3.0)
    assert c.dtype == jnp.float32  # integer MEAN still gives a float
    assert s.experimental_local_results(a) == (a,)
    if strategy == "one_device":
        assert a.devices() == {jax.devices()[3]}


def test_default_strategy_run_calls_fn_directly():
    default = jm.get_strategy()
    seen = []
    out = default.run(lambda x: seen.append(jm.get_replica_context()) or x + 1, args=(1,))
    assert out == 2 and seen[0].replica_id_in_sync_group == 0


# -- ReplicaContext collectives ----------------------------------------------------------------
@pytest.mark.parametrize("n", NS)
def test_all_reduce_sum_and_mean_on_nests(n):
    s = mirrored(n)

    def fn():
        ctx = jm.get_replica_context()
        x = {"f": rid().astype(jnp.float32), "i": rid()}
        return ctx.all_reduce("SUM", x), ctx.all_reduce(jm.ReduceOp.MEAN, x), ctx.all_reduce("mean", x["i"])

    total, mean, imean = s.run(fn)
    assert float(total["f"]) == sum(range(n)) and int(total["i"]) == sum(range(n))
    assert float(mean["f"]) == pytest.approx((n - 1) / 2)
    assert imean.dtype == jnp.float32 and float(imean) == pytest.approx((n - 1) / 2)


def test_all_reduce_bad_op_raises_before_device_work():
    s = mirrored(2)
    with pytest.raises(ValueError, match="'MAX' is not a valid ReduceOp"):
        s.run(lambda: jm.get_replica_context().all_reduce("MAX", 1.0))


@pytest.mark.parametrize("n", NS)
def test_all_gather_concatenates_in_replica_order(n):
    s = mirrored(n)

    def fn():
        ctx = jm.get_replica_context()
        x = jnp.full((1, 2), rid())
        return ctx.all_gather(x, axis=0), ctx.all_gather({"t": x}, axis=-1)

    rows, cols = s.run(fn)
    assert rows.tolist() == [[i, i] for i in range(n)]
    assert cols["t"].tolist() == [[i for i in range(n) for _ in range(2)]]


def test_all_gather_errors():
    s = mirrored(2)
    with pytest.raises(ValueError, match="rank >= 1"):
        s.run(lambda: jm.get_replica_context().all_gather(jnp.float32(1), axis=0))
    with pytest.raises(ValueError, match=r"`axis` must be an int in \[-2, 2\)"):
        s.run(lambda: jm.get_replica_context().all_gather(jnp.ones((1, 2)), axis=2))


# -- gradients -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", NS)
def test_gradients_are_per_replica(n):
    s = mirrored(n)
    xs = np.arange(n * 3, dtype=np.float32).reshape(n, 3) / 10
    x = per_replica(s, lambda i: xs[i])
    w = jnp.array([0.5, -1.0, 2.0])

    def fn(w, x):
        g = jax.grad(lambda w: jnp.sum(jnp.tanh(w * x)))(w)
        return g, jm.get_replica_context().all_reduce("sum", g)

    g, gsum = s.run(fn, args=(w, x))
    expect = [jax.grad(lambda w: jnp.sum(jnp.tanh(w * xs[i])))(w) for i in range(n)]
    np.testing.assert_allclose(np.stack(s.experimental_local_results(g)), np.stack(expect), rtol=1e-6)
    np.testing.assert_allclose(gsum, np.sum(expect, 0), rtol=1e-5)


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_gradient_of_all_reduce_is_all_reduce_of_upstream(op):
    n = 4
    s = mirrored(n)
    xs = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    x = per_replica(s, lambda i: xs[i])
    coef = per_replica(s, lambda i: np.float32(i + 1))

    def fn(w, x, c):
        # d/dw of c_i * sum(all_reduce(w * x)) = all_reduce(c)(op) * x_i   (TF's rule)
        return jax.grad(lambda w: c * jnp.sum(jm.get_replica_context().all_reduce(op, w * x)))(w)

    g = s.run(fn, args=(jnp.ones(2), x, coef))
    upstream = sum(range(1, n + 1)) / (n if op == "mean" else 1)
    for i, gi in enumerate(s.experimental_local_results(g)):
        np.testing.assert_allclose(gi, upstream * xs[i], rtol=1e-6)


def test_gradient_of_all_gather_is_summed_upstream_sliced():
    n = 4
    s = mirrored(n)
    weights = np.arange(n * 2, dtype=np.float32).reshape(n * 2)  # upstream on the gathered vector
    coef = per_replica(s, lambda i: np.float32(i + 1))

    def fn(c):
        x = jnp.ones(2) * (rid() + 1.0)
        return jax.grad(lambda x: c * jnp.sum(jm.get_replica_context().all_gather(x, 0) * weights))(x)

    g = s.run(fn, args=(coef,))
    total = sum(range(1, n + 1))
    for i, gi in enumerate(s.experimental_local_results(g)):
        np.testing.assert_allclose(gi, total * weights[2 * i:2 * i + 2])


# -- composition with JAX transformations ---------------------------------------------------------
def test_run_composes_with_jit():
    s = mirrored(4)
    step = s.function(lambda p: p + jm.get_replica_context().all_reduce("sum", 1.0))

    @jax.jit
    def two_steps(p):
        return s.run(lambda p: p * 2, args=(step(p),))

    assert two_steps(jnp.ones(3)).tolist() == [10.0] * 3


def test_run_composes_with_scan():
    s = mirrored(4)
    x = per_replica(s, lambda i: np.float32(i))
    step = s.function(lambda p, x: p + jm.get_replica_context().all_reduce("sum", x))
    out, _ = jax.lax.scan(lambda c, _: (step(c, x), None), jnp.float32(0), None, length=5)
    assert float(out) == 5 * 6.0


def test_run_composes_with_grad():
    s = mirrored(4)
    x = per_replica(s, lambda i: np.float32(i + 1))

    def total(w):
        return s.reduce("sum", s.run(lambda w, x: w * w * x, args=(w, x)))

    assert float(jax.grad(total)(2.0)) == pytest.approx(2 * 2.0 * 10)


# -- donation and steps in flight -------------------------------------------------------------------
def test_donation_reuses_params_buffers():
    s = mirrored(2)
    params = {"w": s.run(lambda: jnp.zeros(4))}
    step = s.function(lambda p: jax.tree.map(lambda v: v + 1, p), donate_argnums=0)
    new = step(params)
    assert params["w"].is_deleted()
    # Checked on the devices: JAX 0.11 on CPU no longer donates an array once it was read to
    # the host (`.tolist()`, `np.asarray`), silently (README, "JAX versions").
    assert bool(jnp.all(new["w"] == 1.0)) and new["w"].shape == (4,)
    opt = jm.RunOptions(donate_argnums=(0,))
    newer = s.run(lambda p: jax.tree.map(lambda v: v + 1, p), args=(new,), options=opt)
    assert new["w"].is_deleted() and newer["w"].tolist() == [2.0] * 4


def test_passing_donated_params_again_is_a_clear_error_not_a_crash():
    # JAX 0.10 kills the process when a deleted array reaches a multi-device program.
    s = mirrored(2)
    step = s.function(lambda p, x: jax.tree.map(lambda v: v + x, p), donate_argnums=(0,))
    params = {"w": [s.experimental_replicate(np.zeros(4, np.float32))]}
    new = step(params, 1.0)
    with pytest.raises(ValueError, match=r"argument 0 holds arrays an earlier call donated"):
        step(params, 1.0)  # a notebook cell run twice
    assert step(new, 1.0)["w"][0].tolist() == [2.0] * 4
    # An optax chain's state starts with an empty EmptyState: its first array is still found.
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
    opt_step = s.function(lambda o: jax.tree.map(lambda v: v + 1, o), donate_argnums=(0,))
    state = s.experimental_replicate(tx.init({"w": np.zeros(2, np.float32)}))
    opt_step(state)
    with pytest.raises(ValueError, match="argument 0 holds arrays an earlier call donated"):
        opt_step(state)


def test_donating_replicated_params_leaves_the_callers_arrays_alive():
    # jax.device_put would reuse the buffer already on device 0 for the replicated copy, and
    # donating the copy would then delete the caller's array as well.
    s = mirrored(2)
    x = jax.device_put(jnp.arange(3.0), jax.devices()[0])
    params = s.experimental_replicate({"x": x})
    step = s.function(lambda p: p["x"] + 1, donate_argnums=0)
    assert step(params).tolist() == [1.0, 2.0, 3.0] and params["x"].is_deleted()
    assert not x.is_deleted() and x.tolist() == [0.0, 1.0, 2.0]
    module = nnx.Linear(2, 2, rngs=nnx.Rngs(0))  # NNX objects get new buffers too
    kernel = module.kernel[...]
    s.experimental_replicate(module)
    assert all(shard.data.unsafe_buffer_pointer() != kernel.unsafe_buffer_pointer()
               for shard in module.kernel[...].addressable_shards)


def test_run_options_validation():
    with pytest.raises(ValueError, match="donate_argnums"):
        jm.RunOptions(donate_argnums=(-1,))
    assert jm.RunOptions(donate_argnums=1).donate_argnums == (1,)


def test_unsynchronised_loop_does_not_deadlock_on_cpu():
    inflight.drain()
    s = mirrored(8)
    step = s.function(lambda p: p + jm.get_replica_context().all_reduce("sum", 1.0))
    p = jnp.float32(0)
    for _ in range(200):
        p = step(p)
        assert len(inflight.queued()) <= inflight.MAX_IN_FLIGHT
    assert float(p) == 1600.0


def test_steps_without_outputs_are_bounded_too():
    inflight.drain()
    s = mirrored(8)

    def no_outputs(x):
        jax.debug.callback(lambda v: None, jm.get_replica_context().all_reduce("sum", x))

    step = s.function(no_outputs)
    for _ in range(100):
        assert step(jnp.ones(())) is None
    assert 0 < len(inflight.queued()) <= inflight.MAX_IN_FLIGHT


def test_reduce_in_an_unsynchronised_loop_is_bounded_too():
    inflight.drain()
    s = mirrored(8)
    v = per_replica(s, lambda i: np.float32(i))
    for _ in range(64):
        r = s.reduce("sum", v, axis=None)
        g = s.gather(s.run(lambda x: x[None], args=(v,)), axis=0)
        assert len(inflight.queued()) <= inflight.MAX_IN_FLIGHT
    assert float(r) == 28.0 and g.tolist() == list(range(8))


def test_compile_count_sees_placement_only_rebuilds_without_retracing():
    s = mirrored(2)
    step = s.function(lambda p: p + 1)
    p = step(np.zeros(3, np.float32))  # host input
    p = step(p)  # now replicated on the mesh: same shapes, another placement
    p = step(p)
    assert (step.trace_count, step.compile_count) == (1, 2)
    placed = s.function(lambda p: p + 1)
    q = placed(jax.device_put(np.zeros(3, np.float32), s.extended.replicated_sharding))
    placed(placed(q))
    assert (placed.trace_count, placed.compile_count) == (1, 1)


def test_in_flight_handle_is_the_smallest_output_found_without_flattening():
    inflight.drain()
    s = mirrored(4)
    x = per_replica(s, lambda i: np.float32(i))

    @s.run
    def step(params, x):
        return {"params": params + 1, "metrics": (x * 2, jm.get_replica_context().all_reduce("sum", x))}

    out = step(jnp.zeros((64, 64)), x)
    assert inflight.queued()[-1] is out["metrics"][0].stacked  # 4 floats beat a 64x64 array
    out = step(jnp.zeros((64, 64)), x)
    assert inflight.queued()[-1] is out["metrics"][0].stacked


def test_one_device_is_not_bounded():
    assert not jm.OneDeviceStrategy("CPU:0").extended.placement.bound_in_flight
    assert not mirrored(1).extended.placement.bound_in_flight
    assert mirrored(2).extended.placement.bound_in_flight
