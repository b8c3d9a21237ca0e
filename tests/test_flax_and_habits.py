"""flax NNX, Linen and optax in `run`, and TF/flax habits that must not give silent wrong results."""

import os
import tempfile
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from flax.training import train_state

import jaxmirror as jm
from conftest import mirrored, strategy

Divergence = jm.experimental.ReplicaDivergenceWarning


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(3, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.l2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.bn(self.l1(x))))


def _data(n=8, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 3)).astype(np.float32), rng.normal(size=(n, 2)).astype(np.float32)


def _loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def _state(obj):
    return [np.asarray(v) for v in jax.tree.leaves(nnx.state(obj))]


# -- 1. NNX objects passed to run: updates visible afterwards, as with nnx.jit -----------------
def test_nnx_module_and_optimizer_in_run_match_nnx_jit_on_one_device():
    x, y = _data()
    ref_model = MLP(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref_model, optax.adam(0.05), wrt=nnx.Param)
    model = MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
    s = jm.OneDeviceStrategy("CPU:0")

    @nnx.jit
    def ref_step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(_loss)(model, x, y)
        opt.update(model, grads)
        return loss

    @s.run
    def step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(_loss)(model, x, y)
        opt.update(model, grads)
        return loss

    for _ in range(3):
        np.testing.assert_allclose(float(step(model, opt, x, y)),
                                   float(ref_step(ref_model, ref_opt, x, y)), rtol=1e-6)
    assert int(opt.step[...]) == 3
    for a, b in zip(_state(model) + _state(opt), _state(ref_model) + _state(ref_opt)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert step.trace_count == 1


@pytest.mark.parametrize("n", [2, 4])
def test_nnx_training_with_all_reduced_gradients_matches_one_device(n):
    s = strategy(n)
    x, y = _data(16)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(3, 8, rngs=rngs)
            self.l2 = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.l2(nnx.tanh(self.l1(x)))

    ref_model = Net(nnx.Rngs(1))
    ref_opt = nnx.Optimizer(ref_model, optax.sgd(0.1), wrt=nnx.Param)
    model, opt = s.init(lambda: (m := Net(nnx.Rngs(1)),
                                 nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param)))
    batches = s.experimental_distribute_values_from_function(
        lambda ctx: (x.reshape(n, -1, 3)[ctx.replica_id_in_sync_group],
                     y.reshape(n, -1, 2)[ctx.replica_id_in_sync_group]))

    @s.run
    def step(model, opt, xy):
        xb, yb = xy
        per_example = lambda m: jm.compute_average_loss(jnp.sum((m(xb) - yb) ** 2, -1))
        loss, grads = nnx.value_and_grad(per_example)(model)
        opt.update(model, jm.get_replica_context().all_reduce("sum", grads))
        return loss

    @nnx.jit
    def ref_step(model, opt):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(jnp.sum((m(x) - y) ** 2, -1)))(model)
        opt.update(model, grads)
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("error", Divergence)
        for _ in range(3):
            total = float(s.reduce("sum", step(model, opt, batches), axis=None))
            np.testing.assert_allclose(total, float(ref_step(ref_model, ref_opt)), rtol=1e-5)
    for a, b in zip(_state(model), _state(ref_model)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(opt.step[...]) == 3
    assert jm.experimental.check_replicas((model, opt)) == []
    # Built replicated by strategy.init: no second compile once outputs come back in.
    assert step.compile_count == 1 and step.trace_count == 1


def test_nnx_updates_are_not_applied_when_the_step_fails_at_trace_time():
    s = strategy(2)
    model = MLP(nnx.Rngs(0))
    before = _state(model)

    @s.run
    def step(model, x):
        model.bn(model.l1(x))  # updates the BatchNorm statistics...
        raise RuntimeError("boom")  # ...then fails

    with pytest.raises(RuntimeError, match="boom"):
        step(model, jnp.ones((4, 3)))
    for a, b in zip(_state(model), before):
        np.testing.assert_array_equal(a, b)


def test_nnx_state_in_and_out_of_run_functionally():
    s = strategy(2)
    model = MLP(nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    @s.run
    def forward(state, x):
        m = nnx.merge(graphdef, state)
        out = m(x)
        return out, nnx.state(m)

    out, new_state = forward(state, jnp.ones((4, 3)))
    assert isinstance(new_state, nnx.State)
    ref = MLP(nnx.Rngs(0))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref(jnp.ones((4, 3)))), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(new_state["bn"]["mean"][...]),
                               np.asarray(ref.bn.mean[...]), rtol=1e-6)


