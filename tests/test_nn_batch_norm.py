"""jaxmirror.nn.SyncBatchNorm (NNX) and jaxmirror.nn.linen.SyncBatchNorm: statistics of real rows.

Batches from a distributed dataset are padded per replica (10 rows with a global batch of 4:
batches of 4, 4 and 2 rows, split 2/1/1 and 1/1/0 over 3 replicas). Every test compares with
flax's own BatchNorm run on one device on exactly the real rows of each global batch.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

import jaxmirror
from conftest import local, strategy
from jaxmirror.nn import SyncBatchNorm
from jaxmirror.nn import linen as sync_linen

DATA = (np.random.default_rng(0).normal(size=(10, 3)) * [1.0, 3.0, 0.5] + [0.0, 2.0, -1.0]
        ).astype(np.float32)
GLOBAL_BATCHES = [DATA[i:i + 4] for i in range(0, 10, 4)]  # 4, 4, 2 rows
TOL = dict(rtol=1e-5, atol=1e-5)


def batches(s):
    return s.experimental_distribute_dataset(GLOBAL_BATCHES)


def real_rows(s, y):
    """The real rows of a step's per-replica output, in global-batch order."""
    return np.concatenate(local(s, y), axis=0)


def stats(state):
    return np.asarray(state["mean"][...]), np.asarray(state["var"][...])


def nnx_step(s, graphdef, **call):
    @s.run
    def step(state, x):
        model = nnx.merge(graphdef, state)
        y = model(x, **{k: f(x) if callable(f) else f for k, f in call.items()})
        return y, nnx.split(model)[1]

    return step


def reference(layer_cls=nnx.BatchNorm, **call):
    """flax's BatchNorm on one device over each global batch: [(y, mean, var)] per batch."""
    model, out = layer_cls(3, momentum=0.9, rngs=nnx.Rngs(0)), []
    for x in GLOBAL_BATCHES:
        y = model(jnp.asarray(x), **{k: f(x) if callable(f) else f for k, f in call.items()})
        out.append((np.asarray(y), np.asarray(model.mean[...]), np.asarray(model.var[...])))
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_statistics_and_outputs_equal_one_device_flax_on_the_real_rows(n):
    s = strategy(n)
    graphdef, state = nnx.split(SyncBatchNorm(3, momentum=0.9, rngs=nnx.Rngs(0)))
    step = nnx_step(s, graphdef)
    for batch, (y_ref, mean_ref, var_ref) in zip(batches(s), reference(), strict=True):
        y, state = step(state, batch)
        assert isinstance(state["mean"][...], jax.Array)  # Mirrored: one value for all replicas
        mean, var = stats(state)
        np.testing.assert_allclose(mean, mean_ref, **TOL)
        np.testing.assert_allclose(var, var_ref, **TOL)
        np.testing.assert_allclose(real_rows(s, y), y_ref, **TOL)
        if n > 1:
            np.testing.assert_allclose(np.asarray(s.gather(y, axis=0)), y_ref, **TOL)


def test_flax_batch_norm_over_the_replica_axis_differs_and_sync_batch_norm_does_not():
    s = strategy(3)
    first = next(iter(batches(s)))  # 4 rows: 2/1/1, padded to 2 rows each
    _, mean_ref, var_ref = reference()[0]

    def new_stats(layer, **call):
        graphdef, state = nnx.split(layer)
        return stats(nnx_step(s, graphdef, **call)(state, first)[1])

    def flax_bn():
        return nnx.BatchNorm(3, momentum=0.9, axis_name="replica", rngs=nnx.Rngs(0))

    def real(x):
        return jaxmirror.get_replica_context().batch_mask[:, None]

    # Padding counted; with the mask, a replica's 1 row weighs as much as another's 2.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # run may flag the first (the point of this test)
        flax_stats = [new_stats(flax_bn()), new_stats(flax_bn(), mask=real)]
    for mean, var in flax_stats:
        assert not np.allclose(mean, mean_ref, rtol=1e-3)
        assert not np.allclose(var, var_ref, rtol=1e-3)
    for layer in [SyncBatchNorm(3, momentum=0.9, rngs=nnx.Rngs(0)),
                  SyncBatchNorm(3, momentum=0.9, axis_name="replica", rngs=nnx.Rngs(0))]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mean, var = new_stats(layer)
        assert not [w for w in caught if "padded" in str(w.message)]  # nothing for run to flag
        np.testing.assert_allclose(mean, mean_ref, **TOL)
        np.testing.assert_allclose(var, var_ref, **TOL)


@pytest.mark.parametrize("n", [2, 3])
def test_user_mask_combines_with_the_padding(n):
    s = strategy(n)
    mask = lambda x: x > 0.0  # noqa: E731 (per entry: each feature counts its own rows)
    graphdef, state = nnx.split(SyncBatchNorm(3, momentum=0.9, rngs=nnx.Rngs(0)))
    step = nnx_step(s, graphdef, mask=mask)
    for batch, (y_ref, mean_ref, var_ref) in zip(batches(s), reference(mask=mask), strict=True):
        y, state = step(state, batch)
        mean, var = stats(state)
        np.testing.assert_allclose(mean, mean_ref, **TOL)
        np.testing.assert_allclose(var, var_ref, **TOL)
        np.testing.assert_allclose(real_rows(s, y), y_ref, **TOL)


def test_non_fast_variance_matches_too():
    s = strategy(3)
    graphdef, state = nnx.split(SyncBatchNorm(3, momentum=0.9, use_fast_variance=False,
                                              rngs=nnx.Rngs(0)))
    step = nnx_step(s, graphdef)
    for batch, (y_ref, mean_ref, var_ref) in zip(batches(s), reference(), strict=True):
        y, state = step(state, batch)
        np.testing.assert_allclose(stats(state), (mean_ref, var_ref), **TOL)
        np.testing.assert_allclose(real_rows(s, y), y_ref, **TOL)


