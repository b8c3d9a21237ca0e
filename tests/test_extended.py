"""``merge_call`` and the variable APIs of ``StrategyExtended`` (TF's StrategyExtended page)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmirror as jm
from conftest import mirrored


def rid():
    return jm.get_replica_context().replica_id_in_sync_group


def comps(v):
    parts = v.values if isinstance(v, jm.DistributedValues) else (v.read_value(),)
    return [np.asarray(c).tolist() for c in parts]


def one_device():
    return jm.OneDeviceStrategy("CPU:0")


# -- TF's examples, names changed ------------------------------------------------------------------
def reduce_to_step(var):
    def merge_fn(strategy, value, var):
        # All-reduce the value. `value` here is a DistributedValues.
        reduced = strategy.extended.reduce_to(jm.ReduceOp.SUM, value, destinations=var)
        strategy.extended.update(var, lambda var, value: var.assign(value), args=(reduced,))

    value = jnp.asarray(1.)  # tf.identity(1.)
    jm.get_replica_context().merge_call(merge_fn, args=(value, var))


def batch_reduce_to_step(var):
    def merge_fn(strategy, value, var):
        reduced = strategy.extended.batch_reduce_to(jm.ReduceOp.SUM, [(value, var)])[0]
        strategy.extended.update(var, lambda var, value: var.assign(value), args=(reduced,))

    value = jnp.asarray(1.)
    jm.get_replica_context().merge_call(merge_fn, args=(value, var))


def run_tf_example(strategy, step_fn):
    with strategy.scope():
        v = jm.Variable(0.)
        strategy.run(step_fn, args=(v,))
        return v


@pytest.mark.parametrize("step_fn", [reduce_to_step, batch_reduce_to_step])
@pytest.mark.parametrize("make, expected", [(lambda: mirrored(2), 2.0), (lambda: mirrored(4), 4.0),
                                            (one_device, 1.0)])
def test_tf_reduce_to_examples_give_tf_numbers(step_fn, make, expected):
    s = make()
    v = run_tf_example(s, step_fn)
    n = s.num_replicas_in_sync
    assert comps(v) == [expected] * n
    assert float(v.numpy()) == expected
    if n > 1:
        assert type(v) is jm.MirroredVariable
        assert repr(v).startswith("MirroredVariable:{")
        assert "'Variable/replica_1:0'" in repr(v) and f"numpy={expected}>" in repr(v)
    else:
        assert type(v) is jm.Variable
        assert repr(v).startswith("<jaxmirror.Variable 'Variable:0' shape=() dtype=float32")


@pytest.mark.parametrize("make", [lambda: mirrored(2), lambda: mirrored(4), one_device])
def test_tf_update_example(make):
    s = make()
    with s.scope():
        v = jm.Variable(5.0, aggregation=jm.VariableAggregation.SUM)

    def update_fn(v):
        return v.assign(1.0)

    result = s.extended.update(v, update_fn)
    n = s.num_replicas_in_sync
    assert comps(v) == [1.0] * n
    if n > 1:
        assert isinstance(result, jm.Mirrored)
        assert [float(x) for x in result.values] == [1.0] * n
        assert repr(result).startswith("Mirrored:{\n  0: Array(1., dtype=float32)")
        assert float(s.reduce("sum", result, axis=None)) == n
    else:
        assert float(result) == 1.0


@pytest.mark.parametrize("make", [lambda: mirrored(2), lambda: mirrored(4), one_device])
def test_tf_colocate_vars_with_example(make):
    s = make()
    with s.scope():
        var1 = jm.Variable(1.0)
        with s.extended.colocate_vars_with(var1):
            # var2 and var3 will be created on the same device(s) as var1
            var2 = jm.Variable(2.0)
            var3 = jm.Variable(3.0)

    def fn(v1, v2, v3):
        # operates on v1 from var1, v2 from var2, and v3 from var3
        v1.assign(v1 + v2 * v3)
        v3.assign_add(1.0)
        return v1

    s.extended.update(var1, fn, args=(var2, var3))
    n = s.num_replicas_in_sync
    assert comps(var1) == [7.0] * n and comps(var3) == [4.0] * n and comps(var2) == [2.0] * n
    assert s.extended.variable_created_in_scope(var2)


@pytest.mark.parametrize("make", [lambda: mirrored(2), lambda: mirrored(4), one_device])
def test_tf_variable_created_in_scope_example(make):
    strategy = make()
    with strategy.scope():
        v = jm.Variable(1.)
    assert strategy.extended.variable_created_in_scope(v) is True
    assert strategy.extended.variable_created_in_scope(jm.Variable(1.)) is False
    other = mirrored(2)
    with other.scope():
        w = jm.Variable(1.)
    assert strategy.extended.variable_created_in_scope(w) is False
    with pytest.raises(ValueError, match="must be a jaxmirror Variable"):
        strategy.extended.variable_created_in_scope(jnp.ones(2))


# -- merge_call ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4])
def test_merge_fn_sees_per_replica_values_and_cross_replica_context(n):
    s = mirrored(n)
    seen = {}

    def merge_fn(strategy, x, scale, *, name):
        seen["ctx"] = (jm.in_cross_replica_context(), jm.get_replica_context(),
                       jm.get_strategy() is strategy, strategy is s)
        seen["types"] = (type(x).__name__, scale, name)
        local = strategy.experimental_local_results(x)
        return {
            "sum": strategy.reduce("sum", x, axis=None),
            "mean_rows": strategy.reduce("mean", x, axis=0),
            "gathered": strategy.gather(x, axis=0),
            "first": local[0] * scale,
            "last": local[-1],
            "count": len(local),
        }

    def fn():
        x = jnp.stack([rid(), rid() * 10]).astype(jnp.float32)
        return jm.get_replica_context().merge_call(merge_fn, args=(x, 2.0), kwargs={"name": "a"})

    out = s.run(fn)
    assert seen["ctx"] == (True, None, True, True)
    assert seen["types"][0] == "GatheredPerReplica" and seen["types"][1:] == (2.0, "a")
    ids = np.arange(n, dtype=np.float32)
    assert np.asarray(out["sum"]).tolist() == [ids.sum(), 10 * ids.sum()]
    assert float(out["mean_rows"]) == pytest.approx((ids.sum() * 11) / (2 * n))
    assert np.asarray(out["gathered"]).tolist() == np.stack([ids, ids * 10], 1).ravel().tolist()
    assert np.asarray(out["first"]).tolist() == [0.0, 0.0]
    assert np.asarray(out["last"]).tolist() == [n - 1, 10 * (n - 1)]
    assert out["count"] == n
    # Everything merge_fn computed is the same on every replica: Mirrored results.
    for leaf in jax.tree.leaves(out):
        if isinstance(leaf, jax.Array):
            assert leaf.sharding.is_fully_replicated


def test_merge_fn_runs_once_per_trace_not_per_replica():
    s = mirrored(4)
    calls = []

    @s.function
    def step(x):
        return jm.get_replica_context().merge_call(
            lambda strategy, y: calls.append(1) or strategy.reduce("sum", y, axis=None), args=(x,))

    assert float(step(jnp.float32(1))) == 4.0
    assert float(step(jnp.float32(2))) == 8.0
    assert len(calls) == step.trace_count == 1


@pytest.mark.parametrize("n", [2, 4])
def test_per_replica_result_gives_each_replica_its_component(n):
    s = mirrored(n)

    def merge_fn(strategy, x):
        # A new PerReplica built from the components: replica i gets component i back, doubled.
        return jm.PerReplica(jnp.stack(strategy.experimental_local_results(x)) * 2)

    def fn():
        y = jm.get_replica_context().merge_call(merge_fn, args=(rid() + 1.0,))
        return y + 0.5

    out = s.run(fn)
    assert isinstance(out, jm.PerReplica)
    assert [float(c) for c in s.experimental_local_results(out)] == [2 * i + 2.5 for i in range(n)]


def test_merge_call_returns_arguments_and_mirrored_values_unpacked():
    s = mirrored(2)

    def fn():
        ctx = jm.get_replica_context()
        x = rid() * 1.0
        back = ctx.merge_call(lambda strategy, v: v, args=(x,))  # a PerReplica handed back
        m = ctx.merge_call(lambda strategy: jm.Mirrored(jnp.float32(7), 2))
        const = ctx.merge_call(lambda strategy, c: c, args=(3,))
        return back, m, const

    back, m, const = s.run(fn)
    assert [float(c) for c in s.experimental_local_results(back)] == [0.0, 1.0]
    assert float(m) == 7.0 and int(const) == 3


def test_merge_call_gradient_flows_like_all_reduce():
    s = mirrored(2)

    def fn(w):
        def loss(w):
            y = w * (rid() + 1.0)
            total = jm.get_replica_context().merge_call(
                lambda strategy, v: strategy.reduce("sum", v, axis=None), args=(y,))
            return total

        return jax.grad(loss)(w)

    g = s.run(fn, args=(jnp.float32(1.0),))
    # d/dw of sum_r w*(r+1) seen per replica: the all-reduce's gradient is the all-reduce of the
    # upstream gradient (1 + 1 = 2) times the local factor (r + 1).
    assert [float(x) for x in s.experimental_local_results(g)] == [2.0, 4.0]


def test_merge_call_in_default_replica_context():
    ctx = jm.get_replica_context()
    out = ctx.merge_call(lambda strategy, x: (strategy is jm.get_strategy(),
                                              jm.in_cross_replica_context(), x * 2), args=(3,))
    assert out == (True, True, 6)
    assert not jm.in_cross_replica_context()


def test_merge_call_with_one_replica_passes_values_unchanged():
    s = one_device()
    seen = []

    def fn():
        return jm.get_replica_context().merge_call(
            lambda strategy, x: seen.append(type(x)) or strategy.reduce("sum", x, axis=None),
            args=(jnp.float32(2.0),))

    assert float(s.run(fn)) == 2.0
    assert not issubclass(seen[0], jm.DistributedValues)  # one replica: plain values, as TF


def test_merge_call_misuse_errors():
    s = mirrored(2)

    def not_callable():
        jm.get_replica_context().merge_call(3)

    with pytest.raises(TypeError, match="must be callable"):
        s.run(not_callable)
    with pytest.raises(ValueError, match="positional args must be a list or tuple"):
        s.run(lambda: jm.get_replica_context().merge_call(lambda st, x: x, args=1.0))
    with pytest.raises(ValueError, match="kwargs must be a dict"):
        s.run(lambda: jm.get_replica_context().merge_call(lambda st: 0, kwargs=[1]))

    def nested():
        ctx = jm.get_replica_context()
        return ctx.merge_call(lambda st: ctx.merge_call(lambda st2: 1.0))

    with pytest.raises(RuntimeError, match="outside the replica context"):
        s.run(nested)

    saved = []
    s.run(lambda: saved.append(jm.get_replica_context()) or 0.0)
    with pytest.raises(RuntimeError, match="outside the replica context"):
        saved[0].merge_call(lambda st: 1.0)

    def run_in_merge():
        return jm.get_replica_context().merge_call(lambda st: st.run(lambda: 1.0))

    with pytest.raises(RuntimeError, match="inside a function that `run` is already running"):
        s.run(run_in_merge)


# -- reduce_to / batch_reduce_to ------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4])
def test_reduce_to_eager_destinations(n):
    s = mirrored(n)
    with s.scope():
        var = jm.Variable(0.0)
    v = s.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group + 1))
    total = n * (n + 1) / 2
    for dest in (var, v, "CPU:1", "/device:CPU:0", jax.device_put(1.0, s.extended.replicated_sharding)):
        out = s.extended.reduce_to("sum", v, dest)
        assert float(out) == total
    assert s.extended.reduce_to("sum", v, var).sharding.is_fully_replicated
    assert s.extended.reduce_to("sum", v, "CPU:1").devices() == {jax.devices()[1]}
    assert float(s.extended.reduce_to(jm.VariableAggregation.MEAN, v, var)) == total / n
    assert float(s.extended.reduce_to("sum", var, var)) == 0.0  # the variable itself: N copies
    assert float(var.numpy()) == 0.0  # reduce_to does not change the destination variable
    with s.scope():
        w = jm.Variable(3.0)
    assert float(s.extended.reduce_to("sum", w, w)) == 3.0 * n
    assert float(s.extended.reduce_to("mean", 5.0, var)) == 5.0
    pairs = s.extended.batch_reduce_to("mean", [(v, var), (w, "CPU:0")])
    assert [float(x) for x in pairs] == [total / n, 3.0]


def test_reduce_to_errors():
    s = mirrored(2)
    with s.scope():
        var = jm.Variable(0.0)
    v = s.experimental_distribute_values_from_function(lambda ctx: np.float32(1))
    with pytest.raises(ValueError, match="destinations can not be empty"):
        s.extended.reduce_to("sum", v, None)
    with pytest.raises(ValueError, match="destinations"):
        s.extended.reduce_to("sum", v, 3)
    with pytest.raises(ValueError, match="non-DistributedValues"):
        s.extended.reduce_to("sum", 1.0, var)
    with pytest.raises(ValueError, match="'max' is not a valid ReduceOp"):
        s.extended.reduce_to("max", v, var)
    with pytest.raises(ValueError, match="Could not convert"):
        s.extended.reduce_to(jm.VariableAggregation.ONLY_FIRST_REPLICA, v, var)
    with pytest.raises(ValueError, match="pairs"):
        s.extended.batch_reduce_to("sum", [v])
    with pytest.raises(RuntimeError, match="merge_call"):
        s.run(lambda x: s.extended.reduce_to("sum", x, var), args=(jnp.float32(1),))
    with pytest.raises(RuntimeError, match="merge_call"):
        s.run(lambda x: s.extended.batch_reduce_to("sum", [(x, var)]), args=(jnp.float32(1),))


# -- update -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4])
def test_update_in_replica_context_goes_through_merge_call(n):
    s = mirrored(n)
    with s.scope():
        v = jm.Variable(10.0)

    @s.function
    def step(x):
        reduced = jm.get_replica_context().all_reduce("sum", x * (rid() + 1.0))
        out = s.extended.update(v, lambda var, d: var.assign_sub(d), args=(reduced,))
        return out

    out = step(jnp.float32(1.0))
    total = n * (n + 1) / 2
    assert comps(v) == [10.0 - total] * n
    assert out.sharding.is_fully_replicated and float(out) == 10.0 - total


@pytest.mark.parametrize("n", [2, 4])
def test_update_with_per_replica_args_writes_each_component(n):
    s = mirrored(n)
    with s.scope():
        v = jm.Variable(0.0)
    pr = s.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group))
    out = s.extended.update(v, lambda var, x: var.assign(x), args=(pr,))
    assert comps(v) == [float(i) for i in range(n)]
    assert isinstance(out, jm.PerReplica)
    assert float(v.numpy()) == 0.0  # a cross-replica read of a mirrored variable: component 0
    # Inside the step, too (each replica writes its own component).
    with s.scope():
        w = jm.Variable(0.0)
    s.run(lambda: s.extended.update(w, lambda var, x: var.assign(x), args=(rid() * 2.0,)))
    assert comps(w) == [2.0 * i for i in range(n)]


def test_update_per_replica_rounds_write_a_plain_variable_once():
    # One round per replica (per-replica args): a plain variable (no strategy) that ``fn``
    # writes, by closure or as an argument, has one component and takes the value the rounds
    # wrote (each round starts from it, so they agree).
    s = mirrored(2)
    with s.scope():
        w = jm.Variable(0.0)
    counter, plain = jm.Variable(0), jm.Variable(5.0)
    pr = s.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group + 1))

    def fn(var, x, p):
        counter.assign_add(1)
        p.assign_add(1.0)
        return var.assign(x)

    s.extended.update(w, fn, args=(pr, plain))
    assert comps(w) == [1.0, 2.0]
    assert int(counter.numpy()) == 1 and float(plain.numpy()) == 6.0
    assert type(counter) is jm.Variable and counter.read_value().shape == ()


def test_update_on_sync_on_read_variable_updates_each_component():
    s = mirrored(2)
    with s.scope():
        t = jm.Variable(0.0, synchronization="on_read", aggregation="sum")
    s.run(lambda: t.assign(rid() + 1.0))
    assert comps(t) == [1.0, 2.0]
    out = s.extended.update(t, lambda var: var.assign(var * 10.0))
    assert comps(t) == [10.0, 20.0] and float(t.numpy()) == 30.0
    assert [float(x) for x in s.experimental_local_results(out)] == [10.0, 20.0]
    parts = s.extended.update(t, lambda var: var.assign_add(1.0), group=False)
    assert [float(x) for x in parts] == [11.0, 21.0]


def test_update_is_atomic_and_validates():
    s = mirrored(2)
    with s.scope():
        a = jm.Variable(1.0)
        b = jm.Variable(2.0)

    def fails(var, other):
        var.assign(100.0)
        other.assign(200.0)
        raise KeyError("boom")

    with pytest.raises(KeyError):
        s.extended.update(a, fails, args=(b,))
    assert comps(a) == [1.0, 1.0] and comps(b) == [2.0, 2.0]
    with pytest.raises(ValueError, match="must be a jaxmirror Variable"):
        s.extended.update(jnp.ones(()), lambda v: v)
    with pytest.raises(TypeError, match="must be callable"):
        s.extended.update(a, None)
    with pytest.raises(ValueError, match="list or tuple"):
        s.extended.update(a, lambda v, x: v.assign(x), args=1.0)
    other = mirrored(2)
    with other.scope():
        c = jm.Variable(0.0)
    with pytest.raises(ValueError, match="created in the scope of"):
        s.extended.update(c, lambda v: v.assign(1.0))


def test_update_inside_step_is_atomic_with_the_step():
    s = mirrored(2)
    with s.scope():
        v = jm.Variable(1.0)

    def step():
        s.extended.update(v, lambda var: var.assign(5.0))
        raise ArithmeticError("after the update")

    with pytest.raises(ArithmeticError):
        s.run(step)
    assert comps(v) == [1.0, 1.0]


# -- colocate_vars_with / value_container ----------------------------------------------------------
def test_colocate_vars_with_errors():
    s = mirrored(2)
    with s.scope():
        v = jm.Variable(1.0)
    with pytest.raises(RuntimeError, match="inside this strategy's `scope"):
        with s.extended.colocate_vars_with(v):
            pass
    with s.scope():
        with pytest.raises(ValueError, match="must be a jaxmirror Variable"):
            with s.extended.colocate_vars_with(jnp.ones(())):
                pass
    other = mirrored(2)
    with other.scope():
        w = jm.Variable(1.0)
    with s.scope():
        with pytest.raises(ValueError, match="created in this strategy's scope"):
            with s.extended.colocate_vars_with(w):
                pass


def test_value_container():
    s = mirrored(2)
    with s.scope():
        v = jm.Variable(1.0)
    assert s.extended.value_container(v) is v
    out = s.run(lambda: rid())
    assert s.extended.value_container(out) is out