def test_nnx_objects_built_on_one_device_run_and_are_mirrored_after():
    s = strategy(2)
    model = MLP(nnx.Rngs(0))
    model = jax.device_put(model, jax.devices()[0])  # committed to CPU:0 only
    step = s.run(lambda m, x: m(x).sum())
    step(model, jnp.ones((2, 3)))
    assert len(model.l1.kernel[...].devices()) == 2


# -- Linen and optax --------------------------------------------------------------------------
class LinenNet(linen.Module):
    axis_name: str | None = "replica"

    @linen.compact
    def __call__(self, x, train=True):
        x = linen.Dense(4)(x)
        x = linen.BatchNorm(use_running_average=not train,
                            axis_name=self.axis_name if train else None)(x)
        return linen.Dense(2)(x)


@pytest.mark.parametrize("n", [1, 2])
def test_linen_train_state_and_batch_stats_collection(n):
    s = strategy(n)
    x, y = _data(8)
    net = LinenNet()
    variables = net.init(jax.random.key(0), x, train=False)

    class State(train_state.TrainState):
        batch_stats: dict

    def make():
        return State.create(apply_fn=net.apply, params=variables["params"], tx=optax.sgd(0.1),
                            batch_stats=variables["batch_stats"])

    def loss_fn(params, stats, xb, yb):
        out, updates = net.apply({"params": params, "batch_stats": stats}, xb,
                                 mutable=["batch_stats"])
        return jnp.mean((out - yb) ** 2), updates["batch_stats"]

    @s.run
    def step(state, xy):
        xb, yb = xy
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, state.batch_stats, xb, yb)
        grads = jm.get_replica_context().all_reduce("mean", grads)
        return state.apply_gradients(grads=grads, batch_stats=stats), loss

    batches = s.experimental_distribute_values_from_function(
        lambda ctx: (x.reshape(n, -1, 3)[ctx.replica_id_in_sync_group],
                     y.reshape(n, -1, 2)[ctx.replica_id_in_sync_group]))
    state = s.experimental_replicate(make())
    with warnings.catch_warnings():
        warnings.simplefilter("error", Divergence)
        for _ in range(2):
            state, _ = step(state, batches)

    # One device, the whole batch: sync BatchNorm over equal shards is the full-batch one.
    ref, one = make(), LinenNet(axis_name=None)

    @jax.jit
    def ref_step(state):
        def f(params):
            out, updates = one.apply({"params": params, "batch_stats": state.batch_stats}, x,
                                     mutable=["batch_stats"])
            return jnp.mean((out - y) ** 2), updates["batch_stats"]
        (_, stats), grads = jax.value_and_grad(f, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=stats)

    for _ in range(2):
        ref = ref_step(ref)
    for a, b in zip(jax.tree.leaves((state.params, state.batch_stats)),
                    jax.tree.leaves((ref.params, ref.batch_stats))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert int(state.step) == 2


# -- 2. replication safety ----------------------------------------------------------------
def _literal_tf_port(s):
    params = s.experimental_replicate({"w": jnp.ones((3, 2)), "b": jnp.zeros(2)})
    tx = optax.sgd(0.1)
    opt_state = s.experimental_replicate(tx.init(params))
    data = s.experimental_distribute_values_from_function(
        lambda ctx: jnp.ones((4, 3)) * (ctx.replica_id_in_sync_group + 1.0))

    def train_step(params, opt_state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)  # no all-reduce, as in TF
        return optax.apply_updates(params, updates), opt_state, loss

    return params, opt_state, data, train_step


def test_a_literal_tf_port_without_all_reduce_warns_and_check_replicas_finds_it():
    s = strategy(2)
    params, opt_state, data, train_step = _literal_tf_port(s)
    with pytest.warns(Divergence, match=r"params\['b'\], params\['w'\].*all_reduce"):
        new_params, _, _ = s.run(train_step, args=(params, opt_state, data))
    assert jm.experimental.check_replicas(new_params) == ["['b']", "['w']"]


def test_the_same_step_with_all_reduced_gradients_does_not_warn():
    s = strategy(2)
    params, opt_state, data, _ = _literal_tf_port(s)
    tx = optax.sgd(0.1)

    def train_step(params, opt_state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(params)
        grads = jm.get_replica_context().all_reduce("mean", grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    with warnings.catch_warnings():
        warnings.simplefilter("error", Divergence)
        new_params, _, loss = s.run(train_step, args=(params, opt_state, data))
    assert isinstance(new_params["w"], jax.Array) and isinstance(loss, jm.PerReplica)
    assert jm.experimental.check_replicas(new_params) == []


def test_an_nnx_optimizer_step_without_all_reduce_warns():
    s = strategy(2)
    model = MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    data = s.experimental_distribute_values_from_function(
        lambda ctx: _data(4, seed=ctx.replica_id_in_sync_group)[0])

    def train_step(model, opt, x):
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        opt.update(model, grads)

    with pytest.warns(Divergence, match="train_step.*nnx_objects"):
        s.run(train_step, args=(model, opt, data))
    assert any("kernel" in p for p in jm.experimental.check_replicas(model))


def test_a_mirrored_variable_written_differently_by_replicas_warns():
    s = strategy(2)
    with s.scope():
        v = jm.Variable(jnp.zeros(2))
        agreed = jm.Variable(jnp.zeros(2), aggregation="mean")

    def step():
        rid = jm.get_replica_context().replica_id_in_sync_group
        v.assign(jnp.ones(2) * rid)

    with pytest.warns(Divergence, match="MirroredVariable.*Variable"):
        s.run(step)
    assert jm.experimental.check_replicas(v) == [""]

    def agreeing():
        agreed.assign(jnp.ones(2) * jm.get_replica_context().replica_id_in_sync_group)

    with warnings.catch_warnings():
        warnings.simplefilter("error", Divergence)
        s.run(agreeing)
    assert jm.experimental.check_replicas(agreed) == []
    np.testing.assert_allclose(agreed.numpy(), [0.5, 0.5])


def test_a_scalar_result_differing_by_replica_is_not_a_divergence():
    s = strategy(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Divergence)
        out = s.run(lambda x: x * jm.get_replica_context().replica_id_in_sync_group,
                    args=(jnp.float32(2),))
    assert [float(c) for c in s.experimental_local_results(out)] == [0.0, 2.0]


# -- 4. reduce/gather on a PerReplica's storage ----------------------------------------------
@pytest.mark.parametrize("n", [1, 2])
def test_reduce_over_tree_map_of_per_replica_raises_instead_of_returning_it(n):
    s = strategy(n)
    tree = s.run(lambda: {"a": jm.get_replica_context().replica_id_in_sync_group * 1.0,
                          "b": jnp.ones(2) * jm.get_replica_context().replica_id_in_sync_group})
    if n == 1:
        tree = {"a": jm.PerReplica(jnp.zeros((1,))), "b": jm.PerReplica(jnp.zeros((1, 2)))}
        tree = jax.device_put(tree, s.extended.replica_sharding)
    with pytest.raises(TypeError, match="storage of a PerReplica.*is_leaf"):
        jax.tree.map(lambda v: s.reduce("mean", v, axis=None), tree)
    with pytest.raises(TypeError, match="gather: .*storage of a PerReplica"):
        jax.tree.map(lambda v: s.gather(v, axis=0), tree)
    # The two ways that work give the reduced values.
    whole = s.reduce("sum", tree, axis=None)
    mapped = jax.tree.map(lambda v: s.reduce("sum", v, axis=None), tree,
                          is_leaf=lambda x: isinstance(x, jm.PerReplica))
    assert float(whole["a"]) == float(mapped["a"]) == sum(range(n))


# -- 5. placement -------------------------------------------------------------------------------
def test_params_committed_to_one_device_are_mirrored_with_a_warning():
    s = strategy(2)
    params = {"w": jax.device_put(jnp.ones(3), jax.devices()[0])}
    step = s.run(lambda p: jax.tree.map(lambda a: a * 2, p))
    with pytest.warns(UserWarning, match=r"args\[0\]\['w'\].*experimental_replicate"):
        out = step(params)
    np.testing.assert_allclose(np.asarray(out["w"]), [2, 2, 2])
    assert out["w"].sharding.is_fully_replicated and len(out["w"].devices()) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(out)  # the step's own output goes back in without a copy or a warning


def test_experimental_replicate_and_init_give_one_compile():
    s = strategy(4)
    params = s.experimental_replicate({"w": jnp.ones((3, 2)), "b": np.zeros(2, np.float32)})
    tx = optax.adam(0.1)
    opt_state = s.init(tx.init, params)
    assert all(len(a.devices()) == 4 for a in jax.tree.leaves((params, opt_state)))

    @s.function
    def step(params, opt_state):
        grads = jax.tree.map(jnp.ones_like, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for _ in range(3):
        params, opt_state = step(params, opt_state)
    assert step.compile_count == 1
    assert int(opt_state[0].count) == 3


def test_checkpoint_restores_mirrored_under_a_strategy_scope():
    s = strategy(2)
    path = os.path.join(tempfile.mkdtemp(), "ckpt")
    jm.checkpoint.save(path, {"w": jnp.arange(3.0)})
    fresh = {"w": jax.device_put(jnp.zeros(3), jax.devices()[0])}
    with s.scope():
        restored = jm.checkpoint.restore(path, fresh)
    assert restored["w"].sharding.device_set == set(jax.devices()[:2])
    outside = jm.checkpoint.restore(path, fresh)
    assert outside["w"].devices() == {jax.devices()[0]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = s.run(lambda p: p["w"] + 1, args=(restored,))
    np.testing.assert_allclose(np.asarray(out), [1, 2, 3])


# -- 6. variables in jnp, jax.jit and jax.grad ------------------------------------------------
def test_variables_work_in_jnp_jit_and_grad():
    s = strategy(2)
    with s.scope():
        v = jm.Variable(jnp.array([1.0, 2.0]))
    assert float(jnp.sum(v)) == 3.0
    np.testing.assert_allclose(np.asarray(jax.jit(lambda a: a * 2)(v)), [2, 4])
    np.testing.assert_allclose(np.asarray(jax.grad(lambda a: jnp.sum(a ** 2))(v)), [2, 4])
    np.testing.assert_allclose(np.asarray(jnp.dot(v, v)), 5.0)
    plain = jm.Variable(3.0)
    assert float(jax.jit(jnp.sin)(plain)) == pytest.approx(np.sin(3.0))

    @s.run
    def step(var, x):  # still a variable inside a step, assignments kept
        var.assign_add(jnp.ones(2) * x)
        return jnp.sum(var)

    assert float(step(v, 1.0)) == 5.0
    np.testing.assert_allclose(v.numpy(), [2.0, 3.0])


# -- 7. closure variables: the user's Python runs once ----------------------------------------
def test_a_step_capturing_variables_runs_its_python_once():
    s = strategy(2)
    with s.scope():
        w = jm.Variable(jnp.ones(2))
        jm.Variable(0.0, name="unused")
    calls = []

    @s.run
    def step(x):
        calls.append(1)
        w.assign_add(x * jnp.ones(2))
        return jnp.sum(w)

    assert [float(step(1.0)), float(step(1.0))] == [4.0, 6.0]
    assert len(calls) == 1 and step.trace_count == 1


# -- 8. TF names -------------------------------------------------------------------------------
def test_tf_names_once_planned_are_built_now():
    # They were placeholders raising NotImplementedError (planned.py) until they landed.
    assert jm.experimental.ParameterServerStrategy.__module__ == (
        "jaxmirror.strategies.parameter_server")
    assert jm.cluster_resolver.RayClusterResolver.__module__ == (
        "jaxmirror.cluster_resolver.ray_cluster")
    with pytest.raises(ValueError, match="`cluster_resolver` must be a ClusterResolver"):
        jm.experimental.ParameterServerStrategy(None)


def test_unknown_names_still_raise_attribute_error():
    with pytest.raises(AttributeError, match="NoSuchStrategy"):
        jm.NoSuchStrategy  # noqa: B018
    assert not hasattr(jm.experimental, "NoSuchThing")


def test_should_checkpoint_ref_and_device():
    s = mirrored(2)
    assert s.extended.should_checkpoint and s.extended.should_save_summary
    assert s.extended.should_init
    with s.scope():
        v = jm.Variable(1.0)
    w = jm.Variable(2.0)
    assert v.device == "/job:localhost/replica:0/task:0/device:CPU:0"
    assert {v.ref(): "v", w.ref(): "w"}[v.ref()] == "v"
    assert v.ref().deref() is v and v.ref() != w.ref() and v.experimental_ref() == v.ref()


# -- what a new user met: NNX details ------------------------------------------------------
def test_each_replica_draws_its_own_dropout_mask_and_the_keys_stay_mirrored():
    s = strategy(4)
    model = s.init(lambda: nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=0)))
    step = s.run(lambda m, x: m(x))
    masks = [np.asarray(c) for c in s.experimental_local_results(step(model, jnp.ones(64)))]
    assert len({m.tobytes() for m in masks}) == 4  # four different masks
    assert jm.experimental.check_replicas(model) == []  # the stored key and count agree
    assert int(model.rngs.count[...]) == 1


def test_a_failing_callback_leaves_nnx_objects_unchanged_and_readable():
    s = strategy(2)
    model = s.init(lambda: nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    before = np.asarray(model.kernel[...])

    def fail(_):
        raise RuntimeError("callback failed")

    @s.run
    def step(m, x):
        jax.debug.callback(fail, m(x))
        m.kernel[...] = m.kernel[...] * 2
        return m(x).sum()

    with pytest.raises(Exception, match="callback failed"):
        step(model, jnp.ones((3, 2)))
    np.testing.assert_array_equal(np.asarray(model.kernel[...]), before)
    assert float(s.run(lambda m: m.kernel[...].sum(), args=(model,))) == pytest.approx(
        before.sum())


def test_changing_static_attributes_inside_a_step_is_refused():
    s = strategy(2)
    drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=0))

    def step(m, x):
        m.eval()
        return m(x)

    with pytest.raises(ValueError, match=r"model.eval\(\).*outside the step"):
        s.run(step, args=(drop, jnp.ones(4)))
    assert drop.deterministic is False


def test_nnx_objects_by_closure_get_a_clear_error():
    s = strategy(2)
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))

    @s.function
    def step():
        return nnx.grad(lambda m: jnp.mean(m(jnp.ones((2, 2))) ** 2))(model).kernel[...].sum()

    with pytest.raises(ValueError, match="reaches by closure; pass them as arguments"):
        step()