def test_use_running_average_uses_the_stored_averages_and_keeps_them():
    s = strategy(3)
    model = SyncBatchNorm(3, momentum=0.9, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    train = nnx_step(s, graphdef)
    for batch in batches(s):
        _, state = train(state, batch)
    flax_model = nnx.BatchNorm(3, use_running_average=True, rngs=nnx.Rngs(1))
    nnx.update(flax_model, state)
    for evaluate in [nnx_step(s, graphdef, use_running_average=True),
                     nnx_step(s, nnx.split(nnx.view(model, use_running_average=True))[0])]:
        for batch, x in zip(batches(s), GLOBAL_BATCHES, strict=True):
            y, new_state = evaluate(state, batch)
            np.testing.assert_allclose(real_rows(s, y), np.asarray(flax_model(jnp.asarray(x))),
                                       **TOL)
            np.testing.assert_array_equal(stats(new_state), stats(state))


def test_training_through_sync_batch_norm_equals_one_device_training():
    # The gradient flows back through the all-reduced statistics into the layer before them.
    s = strategy(3)

    def model(bn):
        return nnx.Sequential(nnx.Linear(3, 3, rngs=nnx.Rngs(1)), bn(3, rngs=nnx.Rngs(0)))

    graphdef, state = nnx.split(model(SyncBatchNorm))

    def loss_per_example(model, x):
        return jnp.sum((model(x) - x[:, ::-1]) ** 2, axis=-1)

    @s.run
    def grads(state, x):
        g = nnx.grad(lambda m: jaxmirror.compute_average_loss(loss_per_example(m, x)))(
            nnx.merge(graphdef, state))
        return jaxmirror.get_replica_context().all_reduce("sum", g)

    reference_model = model(nnx.BatchNorm)
    for batch, x in zip(batches(s), GLOBAL_BATCHES, strict=True):
        got = grads(state, batch)
        want = nnx.grad(lambda m: jnp.mean(loss_per_example(m, jnp.asarray(x))))(
            reference_model)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
                     got, want)


def test_rows_with_more_axes_reduce_over_all_but_the_features():
    s = strategy(3)
    images = np.random.default_rng(1).normal(size=(10, 2, 2, 3)).astype(np.float32)
    graphdef, state = nnx.split(SyncBatchNorm(3, momentum=0.9, rngs=nnx.Rngs(0)))
    step, flax_model = nnx_step(s, graphdef), nnx.BatchNorm(3, momentum=0.9, rngs=nnx.Rngs(0))
    global_batches = [images[i:i + 4] for i in range(0, 10, 4)]
    for batch, x in zip(s.experimental_distribute_dataset(global_batches), global_batches,
                        strict=True):
        y, state = step(state, batch)
        np.testing.assert_allclose(real_rows(s, y), flax_model(jnp.asarray(x)), **TOL)
        np.testing.assert_allclose(stats(state), stats(nnx.state(flax_model)), **TOL)


def test_outside_a_strategy_it_is_flax_batch_norm():
    x = jnp.asarray(DATA)
    mask = x > 0.0
    ours, theirs = (cls(3, momentum=0.9, rngs=nnx.Rngs(0)) for cls in (SyncBatchNorm,
                                                                          nnx.BatchNorm))
    assert jax.tree.structure(nnx.state(ours)) == jax.tree.structure(nnx.state(theirs))
    for call in [nnx.jit(lambda m, x, mask: m(x, mask=mask)), lambda m, x, mask: m(x)]:
        np.testing.assert_allclose(call(ours, x, mask), call(theirs, x, mask), **TOL)
        np.testing.assert_allclose(stats(nnx.state(ours)), stats(nnx.state(theirs)), **TOL)
    ours.eval()
    theirs.eval()
    np.testing.assert_allclose(ours(x), theirs(x), **TOL)
    with pytest.raises(ValueError, match="use_running_average"):
        SyncBatchNorm(3, use_running_average=None, rngs=nnx.Rngs(0))(x)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_linen_batch_stats_and_outputs_equal_one_device_linen(n):
    s = strategy(n)
    mask = lambda x: x > 0.0  # noqa: E731
    ours = sync_linen.SyncBatchNorm(use_running_average=False, momentum=0.9)
    theirs = linen.BatchNorm(use_running_average=False, momentum=0.9)
    variables = ours.init(jax.random.key(0), DATA[:1])
    assert jax.tree.map(jnp.shape, variables) == jax.tree.map(
        jnp.shape, theirs.init(jax.random.key(0), DATA[:1]))

    def linen_step(masked):
        @s.run
        def step(variables, x):
            y, updates = ours.apply(variables, x, mask=mask(x) if masked else None,
                                    mutable=["batch_stats"])
            return y, {**variables, **updates}

        return step

    for masked in (False, True):
        step, mine, want = linen_step(masked), variables, variables
        for batch, x in zip(batches(s), GLOBAL_BATCHES, strict=True):
            y, mine = step(mine, batch)
            y_ref, updates = theirs.apply(want, x, mask=mask(x) if masked else None,
                                          mutable=["batch_stats"])
            want = {**want, **updates}
            np.testing.assert_allclose(real_rows(s, y), y_ref, **TOL)
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL),
                         mine["batch_stats"], want["batch_stats"])
    evaluate = s.run(lambda v, x: ours.clone(use_running_average=None).apply(
        v, x, use_running_average=True))
    for batch, x in zip(batches(s), GLOBAL_BATCHES, strict=True):
        np.testing.assert_allclose(real_rows(s, evaluate(mine, batch)), theirs.clone(
            use_running_average=True).apply(want, x), **TOL)
