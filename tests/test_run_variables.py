"""How ``run`` binds variables: by argument, by closure, both, and how often it traces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmirror as jm
from conftest import mirrored


def rid():
    return jm.get_replica_context().replica_id_in_sync_group


def comps(v):
    return [float(c) for c in v.values]


def test_closure_variables_are_found_once_then_passed_directly():
    s = mirrored(2)
    with s.scope():
        a = jm.Variable(1.0)
        b = jm.Variable(10.0)

    @s.function
    def step(x):
        a.assign_add(x)
        return a.value() + b.value()

    assert float(step(jnp.float32(1))) == 12.0
    first = (step.trace_count, step.compile_count)
    # The user's Python runs once: the strategy's variables are bound as candidates in the first
    # trace, which is kept for the call that passes the two it used as inputs.
    assert first == (1, 1)
    for i in range(5):
        assert float(step(jnp.float32(1))) == 13.0 + i
    assert (step.trace_count, step.compile_count) == first
    assert comps(a) == [7.0, 7.0] and comps(b) == [10.0, 10.0]


def test_a_variable_met_later_is_added_without_losing_the_others():
    s = mirrored(2)
    with s.scope():
        a = jm.Variable(0.0)
        b = jm.Variable(0.0)
    use_b = [False]

    @s.function
    def step(flag):
        a.assign_add(1.0)
        if use_b[0]:  # Python control flow reaching a new variable on a new signature
            b.assign_add(flag)
        return a.value()

    step(jnp.float32(1))
    use_b[0] = True
    step(jnp.ones((1,), jnp.float32)[0].reshape(()).astype(jnp.int32))  # a new signature
    assert comps(a) == [2.0, 2.0] and comps(b) == [1.0, 1.0]
    step(jnp.float32(2))  # the first signature again: its program still writes `a`
    assert comps(a) == [3.0, 3.0]


def test_variable_passed_and_captured_is_one_variable():
    s = mirrored(2)
    with s.scope():
        v = jm.Variable(1.0, aggregation="sum")

    def fn(var):
        assert var is v  # the same object inside the step, not a copy
        var.assign_add(jnp.float32(1.0))
        v.assign_add(jnp.float32(1.0))
        return var.value()

    out = s.run(fn, args=(v,))
    assert float(out) == 5.0 and comps(v) == [5.0, 5.0]


def test_closure_step_switches_to_variable_arguments():
    s = mirrored(2)
    with s.scope():
        counter = jm.Variable(0.0)
        other = jm.Variable(5.0)

    @s.function
    def step(target):
        counter.assign_add(1.0)
        if isinstance(target, jm.Variable):
            target.assign_add(1.0)
            return target.value()
        return target

    assert float(step(jnp.float32(3))) == 3.0
    assert float(step(other)) == 6.0
    assert float(step(jnp.float32(4))) == 4.0
    assert comps(counter) == [3.0, 3.0] and comps(other) == [6.0, 6.0]


def test_variables_inside_nests_of_arguments():
    s = mirrored(4)
    with s.scope():
        params = {"w": jm.Variable(jnp.ones(3)), "b": jm.Variable(0.0), "lr": 0.5}

    @s.function
    def step(p, g):
        p["w"].assign_sub(p["lr"] * g)
        p["b"].assign_add(1.0)
        return jm.read_values(p)

    out = step(params, jnp.full(3, 2.0))
    assert np.asarray(out["w"]).tolist() == [0.0, 0.0, 0.0] and float(out["b"]) == 1.0
    assert [np.asarray(c).tolist() for c in params["w"].values] == [[0.0] * 3] * 4


def test_assignments_are_new_outputs_and_variables_keep_their_placement():
    s = mirrored(4)
    with s.scope():
        v = jm.Variable(jnp.zeros(2))
        t = jm.Variable(jnp.zeros(2), synchronization="on_read", aggregation="mean")

    @s.function
    def step():
        v.assign(v + 1.0)
        t.assign(t + jnp.float32(1.0))  # every replica the same: still one component each

    step()
    step()
    stored_v, stored_t = v.variable_state.value, t.variable_state.value
    assert isinstance(stored_v, jax.Array) and stored_v.sharding.is_fully_replicated
    assert isinstance(stored_t, jm.PerReplica)
    assert stored_t.stacked.sharding.spec == jax.sharding.PartitionSpec("replica")
    assert np.asarray(t.numpy()).tolist() == [2.0, 2.0]
    assert step.trace_count == 1  # the user's Python runs once (candidates bound in that trace)


def test_mirrored_variable_with_diverged_components_reads_component_0_in_the_step():
    s = mirrored(2)
    with s.scope():
        v = jm.Variable(0.0)  # aggregation NONE
    s.run(lambda: v.assign(rid() * 1.0 + 1.0))
    assert comps(v) == [1.0, 2.0]
    assert isinstance(v.variable_state.value, jm.PerReplica)
    # In the next step each replica reads its own component; merge_fn reads component 0.
    out = s.run(lambda: (v.value(), jm.get_replica_context().merge_call(lambda st: v.value())))
    assert [float(x) for x in s.experimental_local_results(out[0])] == [1.0, 2.0]
    assert float(out[1]) == 1.0
    v.assign(3.0)  # a cross-replica assignment brings the components together again
    assert comps(v) == [3.0, 3.0] and isinstance(v.variable_state.value, jax.Array)


def test_step_with_variables_refuses_outer_transformations():
    s = mirrored(2)
    with s.scope():
        v = jm.Variable(1.0)

    @s.function
    def step(x):
        v.assign_add(x)

    step(jnp.float32(1))
    with pytest.raises(RuntimeError, match="cannot be called inside jax.jit"):
        jax.jit(step)(jnp.float32(1))
    assert comps(v) == [2.0, 2.0]


def test_traced_value_assigned_outside_run_is_refused():
    v = jm.Variable(1.0)
    with pytest.raises(ValueError, match="traced value outside `run`"):
        jax.jit(lambda x: v.assign(x, read_value=False) or x)(jnp.float32(2))
    assert float(v.numpy()) == 1.0


def test_one_device_and_default_strategy_variables_in_steps():
    one = jm.OneDeviceStrategy("CPU:0")
    with one.scope():
        v = jm.Variable(1.0, aggregation="sum")
    one.run(lambda: v.assign_add(2.0))  # one replica: a constant is fine
    assert float(v.numpy()) == 3.0 and type(v) is jm.Variable
    w = jm.Variable(1.0)  # no strategy: the default strategy calls the function directly
    jm.get_strategy().run(lambda: w.assign_add(1.0))
    assert float(w.numpy()) == 2.0


# -- found in review ----------------------------------------------------------------------------
def test_variable_read_inside_a_nested_jit_helper_is_current():
    s = mirrored(2)
    with s.scope():
        v = jm.Variable(1.0)

    @jax.jit
    def helper(x):
        return x * v.read_value()  # the first meeting of `v` is inside this jit's trace

    step = s.function(lambda x: helper(x))
    assert float(step(jnp.float32(2.0))) == 2.0
    v.assign(5.0)
    assert float(step(jnp.float32(2.0))) == 10.0


def test_assignments_inside_nested_transformations_are_refused():
    s = mirrored(2)
    with s.scope():
        v = jm.Variable(0.0)

    def in_cond(x):
        jax.lax.cond(x > 0, lambda: v.assign(x, read_value=False), lambda: None)

    def in_jit(x):
        jax.jit(lambda y: v.assign_add(y, read_value=False) or y)(x)

    for fn in (in_cond, in_jit):
        with pytest.raises(ValueError, match="inside a nested JAX transformation"):
            s.run(fn, args=(jnp.float32(1.0),))
    assert comps(v) == [0.0, 0.0]


def test_variable_arguments_cannot_be_donated():
    s = mirrored(2)
    with s.scope():
        v = jm.Variable(jnp.ones(4))
    options = jm.RunOptions(donate_argnums=(0,))
    with pytest.raises(ValueError, match="donate_argnums.*holds jaxmirror Variables"):
        s.run(lambda v, x: v.read_value() * 2 + x, args=(v, jnp.zeros(4)), options=options)
    assert [np.asarray(c).tolist() for c in v.values] == [[1.0] * 4] * 2


def test_a_variable_owns_its_buffer():
    s = mirrored(2)
    x = jax.device_put(jnp.ones(4), s.extended.replicated_sharding)
    with s.scope():
        v = jm.Variable(x)
        w = jm.Variable(0.0)
    y = jax.device_put(jnp.full(4, 3.0), s.extended.replicated_sharding)
    w2 = jm.Variable(jnp.zeros(4))
    w2.assign(y)
    donate = jm.RunOptions(donate_argnums=(0,))
    s.run(lambda p: p + 1, args=(x,), options=donate)
    s.run(lambda p: p + 1, args=(y,), options=donate)
    assert x.is_deleted() and y.is_deleted()
    assert np.asarray(v.numpy()).tolist() == [1.0] * 4
    assert np.asarray(w2.numpy()).tolist() == [3.0] * 4
    assert float(w.numpy()) == 0.0


def test_update_under_jit_or_grad_is_refused():
    s = mirrored(2)
    with s.scope():
        v = jm.Variable(0.0)
    with pytest.raises(ValueError, match="traced value"):
        jax.jit(lambda x: s.extended.update(v, lambda v, x: v.assign(x), args=(x,)).value)(
            jnp.float32(1.0))
    w = jm.Variable(1.0)
    with pytest.raises(ValueError, match="traced value"):
        jax.grad(lambda x: jm.get_strategy().extended.update(w, lambda w, x: w.assign(x * 2),
                                                               args=(x,)))(2.0)
    assert comps(v) == [0.0, 0.0] and float(w.numpy()) == 1.0


def test_eager_update_writes_variables_reached_by_closure_only_if_fn_succeeds():
    s = mirrored(2)
    with s.scope():
        a = jm.Variable(1.0)
        other = jm.Variable(2.0)

    def fn(var):
        other.assign(20.0)
        var.assign(10.0)
        raise OverflowError("late")

    with pytest.raises(OverflowError):
        s.extended.update(a, fn)
    assert comps(a) == [1.0, 1.0] and comps(other) == [2.0, 2.0]
    s.extended.update(a, lambda var: (other.assign(20.0), var.assign(10.0)))
    assert comps(a) == [10.0, 10.0] and comps(other) == [20.0, 20.0]


def test_tree_map_over_per_replica_values_in_merge_fn():
    s = mirrored(2)

    def merge_fn(strategy, grads):
        doubled = jax.tree.map(lambda g: g * 2, grads)
        return strategy.reduce("sum", doubled, axis=None)

    out = s.run(lambda: jm.get_replica_context().merge_call(
        merge_fn, args=({"w": rid() + 1.0},)))
    assert float(out["w"]) == 6.0


def test_step_given_variables_once_still_composes_with_jit_for_arrays():
    s = mirrored(2)
    with s.scope():
        v = jm.Variable(1.0)
    step = s.function(lambda x: x * 2.0)
    assert float(step(v)) == 2.0
    assert float(jax.jit(step)(jnp.float32(3.0))) == 6.0


def test_reduce_to_a_variable_of_another_strategy_is_refused():
    s, other = mirrored(2), mirrored(2)
    with other.scope():
        v = jm.Variable(0.0)
    value = s.experimental_distribute_values_from_function(lambda ctx: np.float32(1))
    with pytest.raises(ValueError, match="another strategy object"):
        s.extended.reduce_to("sum", value, v)
