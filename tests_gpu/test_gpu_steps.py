"""``run``, ``reduce``, variables, a failed step's rollback and fused steps on the accelerator.

Each result is compared with the same math in plain JAX (``jax.jit``) on the first device.
Tolerance ``TOL`` (rtol 1e-5, atol 1e-5): float32 at "highest" matmul precision, where the
distributed program and the reference differ only in the order of their additions (matmul
tiles of another batch size, the cross-replica all-reduce): a few ulps (~1e-7 relative) per
sum, growing slowly over a few SGD steps. TF32 (the GPU's default for float32 matmuls) would be
off by ~1e-3, so the tolerance also checks that the precision holds. Values that are sums of
small integers (the rollback test) are exact in float32 and compared for equality.
"""

import jax
import jax.numpy as jnp
import numpy as np

import jaxmirror as jm

TOL = dict(rtol=1e-5, atol=1e-5)
LR = 0.1


def _rows(strategy):
    """A global batch size that splits unevenly over several replicas (padded components)."""
    return 4 * strategy.num_replicas_in_sync + 1


def test_run_and_reduce_equal_plain_jax(strategy, device):
    rows = _rows(strategy)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, 32)).astype(np.float32)
    w = (rng.standard_normal((32, 16)) / 4).astype(np.float32)

    @strategy.run
    def step(w, x):
        def loss_fn(w):
            return jm.compute_average_loss(jnp.sum(jnp.tanh(x @ w) ** 2, axis=-1))

        y = jnp.tanh(x @ w)
        loss, grad = jax.value_and_grad(loss_fn)(w)
        return y, loss, jm.get_replica_context().all_reduce("sum", grad)

    batch = next(iter(strategy.experimental_distribute_dataset([x])))
    y, loss, grad = step(strategy.experimental_replicate(w), batch)

    @jax.jit
    def reference(w, x):
        def loss_fn(w):
            return jnp.sum(jnp.tanh(x @ w) ** 2) / x.shape[0]

        loss, grad = jax.value_and_grad(loss_fn)(w)
        return jnp.tanh(x @ w), loss, grad

    ref_y, ref_loss, ref_grad = (np.asarray(a) for a in reference(
        jax.device_put(w, device), jax.device_put(x, device)))
    np.testing.assert_allclose(np.asarray(strategy.gather(y, axis=0)), ref_y, **TOL)
    np.testing.assert_allclose(np.asarray(strategy.reduce("SUM", y, axis=0)), ref_y.sum(0), **TOL)
    np.testing.assert_allclose(np.asarray(strategy.reduce("MEAN", y, axis=0)), ref_y.mean(0),
                               **TOL)
    np.testing.assert_allclose(float(strategy.reduce("SUM", loss, axis=None)), ref_loss, **TOL)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, **TOL)  # all-reduced: Mirrored
    components = [np.asarray(c) for c in strategy.experimental_local_results(grad)]
    assert len(components) == strategy.num_replicas_in_sync
    for c in components:
        np.testing.assert_allclose(c, ref_grad, **TOL)


