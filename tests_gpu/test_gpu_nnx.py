"""flax NNX training, checkpoints and input prefetched to the devices, on the accelerator.

NNX training is compared with ``nnx.jit`` training of the same model on the first device, from
the same initial state. Tolerance ``TOL`` (rtol 1e-5, atol 1e-5): float32 at "highest" matmul
precision, SGD with momentum (no division by a running second moment that would amplify the
last bits of tiny gradients), four steps; the programs differ only in the order of their
additions (~1e-7 relative per sum). A checkpoint and a batch moved to the devices are copies:
compared bit for bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxmirror as jm

TOL = dict(rtol=1e-5, atol=1e-5)
STEPS = 4


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(8, 32, rngs=rngs)
        self.out = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def _optimizer(model):
    return nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)


def _batches(strategy, count=STEPS):
    """Global batches (x, labels) whose size splits unevenly over several replicas."""
    rows = 4 * strategy.num_replicas_in_sync + 1
    rng = np.random.default_rng(3)
    return [(rng.standard_normal((rows, 8)).astype(np.float32),
             rng.integers(0, 4, rows).astype(np.int32)) for _ in range(count)]


def _per_example_loss(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y)


def _distributed(strategy, seed=0):
    """A model and its optimizer built Mirrored by ``strategy.init``, and the training step."""
    model, optimizer = strategy.init(lambda: (m := MLP(nnx.Rngs(seed)), _optimizer(m)))

    @strategy.run
    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(
            lambda m: jm.compute_average_loss(_per_example_loss(m, x, y)))(model)
        grads = jm.get_replica_context().all_reduce("sum", grads)
        optimizer.update(model, grads)
        return loss

    return model, optimizer, train_step


def _host_state(obj):
    return jax.tree.map(np.asarray, nnx.state(obj))


def test_nnx_training_equals_nnx_jit_training(strategy, device):
    model, optimizer, train_step = _distributed(strategy)
    ref_model = nnx.eval_shape(lambda: MLP(nnx.Rngs(1)))  # the reference, on one device,
    nnx.update(ref_model, jax.device_put(_host_state(model), device))  # from the same state
    ref_optimizer = _optimizer(ref_model)
    nnx.update(ref_optimizer, jax.device_put(nnx.state(ref_optimizer), device))

    @nnx.jit
    def ref_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(_per_example_loss(m, x, y)))(model)
        optimizer.update(model, grads)
        return loss

    losses, ref_losses = [], []
    for (x, y), host in zip(strategy.experimental_distribute_dataset(_batches(strategy)),
                            _batches(strategy), strict=True):
        losses.append(float(strategy.reduce("SUM", train_step(model, optimizer, x, y),
                                            axis=None)))
        ref_losses.append(float(ref_step(ref_model, ref_optimizer,
                                         *jax.device_put(host, device))))
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    assert int(optimizer.step[...]) == STEPS == int(ref_optimizer.step[...])
    got, want = _host_state(model), _host_state(ref_model)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got, want)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL),
                 _host_state(optimizer), _host_state(ref_optimizer))  # momentum too
    assert jm.experimental.check_replicas(model, **TOL) == []
    kernel = model.hidden.kernel[...]  # Mirrored: one array on every replica's device
    assert kernel.sharding.device_set == set(strategy.extended.devices)


def test_checkpoint_round_trip_on_the_devices(strategy, tmp_path):
    model, optimizer, train_step = _distributed(strategy)
    dataset = strategy.experimental_distribute_dataset(_batches(strategy))
    x, y = next(iter(dataset))
    train_step(model, optimizer, x, y)  # momentum and step count are not their initial values
    with strategy.scope():
        steps = jm.Variable(np.int32(1), name="steps")
    path = tmp_path / "ckpt"
    jm.checkpoint.save(path, {"model": model, "optimizer": optimizer, "steps": steps})

    other, other_optimizer = strategy.init(lambda: (m := MLP(nnx.Rngs(1)), _optimizer(m)))
    with strategy.scope():
        other_steps = jm.Variable(np.int32(0), name="steps")
        restored = jm.checkpoint.restore(path, {"model": other, "optimizer": other_optimizer,
                                                "steps": other_steps})
    assert restored["model"] is other and restored["optimizer"] is other_optimizer
    assert int(other_steps.numpy()) == 1
    saved_state, restored_state = _host_state(optimizer), _host_state(other_optimizer)
    assert jax.tree.structure(saved_state) == jax.tree.structure(restored_state)
    jax.tree.map(np.testing.assert_array_equal, restored_state, saved_state)  # a copy: exact
    jax.tree.map(np.testing.assert_array_equal, _host_state(other), _host_state(model))
    for leaf in jax.tree.leaves(nnx.state(other)):  # read back onto every replica's device
        assert leaf.sharding.device_set == set(strategy.extended.devices)
    # Training resumes from the restored state as it would have gone on from the saved one.
    x, y = next(iter(dataset))
    want = float(strategy.reduce("SUM", train_step(model, optimizer, x, y), axis=None))
    got = float(strategy.reduce("SUM", train_step(other, other_optimizer, x, y), axis=None))
    np.testing.assert_allclose(got, want, **TOL)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL),
                 _host_state(other), _host_state(model))


def test_input_prefetched_to_the_devices_equals_the_host_batches(strategy):
    n = strategy.num_replicas_in_sync
    rows = 4 * n + 1
    rng = np.random.default_rng(4)
    host = [(rng.standard_normal((r, 5)).astype(np.float32), np.arange(r, dtype=np.int32) + i)
            for i, r in enumerate([rows, rows, rows, rows // 2 + 1])]  # the last one partial
    options = jm.InputOptions(prefetch_thread=True, experimental_per_replica_buffer_size=2)
    dataset = strategy.experimental_distribute_dataset(lambda: iter(host), options)

    @strategy.run
    def double(x):
        return x * 2.0  # exact in float32

    devices = list(strategy.extended.devices)
    seen = 0
    for _ in range(2):  # two passes: the prefetch thread restarts
        for (x, labels), (want_x, want_labels) in zip(dataset, host, strict=True):
            for value, want in ((x, want_x), (labels, want_labels)):
                parts = strategy.experimental_local_results(value)
                assert len(parts) == n
                for part, dev in zip(parts, devices):
                    assert part.devices() == {dev}  # on the replica's own device
                np.testing.assert_array_equal(np.concatenate([np.asarray(p) for p in parts]),
                                              want)
            np.testing.assert_array_equal(np.asarray(strategy.gather(double(x), axis=0)),
                                          want_x * 2.0)
            seen += 1
    assert seen == 2 * len(host)