def test_donating_an_nnx_argument_donates_its_state():
    s = strategy(2)
    model = s.init(lambda: nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
    donating = s.function(lambda m, x: m(x).sum(), donate_argnums=(0,))
    keeping = s.function(lambda m, x: m(x).sum())
    donating(model, jnp.ones((2, 2)))
    keeping(model, jnp.ones((2, 2)))
    [inner] = donating.program.nested_programs()
    [kept] = keeping.program.nested_programs()
    assert inner.donate_argnums == (0,) and kept.donate_argnums == ()


def test_a_per_replica_of_another_strategy_is_named():
    s2, s4 = strategy(2), strategy(4)
    other = s4.experimental_distribute_values_from_function(lambda ctx: 1.0)
    with pytest.raises(ValueError, match=r"args\[0\] is a PerReplica with 4 components"):
        s2.run(lambda x: x + 1, args=(other,))


def test_nnx_state_with_rng_keys_checkpoints_and_restores_mirrored():
    s = strategy(2)
    model = s.init(lambda: nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3)))
    path = os.path.join(tempfile.mkdtemp(), "ckpt")
    jm.checkpoint.save(path, nnx.state(model))
    fresh = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=7))
    with s.scope():
        nnx.update(fresh, jm.checkpoint.restore(path, nnx.state(fresh)))
    key, saved = fresh.rngs.key[...], model.rngs.key[...]
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(saved))
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    assert key.sharding.device_set == set(jax.devices()[:2])