# -- TF-style variables, their rollback, fused steps --------------------------------------------
def _data(strategy, count=7):
    """``count`` global batches (x, y) of a linear regression; the last one partial."""
    rows = _rows(strategy)
    rng = np.random.default_rng(1)
    sizes = [rows] * (count - 1) + [rows // 2 + 1]
    return [(rng.standard_normal((r, 6)).astype(np.float32),
             rng.standard_normal((r, 3)).astype(np.float32)) for r in sizes]


def _variables(strategy):
    rng = np.random.default_rng(2)
    with strategy.scope():
        w = jm.Variable(rng.standard_normal((6, 3)).astype(np.float32), name="w")
        b = jm.Variable(np.zeros(3, np.float32), name="b")
    return w, b


def _loss(w, b, x, y):
    """Per-example squared errors."""
    return jnp.sum((x @ w + b - y) ** 2, axis=-1)


def _training_step(w, b):
    """TF's step on an (x, y) element: gradients all-reduced, SGD applied to the variables."""

    def step(element):
        x, y = element
        loss, grads = jax.value_and_grad(
            lambda w_, b_: jm.compute_average_loss(_loss(w_, b_, x, y)), argnums=(0, 1))(
            w.read_value(), b.read_value())
        gw, gb = jm.get_replica_context().all_reduce("SUM", grads)
        w.assign_sub(LR * gw)
        b.assign_sub(LR * gb)
        return loss

    return step


def _reference(strategy, device):
    """Plain JAX on ``device``: the per-step losses and the final (w, b)."""
    w0, b0 = (v.numpy() for v in _variables(strategy))

    @jax.jit
    def step(w, b, x, y):
        loss, (gw, gb) = jax.value_and_grad(
            lambda w, b: jnp.mean(_loss(w, b, x, y)), argnums=(0, 1))(w, b)
        return w - LR * gw, b - LR * gb, loss

    w, b = jax.device_put((w0, b0), device)
    losses = []
    for x, y in _data(strategy):
        w, b, loss = step(w, b, *jax.device_put((x, y), device))
        losses.append(float(loss))
    return losses, np.asarray(w), np.asarray(b)


def test_variables_training_equals_plain_jax(strategy, device):
    w, b = _variables(strategy)
    step = strategy.function(_training_step(w, b))
    losses = [float(strategy.reduce("SUM", step(element), axis=None))
              for element in strategy.experimental_distribute_dataset(_data(strategy))]
    ref_losses, ref_w, ref_b = _reference(strategy, device)
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    np.testing.assert_allclose(w.numpy(), ref_w, **TOL)
    np.testing.assert_allclose(b.numpy(), ref_b, **TOL)
    for v in (w, b):  # Mirrored: every replica holds the same value
        assert jm.experimental.check_replicas(v, **TOL) == []


def test_fused_steps_equal_single_steps(strategy, device):
    k = 3
    w, b = _variables(strategy)
    steps = strategy.function(_training_step(w, b), steps_per_execution=k)
    iterator = iter(strategy.experimental_distribute_dataset(_data(strategy)))
    losses, calls = [], 0
    while True:
        try:
            loss = steps(iterator)  # k steps in one program (the last call: what is left)
        except StopIteration:
            break
        calls += 1
        losses += list(np.asarray(strategy.reduce("SUM", loss, axis=None)))
    assert calls == -(-len(_data(strategy)) // k)
    single_w, single_b = _variables(strategy)
    single = strategy.function(_training_step(single_w, single_b))
    single_losses = [float(strategy.reduce("SUM", single(element), axis=None))
                     for element in strategy.experimental_distribute_dataset(_data(strategy))]
    # The fused loop may fuse the step's arithmetic differently from the single step's
    # program: equal up to rounding, not bit for bit, on a GPU.
    np.testing.assert_allclose(losses, single_losses, **TOL)
    np.testing.assert_allclose(w.numpy(), single_w.numpy(), **TOL)
    np.testing.assert_allclose(b.numpy(), single_b.numpy(), **TOL)
    ref_losses, ref_w, ref_b = _reference(strategy, device)
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    np.testing.assert_allclose(w.numpy(), ref_w, **TOL)


def test_a_failed_steps_writes_roll_back(strategy):
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        v = jm.Variable(jnp.zeros(3), aggregation="sum")

    def check(x):
        if float(x) < 0:
            raise RuntimeError("negative batch")

    @strategy.function
    def step(x):
        jax.debug.callback(check, x[0])  # fails at run time, after the step was dispatched
        v.assign_add(x)  # every replica adds x: the sum aggregation gives n * x
        return x[0]

    errors = []
    try:
        for value in (1.0, 2.0, -100.0, 4.0, 8.0):
            step(np.full(3, value, np.float32))  # results dropped, as a loop does
    except Exception as e:  # noqa: BLE001 - the failure, asserted below
        errors.append(e)
    try:
        value = v.numpy()
    except Exception as e:  # noqa: BLE001 - or its first read raises it
        errors.append(e)
        value = v.numpy()
    assert len(errors) == 1 and "negative batch" in str(errors[0]), errors
    # Exactly the steps before the failure: (1 + 2) * n, small integers, exact in float32.
    np.testing.assert_array_equal(value, np.full(3, 3.0 * n, np.float32))
    step(np.ones(3, np.float32))  # the variable stays usable
    np.testing.assert_array_equal(v.numpy(), np.full(3, 4.0 * n, np.float32))
