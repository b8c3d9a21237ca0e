"""TF's "Custom training with tf.distribute.Strategy" tutorial, ported to jaxmirror and flax NNX.

The port is written as a user would write it: a small CNN (Conv -> SyncBatchNorm -> relu ->
pooling -> Linear to 10 classes), its ``nnx.Optimizer``, Keras-style metrics made in the
strategy's scope, a ``train_step(model, optimizer, x, y)`` decorated with ``@strategy.run``
that scales the per-example losses with ``compute_average_loss`` by ``GLOBAL_BATCH_SIZE`` and
all-reduces the gradients, and the tutorial's loop ``total += strategy.reduce("SUM", ...)``
over a distributed dataset, then a ``test_step`` in evaluation mode.

50 examples in global batches of 16 give batches of 16, 16, 16 and 2 rows: the last is partial,
and 16 and 2 rows split unevenly over 3 and 4 replicas (6/5/5, 1/1/0, 4/4/4/4, 1/1/0/0), so
every component is padded. The reference trains the same model (same initialization) with
``nnx.jit`` on one device, on exactly the real rows of each global batch, with the same loss
scaling (a partial batch is still divided by ``GLOBAL_BATCH_SIZE``, as in TF) and flax's own
``nnx.BatchNorm``. Everything the port computes must equal it: parameters, BatchNorm running
statistics, optimizer state and step count, the per-epoch loss totals, the metrics, and the
replicas must agree with each other. The literal port (no gradient all-reduce, which TF's
``optimizer.apply_gradients`` hides) is flagged.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmirror
from conftest import strategy
from jaxmirror.nn import SyncBatchNorm

GLOBAL_BATCH_SIZE = 16
EPOCHS = 2
MOMENTUM, EPSILON = 0.9, 1e-5
_rng = np.random.default_rng(1234)
_PROJECTION = _rng.normal(size=(64, 10))  # labels: a fixed function of the image, learnable
TRAIN_X = _rng.normal(size=(50, 8, 8, 1)).astype(np.float32)
TEST_X = _rng.normal(size=(20, 8, 8, 1)).astype(np.float32)
TRAIN_Y, TEST_Y = (np.argmax(x.reshape(len(x), -1) @ _PROJECTION, axis=-1).astype(np.int32)
                   for x in (TRAIN_X, TEST_X))
TOL = dict(rtol=1e-4, atol=1e-5)


def global_batches(x, y):
    """The dataset, batched by the global batch size (the last batch partial): (x, y) tuples."""
    return [(x[i:i + GLOBAL_BATCH_SIZE], y[i:i + GLOBAL_BATCH_SIZE])
            for i in range(0, len(x), GLOBAL_BATCH_SIZE)]


TRAIN_BATCHES = global_batches(TRAIN_X, TRAIN_Y)  # 16, 16, 16, 2 rows
TEST_BATCHES = global_batches(TEST_X, TEST_Y)  # 16, 4 rows
STEPS = EPOCHS * len(TRAIN_BATCHES)


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


def make_model(batch_norm=SyncBatchNorm):
    return CNN(batch_norm, rngs=nnx.Rngs(0))


def make_optimizer(model):
    return nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def per_example_loss(model, x, y):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y), logits


@functools.lru_cache(maxsize=None)
def reference():
    """One device, ``nnx.jit``, flax's BatchNorm, the real rows of each global batch."""
    model = make_model(nnx.BatchNorm)
    optimizer = make_optimizer(model)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            losses, logits = per_example_loss(model, x, y)
            return jnp.sum(losses) / GLOBAL_BATCH_SIZE, logits  # TF: / GLOBAL_BATCH_SIZE

        (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return loss, logits

    @nnx.jit
    def test_step(model, x, y):
        losses, logits = per_example_loss(model, x, y)
        return losses, logits

    epochs = []
    for _ in range(EPOCHS):
        model.train()
        total, hits = 0.0, []
        for x, y in TRAIN_BATCHES:
            loss, logits = train_step(model, optimizer, x, y)
            total += float(loss)
            hits.append(np.argmax(np.asarray(logits), axis=-1) == y)
        model.eval()
        test_losses, test_hits = [], []
        for x, y in TEST_BATCHES:
            losses, logits = test_step(model, x, y)
            test_losses.append(np.asarray(losses))
            test_hits.append(np.argmax(np.asarray(logits), axis=-1) == y)
        epochs.append(dict(total=total, accuracy=np.concatenate(hits).mean(),
                           test_loss=np.concatenate(test_losses).mean(),
                           test_accuracy=np.concatenate(test_hits).mean()))
    model.train()
    return model, optimizer, epochs


def assert_trees_close(got, want):
    got, want = nnx.state(got), nnx.state(want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL),
                 got, want)


