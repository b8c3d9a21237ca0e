"""``compute_average_loss`` and the simple ``experimental_distribute_dataset`` (TF's
rules for both); every expectation is NumPy."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmirror
from conftest import ctx, local, strategy

NS = [1, 2, 4, 8]
cal = jaxmirror.compute_average_loss


def losses_for(n, b):
    """Per-replica losses: replica i holds b distinct positive values."""
    return [np.arange(b, dtype=np.float32) * 0.5 + 1.0 + 3.0 * i for i in range(n)]


def distribute_rows(s, rows):
    return s.experimental_distribute_values_from_function(
        lambda c: rows[c.replica_id_in_sync_group])


# -- compute_average_loss outside any strategy ---------------------------------------------------


def test_outside_any_strategy_is_sum_over_batch():
    assert not jaxmirror.has_strategy()
    assert float(cal(jnp.array([1.0, 2.0, 3.0, 6.0]))) == 3.0
    assert float(cal(np.array([2.0, 4.0], np.float32))) == 3.0
    # Rank 2: everything summed, divided by the batch (axis 0) only.
    loss = np.arange(6, dtype=np.float32).reshape(3, 2)
    assert float(cal(loss)) == 15.0 / 3


def test_outside_keeps_dtype_and_returns_scalar():
    out = cal(jnp.array([1.0, 2.0], jnp.float32))
    assert out.shape == ()
    assert out.dtype == jnp.float32
    out16 = cal(jnp.array([1.0, 2.0, 3.0], jnp.bfloat16))
    assert out16.dtype == jnp.bfloat16
    assert float(out16) == 2.0


def test_outside_with_sample_weight():
    loss = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    w = np.array([1.0, 0.0, 2.0, 0.5], np.float32)
    assert float(cal(loss, sample_weight=w)) == pytest.approx((1 + 0 + 6 + 2) / 4)
    assert float(cal(loss, sample_weight=2.0)) == pytest.approx(2 * loss.mean())
    assert float(cal(loss, sample_weight=jnp.float32(0.0))) == 0.0


def test_sample_weight_with_one_rank_less_is_per_example():
    # TF (scale_losses_by_sample_weight -> squeeze_or_expand_dimensions) expands a weight of
    # rank(loss) - 1 on the last axis, so weights of shape (B,) weigh the rows of a (B, T) loss.
    loss = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    w = np.array([1.0, 0.0], np.float32)
    expected = (loss * w[:, None]).sum() / 2  # = 1.5, not (loss * w).sum() / 2 = 2.0
    assert float(cal(loss, sample_weight=w)) == pytest.approx(expected)
    loss3 = np.ones((3, 2), np.float32)
    w3 = np.array([1.0, 2.0, 3.0], np.float32)
    assert float(cal(loss3, sample_weight=w3)) == pytest.approx((loss3 * w3[:, None]).sum() / 3)


def test_sample_weight_with_one_rank_more_is_squeezed():
    # TF squeezes a trailing axis of size 1 off a weight of rank(loss) + 1: the Keras-style
    # (B, 1) weights for (B,) losses weigh each example once (no (B, B) broadcast).
    loss = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    w = np.array([[1.0], [0.0], [2.0], [0.5]], np.float32)
    assert float(cal(loss, sample_weight=w)) == pytest.approx((1 + 0 + 6 + 2) / 4)


def test_explicit_global_batch_size():
    assert float(cal(jnp.array([1.0, 2.0]), global_batch_size=4)) == 0.75
    assert float(cal(np.array([1.0, 2.0, 3.0], np.float32), global_batch_size=np.int32(6))) == 1.0
    w = np.array([2.0, 1.0], np.float32)
    assert float(cal(jnp.array([1.0, 2.0]), sample_weight=w, global_batch_size=8)) == 0.5


@pytest.mark.parametrize("loss", [1.0, np.float32(2.0), jnp.float32(3.0)], ids=repr)
def test_scalar_per_example_loss_raises(loss):
    with pytest.raises(ValueError, match="per_example_loss"):
        cal(loss)
    with pytest.raises(ValueError):
        cal(loss, global_batch_size=2)


@pytest.mark.parametrize("gbs", [0, -1, -8, 2.5, 4.0, True, np.float32(4.0)], ids=repr)
def test_bad_global_batch_size_raises(gbs):
    with pytest.raises(ValueError, match="global_batch_size"):
        cal(jnp.array([1.0, 2.0]), global_batch_size=gbs)


@pytest.mark.parametrize("gbs", [np.int64(0), np.int32(-3), jnp.int32(0)], ids=repr)
def test_non_positive_numpy_global_batch_size_raises(gbs):
    # TF: check_ops.assert_positive_v2(global_batch_size) whatever its integer type.
    with pytest.raises(ValueError, match="global_batch_size"):
        cal(jnp.array([1.0, 2.0]), global_batch_size=gbs)


def test_non_scalar_global_batch_size_raises():
    with pytest.raises(ValueError, match="global_batch_size"):
        cal(jnp.array([1.0, 2.0]), global_batch_size=np.array([4, 4]))


# -- compute_average_loss inside run / scope -----------------------------------------------------


def _average_loss_step(loss):
    return cal(loss)


def _weighted_average_loss_step(loss, w):
    return cal(loss, sample_weight=w)


@pytest.mark.parametrize("n", NS)
def test_inside_run_divides_by_the_global_batch(n):
    s = strategy(n)
    b = 3
    rows = losses_for(n, b)
    out = s.run(_average_loss_step, args=(distribute_rows(s, rows),))
    # Each replica: its own sum / (local batch * N).
    expected_local = [r.sum() / (b * n) for r in rows]
    np.testing.assert_allclose(local(s, out), expected_local, rtol=1e-6)
    # Summed over replicas: the global mean.
    global_mean = np.concatenate(rows).mean()
    np.testing.assert_allclose(float(s.reduce("sum", out, axis=None)), global_mean, rtol=1e-6)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_inside_run_all_reduced_sum_is_the_global_mean(n):
    s = strategy(n)
    rows = losses_for(n, 2)

    def step(loss):
        return ctx().all_reduce("sum", cal(loss))

    out = s.run(step, args=(distribute_rows(s, rows),))
    assert not isinstance(out, jaxmirror.PerReplica)
    np.testing.assert_allclose(float(out), np.concatenate(rows).mean(), rtol=1e-6)


@pytest.mark.parametrize("n", NS)
def test_inside_run_with_sample_weight(n):
    s = strategy(n)
    b = 2
    rows = losses_for(n, b)
    weights = [np.array([1.0, 0.25 * (i + 1)], np.float32) for i in range(n)]
    out = s.run(_weighted_average_loss_step,
                args=(distribute_rows(s, rows), distribute_rows(s, weights)))
    expected = (np.concatenate(rows) * np.concatenate(weights)).sum() / (b * n)
    np.testing.assert_allclose(float(s.reduce("sum", out, axis=None)), expected, rtol=1e-6)
    np.testing.assert_allclose(
        local(s, out), [(r * w).sum() / (b * n) for r, w in zip(rows, weights)], rtol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_inside_run_with_explicit_global_batch_size(n):
    s = strategy(n)
    rows = losses_for(n, 2)
    out = s.run(lambda loss: cal(loss, global_batch_size=10), args=(distribute_rows(s, rows),))
    np.testing.assert_allclose(local(s, out), [r.sum() / 10 for r in rows], rtol=1e-6)


@pytest.mark.parametrize("n", [2, 4])
def test_inside_run_summed_gradients_are_the_global_mean_gradient(n):
    s = strategy(n)
    b = 2
    xs = [np.array([1.0 + i, -2.0 * i], np.float32) for i in range(n)]
    ys = [np.array([0.5, 1.0 + i], np.float32) for i in range(n)]
    w0 = np.float32(0.75)

    def step(w, x, y):
        grad = jax.grad(lambda w: cal((x * w - y) ** 2))(w)
        return ctx().all_reduce("sum", grad)

    g = s.run(step, args=(jnp.float32(w0), distribute_rows(s, xs), distribute_rows(s, ys)))
    x, y = np.concatenate(xs), np.concatenate(ys)
    expected = np.mean(2 * (x * w0 - y) * x)  # d/dw mean((x w - y)^2)
    assert x.shape == (b * n,)
    np.testing.assert_allclose(float(g), expected, rtol=1e-5)


@pytest.mark.parametrize("which", ["mirrored2", "one_device"])
def test_inside_scope_without_global_batch_size_raises(which):
    s = strategy(2) if which == "mirrored2" else jaxmirror.OneDeviceStrategy("CPU:0")
    with s.scope():
        assert jaxmirror.in_cross_replica_context()
        with pytest.raises(RuntimeError, match="cross replica context"):
            cal(jnp.array([1.0, 2.0]))
        # With an explicit global batch size it is a plain division.
        assert float(cal(jnp.array([1.0, 2.0]), global_batch_size=6)) == 0.5
    # Outside the scope again: the plain mean.
    assert float(cal(jnp.array([1.0, 2.0]))) == 1.5


# -- experimental_distribute_dataset -------------------------------------------------------------

G = 8  # global batch: divisible by 1, 2, 4 and 8


def make_batches(num=3, g=G):
    """Global batches whose rows are the example ids 0..num*g-1 (as column 0)."""
    return [np.stack([np.arange(k * g, (k + 1) * g, dtype=np.float32),
                      np.full(g, k, np.float32)], axis=1) for k in range(num)]


@pytest.mark.parametrize("n", NS)
def test_each_replica_gets_its_contiguous_rows(n):
    s = strategy(n)
    batches = make_batches()
    elements = list(s.experimental_distribute_dataset(batches))
    assert len(elements) == len(batches)
    per = G // n
    for batch, element in zip(batches, elements):
        if n > 1:
            assert isinstance(element, jaxmirror.PerReplica)
        parts = local(s, element)
        assert len(parts) == n
        for r, part in enumerate(parts):
            assert part.shape == (per, 2)
            np.testing.assert_array_equal(part, batch[r * per:(r + 1) * per])


@pytest.mark.parametrize("n", [2, 4, 8])
def test_components_live_on_their_replica_device(n):
    s = strategy(n)
    element = next(iter(s.experimental_distribute_dataset(make_batches(1))))
    for r, c in enumerate(s.experimental_local_results(element)):
        assert c.devices() == {s.extended.devices[r]}


@pytest.mark.parametrize("n", NS)
def test_nested_dict_elements(n):
    s = strategy(n)
    batches = [{
        "x": np.arange(G * 3, dtype=np.float32).reshape(G, 3) + 1000 * k,
        "y": np.arange(G, dtype=np.int32) + 100 * k,
        "meta": {"w": np.linspace(0, 1, G, dtype=np.float32).reshape(G, 1) + k},
    } for k in range(2)]
    per = G // n
    for batch, element in zip(batches, s.experimental_distribute_dataset(batches)):
        assert set(element) == {"x", "y", "meta"} and set(element["meta"]) == {"w"}
        if n > 1:
            assert isinstance(element["x"], jaxmirror.PerReplica)
            assert isinstance(element["meta"]["w"], jaxmirror.PerReplica)
        parts = s.experimental_local_results(element)
        assert len(parts) == n
        for r, part in enumerate(parts):
            rows = slice(r * per, (r + 1) * per)
            np.testing.assert_array_equal(np.asarray(part["x"]), batch["x"][rows])
            np.testing.assert_array_equal(np.asarray(part["y"]), batch["y"][rows])
            assert np.asarray(part["y"]).dtype == np.int32
            np.testing.assert_array_equal(np.asarray(part["meta"]["w"]), batch["meta"]["w"][rows])


@pytest.mark.parametrize("n", [2, 4])
def test_tuple_elements_feed_run(n):
    s = strategy(n)
    xs = np.arange(G, dtype=np.float32)
    ys = 2.0 * xs + 1.0
    element = next(iter(s.experimental_distribute_dataset([(xs, ys)])))
    assert isinstance(element, tuple) and len(element) == 2

    def step(x, y):
        return ctx().all_reduce("sum", jnp.sum(x * y)), jnp.sum(x)

    total, local_sums = s.run(step, args=element)
    assert float(total) == float(np.sum(xs * ys))
    per = G // n
    assert [float(v) for v in s.experimental_local_results(local_sums)] == [
        float(xs[r * per:(r + 1) * per].sum()) for r in range(n)]
    # Cross-replica views of the element see the global batch again.
    np.testing.assert_array_equal(np.asarray(s.gather(element[0], axis=0)), xs)
    assert float(s.reduce("sum", element[1], axis=0)) == float(ys.sum())
    assert float(s.reduce("mean", element[1], axis=0)) == float(ys.mean())


@pytest.mark.parametrize("n", NS)
def test_every_example_seen_exactly_once_per_epoch_and_reiterable(n):
    s = strategy(n)
    batches = make_batches(num=4)
    ds = s.experimental_distribute_dataset(batches)

    def epoch():
        ids = []
        for element in ds:
            for part in local(s, element):
                ids.extend(part[:, 0].astype(int).tolist())
        return ids

    first = epoch()
    assert sorted(first) == list(range(4 * G))
    assert len(first) == len(set(first)) == 4 * G
    second = epoch()
    assert second == first


@pytest.mark.parametrize("n", [1, 2, 4])
def test_get_next_and_stop_iteration(n):
    s = strategy(n)
    batches = make_batches(num=2)
    it = iter(s.experimental_distribute_dataset(batches))
    assert isinstance(it, jaxmirror.DistributedIterator)
    first = it.get_next()
    np.testing.assert_array_equal(np.concatenate(local(s, first)), batches[0])
    second = next(it)
    np.testing.assert_array_equal(np.concatenate(local(s, second)), batches[1])
    with pytest.raises(StopIteration):
        next(it)
    with pytest.raises(StopIteration):
        it.get_next()
    # A fresh iterator starts over.
    again = next(iter(s.experimental_distribute_dataset(batches)))
    np.testing.assert_array_equal(np.concatenate(local(s, again)), batches[0])


def test_distributed_dataset_type_and_generator_source():
    s = strategy(2)
    ds = s.experimental_distribute_dataset(make_batches(2))
    assert isinstance(ds, jaxmirror.DistributedDataset)
    # Any re-iterable works; a one-shot generator gives one epoch.
    gen = (b for b in make_batches(2))
    assert sum(1 for _ in s.experimental_distribute_dataset(gen)) == 2


@pytest.mark.parametrize("n", [1, 2, 4])
def test_leaves_disagreeing_on_batch_size_raise(n):
    s = strategy(n)
    element = {"x": np.zeros((8, 2), np.float32), "y": np.zeros((4,), np.float32)}
    with pytest.raises(ValueError, match="batch size"):
        next(iter(s.experimental_distribute_dataset([element])))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_scalar_element_raises(n):
    s = strategy(n)
    for element in (np.float32(1.0), {"x": np.zeros((4,), np.float32), "s": np.float32(3.0)}):
        with pytest.raises(ValueError):
            next(iter(s.experimental_distribute_dataset([element])))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_next_inside_run_raises(n):
    s = strategy(n)
    it = iter(s.experimental_distribute_dataset(make_batches(2)))
    with pytest.raises(ValueError, match="inside `run`"):
        s.run(lambda: next(it))
    with pytest.raises(ValueError):
        s.run(lambda: it.get_next())
