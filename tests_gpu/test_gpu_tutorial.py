"""TF's "Custom training with tf.distribute.Strategy" tutorial, ported to jaxmirror and NNX, on
the accelerator (``tests/test_tf_tutorial_nnx.py`` runs it on simulated CPU devices).

A small CNN (Conv -> ``SyncBatchNorm`` -> relu -> pooling -> Linear), Adam, Keras-style metrics
made in the strategy's scope, ``train_step(model, optimizer, x, y)`` with
``compute_average_loss(..., global_batch_size=GLOBAL_BATCH_SIZE)`` and an all-reduce of the
gradients, the tutorial's ``total += strategy.reduce("SUM", ...)`` loop over a distributed
dataset, then ``test_step`` in evaluation mode. Global batches of 15 rows (the last partial)
split unevenly over several GPUs. The reference trains the same model from the same initial
state with ``nnx.jit`` and flax's ``nnx.BatchNorm`` on the first device, on the real rows.

Tolerance ``TOL`` (rtol 1e-4, atol 1e-5): float32 at "highest" precision, but Adam divides each
update by the root of its second moment, which turns the last-bit differences of small
gradients (another convolution algorithm, another summation order over replicas) into larger
relative differences of the update; over 8 steps that stays well under 1e-4. Accuracies count
argmaxes and must be equal (a near-tie within 1e-4 among 70 examples is not expected).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxmirror as jm
from jaxmirror.nn import SyncBatchNorm

GLOBAL_BATCH_SIZE = 15
EPOCHS = 2
MOMENTUM, EPSILON = 0.9, 1e-5
TOL = dict(rtol=1e-4, atol=1e-5)
_rng = np.random.default_rng(1234)
_PROJECTION = _rng.normal(size=(64, 10))  # labels: a fixed function of the image, learnable
TRAIN_X = _rng.normal(size=(50, 8, 8, 1)).astype(np.float32)
TEST_X = _rng.normal(size=(20, 8, 8, 1)).astype(np.float32)
TRAIN_Y, TEST_Y = (np.argmax(x.reshape(len(x), -1) @ _PROJECTION, axis=-1).astype(np.int32)
                   for x in (TRAIN_X, TEST_X))


def _global_batches(x, y):
    return [(x[i:i + GLOBAL_BATCH_SIZE], y[i:i + GLOBAL_BATCH_SIZE])
            for i in range(0, len(x), GLOBAL_BATCH_SIZE)]


TRAIN_BATCHES = _global_batches(TRAIN_X, TRAIN_Y)  # 15, 15, 15, 5 rows
TEST_BATCHES = _global_batches(TEST_X, TEST_Y)  # 15, 5 rows


class CNN(nnx.Module):
    def __init__(self, batch_norm, rngs):
        # No bias before BatchNorm: its gradient is 0 up to rounding, which Adam would amplify.
        self.conv = nnx.Conv(1, 4, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.bn = batch_norm(4, momentum=MOMENTUM, epsilon=EPSILON, rngs=rngs)
        self.linear = nnx.Linear(4 * 4 * 4, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.conv(x)))
        x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        return self.linear(x.reshape(x.shape[0], -1))


def _optimizer(model):
    return nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def _per_example_loss(model, x, y):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y), logits


def _host_state(obj):
    return jax.tree.map(np.asarray, nnx.state(obj))


def _train_with_strategy(s):
    """The tutorial's program on ``s``: (per-epoch results, model, optimizer, train_step)."""
    with s.scope():
        model, optimizer = s.init(lambda: (m := CNN(SyncBatchNorm, nnx.Rngs(0)), _optimizer(m)))
        train_accuracy = jm.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_loss = jm.metrics.Mean(name="test_loss")
        test_accuracy = jm.metrics.SparseCategoricalAccuracy(name="test_accuracy")
    initial = _host_state(model)

    @s.run
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            losses, logits = _per_example_loss(model, x, y)
            return jm.compute_average_loss(losses, global_batch_size=GLOBAL_BATCH_SIZE), logits

        (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        grads = jm.get_replica_context().all_reduce("sum", grads)
        optimizer.update(model, grads)
        train_accuracy.update_state(y, logits)
        return loss

    @s.run
    def test_step(model, x, y):
        losses, logits = _per_example_loss(model, x, y)
        test_loss.update_state(losses)
        test_accuracy.update_state(y, logits)

    train_dataset = s.experimental_distribute_dataset(TRAIN_BATCHES)
    test_dataset = s.experimental_distribute_dataset(TEST_BATCHES)
    epochs = []
    for _ in range(EPOCHS):
        model.train()
        total = 0.0
        for x, y in train_dataset:
            total += float(s.reduce("SUM", train_step(model, optimizer, x, y), axis=None))
        model.eval()
        for x, y in test_dataset:
            test_step(model, x, y)
        epochs.append(dict(total=total, accuracy=float(train_accuracy.result()),
                           test_loss=float(test_loss.result()),
                           test_accuracy=float(test_accuracy.result())))
        for metric in (train_accuracy, test_loss, test_accuracy):
            metric.reset_state()
    model.train()
    return epochs, initial, model, optimizer, train_step


def _reference(initial, device):
    """One device, ``nnx.jit``, flax's BatchNorm, the real rows of each global batch."""
    model = nnx.eval_shape(lambda: CNN(nnx.BatchNorm, nnx.Rngs(1)))
    nnx.update(model, jax.device_put(initial, device))  # the same initial state
    optimizer = _optimizer(model)
    # Every leaf committed to the device (the step count too): one program per batch shape.
    nnx.update(optimizer, jax.device_put(nnx.state(optimizer), device))

    @nnx.jit
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            losses, logits = _per_example_loss(model, x, y)
            return jnp.sum(losses) / GLOBAL_BATCH_SIZE, logits  # TF: / GLOBAL_BATCH_SIZE

        (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return loss, logits

    @nnx.jit
    def test_step(model, x, y):
        return _per_example_loss(model, x, y)

    epochs = []
    for _ in range(EPOCHS):
        model.train()
        total, hits = 0.0, []
        for x, y in TRAIN_BATCHES:
            loss, logits = train_step(model, optimizer, *jax.device_put((x, y), device))
            total += float(loss)
            hits.append(np.argmax(np.asarray(logits), axis=-1) == y)
        model.eval()  # per example: every test row in one call (one program)
        losses, logits = test_step(model, *jax.device_put((TEST_X, TEST_Y), device))
        epochs.append(dict(total=total, accuracy=np.concatenate(hits).mean(),
                           test_loss=np.asarray(losses).mean(),
                           test_accuracy=(np.argmax(np.asarray(logits), axis=-1) == TEST_Y).mean()))
    model.train()
    return epochs, model, optimizer


def _assert_states_close(got, want):
    got, want = _host_state(got), _host_state(want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got, want)


def test_custom_training_tutorial_equals_one_device_training(strategy, device):
    with warnings.catch_warnings():
        # The correct port has nothing to flag: either warning fails the test where it is raised.
        warnings.simplefilter("error", jm.experimental.ReplicaDivergenceWarning)
        warnings.simplefilter("error", jm.experimental.PaddedRowsWarning)
        epochs, initial, model, optimizer, train_step = _train_with_strategy(strategy)
    ref_epochs, ref_model, ref_optimizer = _reference(initial, device)

    steps = EPOCHS * len(TRAIN_BATCHES)
    assert int(optimizer.step[...]) == steps == int(ref_optimizer.step[...])
    _assert_states_close(model, ref_model)  # params and BatchNorm running statistics
    _assert_states_close(optimizer, ref_optimizer)  # Adam's moments and count too
    for got, want in zip(epochs, ref_epochs, strict=True):
        np.testing.assert_allclose(got["total"], want["total"], **TOL)
        np.testing.assert_allclose(got["test_loss"], want["test_loss"], **TOL)
        np.testing.assert_allclose(got["accuracy"], want["accuracy"], rtol=1e-6)
        np.testing.assert_allclose(got["test_accuracy"], want["test_accuracy"], rtol=1e-6)
    assert jm.experimental.check_replicas(model, **TOL) == []
    assert jm.experimental.check_replicas(optimizer, **TOL) == []
    if strategy.num_replicas_in_sync > 1:
        # One program for the whole run: the partial last batch is padded data.
        assert train_step.trace_count == train_step.compile_count == 1
    else:  # as in TF, one replica gets plain batches: the shorter last one is a second trace
        assert train_step.trace_count == 2