def train_with_strategy(s, create):
    """The tutorial's program on ``s``: ([per-epoch results], model, optimizer, train_step)."""
    with s.scope():
        if create == "init":
            model, optimizer = s.init(lambda: (m := make_model(), make_optimizer(m)))
        else:  # created eagerly, as TF creates them in the scope, and passed in as they are
            model = make_model()
            optimizer = make_optimizer(model)
        train_accuracy = jaxmirror.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_loss = jaxmirror.metrics.Mean(name="test_loss")
        test_accuracy = jaxmirror.metrics.SparseCategoricalAccuracy(name="test_accuracy")

    @s.run
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            losses, logits = per_example_loss(model, x, y)
            return jaxmirror.compute_average_loss(losses, global_batch_size=GLOBAL_BATCH_SIZE), \
                logits

        (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        grads = jaxmirror.get_replica_context().all_reduce("sum", grads)
        optimizer.update(model, grads)
        train_accuracy.update_state(y, logits)
        return loss

    @s.run
    def test_step(model, x, y):
        losses, logits = per_example_loss(model, x, y)
        test_loss.update_state(losses)
        test_accuracy.update_state(y, logits)

    train_dist_dataset = s.experimental_distribute_dataset(TRAIN_BATCHES)
    test_dist_dataset = s.experimental_distribute_dataset(TEST_BATCHES)
    epochs = []
    for _ in range(EPOCHS):
        model.train()
        total = 0.0
        for x, y in train_dist_dataset:
            total += float(s.reduce("SUM", train_step(model, optimizer, x, y), axis=None))
        model.eval()
        for x, y in test_dist_dataset:
            test_step(model, x, y)
        epochs.append(dict(total=total, accuracy=float(train_accuracy.result()),
                           test_loss=float(test_loss.result()),
                           test_accuracy=float(test_accuracy.result())))
        for metric in (train_accuracy, test_loss, test_accuracy):
            metric.reset_state()
    model.train()
    return epochs, model, optimizer, train_step


@pytest.mark.parametrize("n, create", [(1, "init"), (2, "init"), (3, "init"), (4, "init"),
                                       (2, "eager"), (4, "eager")])
def test_custom_training_tutorial_equals_one_device_training(n, create):
    s = strategy(n)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # The correct port has nothing to flag: either warning fails the test where it is raised.
        warnings.simplefilter("error", jaxmirror.experimental.ReplicaDivergenceWarning)
        warnings.simplefilter("error", jaxmirror.experimental.PaddedRowsWarning)
        epochs, model, optimizer, train_step = train_with_strategy(s, create)
    # Nor any other user-facing warning (e.g. arrays mirrored onto the devices on every call).
    assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == []
    ref_model, ref_optimizer, ref_epochs = reference()

    assert int(optimizer.step[...]) == STEPS == int(ref_optimizer.step[...])
    assert_trees_close(model, ref_model)  # params and BatchNorm running statistics
    np.testing.assert_allclose(np.asarray(model.bn.mean[...]), np.asarray(ref_model.bn.mean[...]),
                               **TOL)
    np.testing.assert_allclose(np.asarray(model.bn.var[...]), np.asarray(ref_model.bn.var[...]),
                               **TOL)
    assert_trees_close(optimizer, ref_optimizer)  # Adam's moments and count too
    for got, want in zip(epochs, ref_epochs, strict=True):
        np.testing.assert_allclose(got["total"], want["total"], rtol=1e-5)
        np.testing.assert_allclose(got["accuracy"], want["accuracy"], rtol=1e-6)
        np.testing.assert_allclose(got["test_loss"], want["test_loss"], rtol=1e-5)
        np.testing.assert_allclose(got["test_accuracy"], want["test_accuracy"], rtol=1e-6)
    assert jaxmirror.experimental.check_replicas(model) == []
    assert jaxmirror.experimental.check_replicas(optimizer) == []
    if n > 1:  # the parameters came back Mirrored: one array replicated over the devices
        kernel = model.conv.kernel[...]
        assert isinstance(kernel, jax.Array) and kernel.sharding.is_fully_replicated
        assert len(kernel.devices()) == n
        # One program for the whole run: the partial last batch is padded data, not a new
        # program, and an eagerly created model is placed before the first call.
        assert train_step.trace_count == train_step.compile_count == 1
    else:  # as in TF, one replica gets plain batches: the shorter last one is a second trace
        assert train_step.trace_count == 2


def test_literal_tf_port_without_gradient_all_reduce_is_flagged():
    # TF's optimizer.apply_gradients all-reduces the gradients; the literal port has no
    # all-reduce, so each replica applies its own gradients and the copies drift apart.
    s = strategy(2)
    with s.scope():
        model, optimizer = s.init(lambda: (m := make_model(), make_optimizer(m)))

    @s.run
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            losses, _ = per_example_loss(model, x, y)
            return jaxmirror.compute_average_loss(losses, global_batch_size=GLOBAL_BATCH_SIZE)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    assert jaxmirror.experimental.check_replicas(model) == []
    x, y = next(iter(s.experimental_distribute_dataset(TRAIN_BATCHES)))
    with pytest.warns(jaxmirror.experimental.ReplicaDivergenceWarning, match="all-reduce"):
        train_step(model, optimizer, x, y)
    diverged = jaxmirror.experimental.check_replicas(model)
    assert diverged and any("kernel" in path for path in diverged)