@pytest.mark.filterwarnings("ignore:Using .Module.sow:DeprecationWarning")
def test_sown_intermediates_come_out_of_the_step():
    s = strategy(2)

    class Net(nnx.Module):
        def __init__(self):
            self.l = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

        def __call__(self, x):
            y = self.l(x)
            self.sow(nnx.Intermediate, "act", y)
            return y

    net = Net()
    s.run(lambda m, x: m(x).sum(), args=(net, jnp.ones((3, 2))))
    (act,) = net.act.get_value()
    np.testing.assert_allclose(np.asarray(act), np.asarray(net.l(jnp.ones((3, 2)))), rtol=1e-6)


def test_numpy_conversion_of_a_per_replica_says_what_to_use():
    s = strategy(2)
    v = s.experimental_distribute_values_from_function(lambda ctx: 1.0)
    with pytest.raises(TypeError, match="experimental_local_results.*v.stacked"):
        np.asarray(v)
    assert np.asarray(v.stacked).tolist() == [1.0, 1.0]


def test_a_step_raising_its_own_value_error_is_not_retried_with_mirrored_arguments():
    s = strategy(2)
    calls = []

    def step(p):
        calls.append(1)
        raise ValueError("the step's own error")

    params = {"w": jax.device_put(jnp.ones(3), jax.devices()[0])}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="the step's own error"):
            s.run(step, args=(params,))
    assert len(calls) == 1
