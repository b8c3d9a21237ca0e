"""An MLP trained with MirroredStrategy equals the same training on one device, step for step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmirror as jm
from conftest import mirrored

STEPS, GLOBAL_BATCH, FEATURES, CLASSES = 6, 32, 12, 5


def init_params(key):
    k1, k2 = jax.random.split(key)
    return {
        "hidden": {"w": jax.random.normal(k1, (FEATURES, 16)) * 0.3, "b": jnp.zeros(16)},
        "out": {"w": jax.random.normal(k2, (16, CLASSES)) * 0.3, "b": jnp.zeros(CLASSES)},
    }


def per_example_loss(params, x, y):
    h = jax.nn.relu(x @ params["hidden"]["w"] + params["hidden"]["b"])
    logits = h @ params["out"]["w"] + params["out"]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def batches():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * GLOBAL_BATCH, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=STEPS * GLOBAL_BATCH).astype(np.int32)
    return [{"x": x[i:i + GLOBAL_BATCH], "y": y[i:i + GLOBAL_BATCH]}
            for i in range(0, len(x), GLOBAL_BATCH)]


def single_device(tx):
    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean(per_example_loss(p, batch["x"], batch["y"])))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = init_params(jax.random.key(1))
    opt_state, losses = tx.init(params), []
    for batch in batches():
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return params, losses


def distributed(strategy, tx, donate=False):
    def step(params, opt_state, batch):
        def loss_fn(p):
            return jm.compute_average_loss(per_example_loss(p, batch["x"], batch["y"]))

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = jm.get_replica_context().all_reduce("sum", grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = strategy.function(step, donate_argnums=(0, 1) if donate else ())
    params = init_params(jax.random.key(1))
    opt_state, losses = tx.init(params), []
    for batch in strategy.experimental_distribute_dataset(batches()):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(strategy.reduce("sum", loss, axis=None)))
    return params, losses, step


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_mirrored_training_equals_single_device(n, optimizer):
    make = {"sgd": lambda: optax.sgd(0.1, momentum=0.9), "adam": lambda: optax.adam(1e-2)}[optimizer]
    strategy = mirrored(n)
    ref_params, ref_losses = single_device(make())
    params, losses, step = distributed(strategy, make(), donate=(n == 8))
    np.testing.assert_allclose(losses, ref_losses, atol=2e-5, rtol=0)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    # New params are Mirrored (one replicated array per leaf), never PerReplica.
    for leaf in jax.tree.leaves(params):
        assert isinstance(leaf, jax.Array) and leaf.sharding.is_fully_replicated
        assert len(leaf.sharding.device_set) == n
    assert step.trace_count == 1  # one program for the whole run
    assert losses[-1] < losses[0]


def test_one_device_strategy_trains_the_same():
    tx = optax.sgd(0.1)
    ref_params, ref_losses = single_device(tx)
    params, losses, _ = distributed(jm.OneDeviceStrategy("CPU:0"), optax.sgd(0.1))
    np.testing.assert_allclose(losses, ref_losses, atol=2e-5, rtol=0)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
