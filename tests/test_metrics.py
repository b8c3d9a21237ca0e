"""``jaxmirror.metrics``: Keras metrics on sync-on-read state, exact on padded batches.

Every expectation is NumPy over exactly the real examples. The datasets have 11 examples in
global batches of 4 (4, 4, 3), so every replica count but 1 pads: 2 replicas split the last
batch 2/1, 3 replicas split every batch unevenly, 4 replicas leave one replica without a row.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmirror
from jaxmirror import metrics
from conftest import strategy

N_EXAMPLES, GLOBAL_BATCH, CLASSES = 11, 4, 4
NS = [1, 2, 3, 4]
TOL = dict(rtol=1e-6, atol=1e-6)


# -- the metrics, their data and their NumPy references ------------------------------------------


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _xent(labels, probs):
    p = np.clip(probs / probs.sum(-1, keepdims=True), 1e-7, 1 - 1e-7)
    return -np.log(np.take_along_axis(p, labels.reshape(-1, 1).astype(int), -1)[:, 0])


def _data(name, rng, n=N_EXAMPLES):
    """(y, p): labels (or values) and predictions of ``n`` examples for metric ``name``."""
    f32 = np.float32
    if name == "sum":
        return np.zeros(n, f32), rng.normal(size=n).astype(f32)
    if name == "mean":  # (n, 3) values: every element counts, a (n,) weight weighs the rows
        return np.zeros(n, f32), rng.normal(size=(n, 3)).astype(f32)
    if name == "accuracy":  # (n, 1) labels against (n,) predictions: Keras squeezes
        return rng.integers(0, 3, (n, 1)), rng.integers(0, 3, n)
    if name == "binary_accuracy":
        return rng.integers(0, 2, (n, 1)).astype(f32), rng.uniform(size=(n, 1)).astype(f32)
    if name == "categorical_accuracy":
        return (np.eye(CLASSES, dtype=f32)[rng.integers(0, CLASSES, n)],
                rng.uniform(size=(n, CLASSES)).astype(f32))
    if name == "sparse_categorical_accuracy":
        return rng.integers(0, CLASSES, n), rng.uniform(size=(n, CLASSES)).astype(f32)
    if name == "sparse_categorical_crossentropy":
        return (rng.integers(0, CLASSES, (n, 1)),
                _softmax(rng.normal(size=(n, CLASSES))).astype(f32))
    if name == "sparse_categorical_crossentropy_logits":
        return rng.integers(0, CLASSES, n), rng.normal(size=(n, CLASSES)).astype(f32)
    assert name == "mean_squared_error"
    return rng.normal(size=(n, 3)).astype(f32), rng.normal(size=(n, 3)).astype(f32)


def _per_example(name, y, p):
    """NumPy's values of metric ``name``: one row per example (Sum/Mean: the values)."""
    if name in ("sum", "mean"):
        return p.astype(np.float64)
    if name == "accuracy":
        return (y[:, 0] == p).astype(np.float64)
    if name == "binary_accuracy":
        return ((p > 0.5) == y).astype(np.float64)
    if name == "categorical_accuracy":
        return (y.argmax(-1) == p.argmax(-1)).astype(np.float64)
    if name == "sparse_categorical_accuracy":
        return (y == p.argmax(-1)).astype(np.float64)
    if name == "sparse_categorical_crossentropy":
        return _xent(y, p.astype(np.float64))
    if name == "sparse_categorical_crossentropy_logits":
        return _xent(y, _softmax(p.astype(np.float64)))
    return ((y.astype(np.float64) - p) ** 2).mean(-1)


def _expected(name, y, p, w=None):
    """``name``'s result over these examples: the weighted sum, or the weighted mean."""
    v = _per_example(name, y, p)
    w = np.ones(len(v)) if w is None else w.astype(np.float64)
    w = np.broadcast_to(w.reshape((-1,) + (1,) * (v.ndim - 1)), v.shape)
    if name == "sum":
        return (v * w).sum()
    return (v * w).sum() / w.sum() if w.sum() else 0.0


FACTORIES = {
    "sum": metrics.Sum,
    "mean": metrics.Mean,
    "accuracy": metrics.Accuracy,
    "binary_accuracy": metrics.BinaryAccuracy,
    "categorical_accuracy": metrics.CategoricalAccuracy,
    "sparse_categorical_accuracy": metrics.SparseCategoricalAccuracy,
    "sparse_categorical_crossentropy": metrics.SparseCategoricalCrossentropy,
    "sparse_categorical_crossentropy_logits":
        lambda: metrics.SparseCategoricalCrossentropy(from_logits=True),
    "mean_squared_error": metrics.MeanSquaredError,
}


def _update(name, metric, y, p, w=None):
    if name in ("sum", "mean"):
        metric.update_state(p, sample_weight=w)
    else:
        metric.update_state(y, p, sample_weight=w)


def _batches(*arrays, size=GLOBAL_BATCH):
    n = len(arrays[0])
    return [tuple(a[i:i + size] for a in arrays) for i in range(0, n, size)]


def _close(result, expected):
    assert isinstance(result, jax.Array) and result.shape == () and result.dtype == jnp.float32
    np.testing.assert_allclose(float(result), expected, **TOL)


# -- every metric against NumPy, at 1 to 4 replicas ----------------------------------------------


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("name", list(FACTORIES))
def test_metric_over_a_padded_epoch_equals_numpy(name, n):
    s = strategy(n)
    rng = np.random.default_rng(len(name) + n)
    y, p = _data(name, rng)
    w = rng.uniform(0.0, 2.0, N_EXAMPLES).astype(np.float32)
    with s.scope():
        plain, weighted = FACTORIES[name](), FACTORIES[name]()

    @s.run
    def step(y, p, w):  # two metrics updated in one step
        _update(name, plain, y, p)
        _update(name, weighted, y, p, w)

    for batch in s.experimental_distribute_dataset(_batches(y, p, w)):
        step(*batch)
    _close(plain.result(), _expected(name, y, p))
    _close(weighted.result(), _expected(name, y, p, w))
    if name != "sum":  # the count is exact: padded rows would add to it
        elements = _per_example(name, y, p).size
        assert float(plain.count.numpy()) == elements
        np.testing.assert_allclose(float(weighted.count.numpy()),
                                   w.sum() * elements / N_EXAMPLES, rtol=1e-6)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_padded_rows_would_change_the_result_but_are_left_out(n):
    s = strategy(n)
    x = np.arange(N_EXAMPLES, dtype=np.float32) ** 2
    with s.scope():
        mean, total = metrics.Mean(), metrics.Sum()

    @s.run
    def step(x):
        mean.update_state(x)
        total.update_state(np.float32(1.0) + 0 * x)
        return jnp.sum(x), jnp.float32(x.shape[0])  # what counting every row would give

    naive_sum = naive_rows = 0.0
    for batch in s.experimental_distribute_dataset(_batches(x)):
        sums, rows = step(*batch)
        naive_sum += float(s.reduce("sum", sums, axis=None))
        naive_rows += float(s.reduce("sum", rows, axis=None))
    assert naive_rows > N_EXAMPLES and naive_sum / naive_rows != pytest.approx(x.mean())
    _close(mean.result(), x.mean())
    assert float(mean.count.numpy()) == N_EXAMPLES
    assert float(total.result()) == N_EXAMPLES


@pytest.mark.parametrize("n", [1, 3])
def test_result_inside_the_step_is_the_running_value_over_every_replica(n):
    s = strategy(n)
    rng = np.random.default_rng(7)
    y, p = _data("sparse_categorical_accuracy", rng)
    with s.scope():
        acc = metrics.SparseCategoricalAccuracy()
        loss = metrics.Mean(name="loss")

    @s.run
    def step(y, p):
        acc.update_state(y, p)
        return acc.result(), loss(p[:, 0])  # __call__: update, then result

    seen = 0
    for batch in s.experimental_distribute_dataset(_batches(y, p)):
        running, running_loss = step(*batch)
        seen += len(np.asarray(s.gather(batch[0], axis=0)) if n > 1 else batch[0])
        _close(jnp.asarray(running), _expected("sparse_categorical_accuracy", y[:seen], p[:seen]))
        _close(jnp.asarray(running_loss), p[:seen, 0].mean())
    _close(acc.result(), _expected("sparse_categorical_accuracy", y, p))


# -- sample weights --------------------------------------------------------------------------------


def test_sample_weight_shapes_are_matched_as_keras_does():
    s = strategy(3)
    x = np.arange(N_EXAMPLES, dtype=np.float32)
    w = np.linspace(0.0, 1.0, N_EXAMPLES, dtype=np.float32)
    with s.scope():
        column, scalar, zero = metrics.Mean(), metrics.Mean(), metrics.Mean()

    @s.run
    def step(x, w):
        column.update_state(x, sample_weight=w[:, None])  # (B, 1) for (B,) values
        scalar.update_state(x, sample_weight=2.0)
        zero.update_state(x, sample_weight=0.0 * w)

    for batch in s.experimental_distribute_dataset(_batches(x, w)):
        step(*batch)
    _close(column.result(), (x * w).sum() / w.sum())
    _close(scalar.result(), x.mean())
    assert float(scalar.count.numpy()) == 2 * N_EXAMPLES
    _close(zero.result(), 0.0)  # 0 / 0 is 0, as Keras's divide_no_nan


# -- state: reset, epochs, eager updates, where metrics are made --------------------------------


@pytest.mark.parametrize("n", [2, 3])
def test_the_same_metric_over_two_epochs_with_reset_between(n):
    s = strategy(n)
    rng = np.random.default_rng(3)
    with s.scope():
        mse = metrics.MeanSquaredError()

    @s.run
    def step(y, p):
        mse.update_state(y, p)

    for epoch in range(2):
        y, p = _data("mean_squared_error", rng)
        mse.reset_state()
        for batch in s.experimental_distribute_dataset(_batches(y, p)):
            step(*batch)
        _close(mse.result(), _expected("mean_squared_error", y, p))
        if epoch == 0:
            traces = step.trace_count
    assert step.trace_count == traces


def test_reset_state_zeroes_every_component():
    s = strategy(3)
    with s.scope():
        m = metrics.Mean()

    @s.run
    def step(x):
        m.update_state(x)

    step(*next(iter(s.experimental_distribute_dataset([(np.arange(5.0, dtype=np.float32),)]))))
    assert [float(c) for c in m.count.values] == [2.0, 2.0, 1.0]
    m.reset_state()
    for v in m.variables:
        assert [float(c) for c in v.values] == [0.0, 0.0, 0.0]
    _close(m.result(), 0.0)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_eager_update_state_on_plain_arrays(name):
    s = strategy(3)
    rng = np.random.default_rng(11)
    y, p = _data(name, rng)
    w = rng.uniform(size=N_EXAMPLES).astype(np.float32)
    with s.scope():
        m = FACTORIES[name]()
    _update(name, m, y[:6], p[:6], w[:6])  # eagerly, outside any step (and outside the scope)
    _update(name, m, y[6:], p[6:], w[6:])
    _close(m.result(), _expected(name, y, p, w))
    # The whole amount went to replica 0's component, so the aggregate is exact.
    assert all(float(c) == 0.0 for c in m.variables[0].values[1:])


def test_eager_updates_and_steps_add_up():
    s = strategy(3)
    x = np.arange(N_EXAMPLES, dtype=np.float32)
    with s.scope():
        m = metrics.Mean()
    m.update_state(x[:3])

    @s.run
    def step(x):
        m.update_state(x)

    for batch in s.experimental_distribute_dataset(_batches(x[3:])):
        step(*batch)
    with s.scope():  # eagerly in cross-replica context too
        m.update_state(jnp.asarray(x[:3]))
    _close(m.result(), np.concatenate([x, x[:3]]).mean())


def test_a_metric_made_outside_every_scope_has_plain_variables_of_the_default_strategy():
    m = metrics.Mean()
    assert all(type(v) is jaxmirror.Variable for v in m.variables)
    assert m.variables[0].distribute_strategy is jaxmirror.get_strategy()
    m.update_state([1.0, 2.0])
    jaxmirror.get_strategy().run(lambda: m.update_state(jnp.array([6.0])))
    _close(m.result(), 3.0)
    one = strategy(1)  # a single-replica step may update it
    one.run(lambda x: m.update_state(x), args=(np.array([7.0, 9.0], np.float32),))
    _close(m.result(), 5.0)
    with pytest.raises(ValueError, match="created outside any strategy's scope"):
        strategy(2).run(lambda: m.update_state(jnp.ones(2)))
    _close(m.result(), 5.0)


def test_a_metric_made_under_experimental_set_strategy_belongs_to_it():
    s = strategy(2)
    jaxmirror.experimental_set_strategy(s)
    try:
        m = metrics.Accuracy()
    finally:
        jaxmirror.experimental_set_strategy(None)
    assert all(isinstance(v, jaxmirror.SyncOnReadVariable) for v in m.variables)
    assert m.variables[0].distribute_strategy is s
    batch = next(iter(s.experimental_distribute_dataset([(np.array([1, 2, 3]),
                                                          np.array([1, 0, 3]))])))
    s.run(lambda y, p: m.update_state(y, p), args=batch)
    _close(m.result(), 2 / 3)


def test_one_device_strategy():
    s = jaxmirror.OneDeviceStrategy("CPU:1")
    with s.scope():
        m = metrics.Sum()
    assert type(m.total) is jaxmirror.Variable and m.total.distribute_strategy is s
    s.run(lambda x: m.update_state(x), args=(jnp.arange(4.0),))
    m.update_state([4.0])
    _close(m.result(), 10.0)


# -- properties ------------------------------------------------------------------------------------


def test_names_dtypes_and_variables():
    s = strategy(2)
    with s.scope():
        made = {name: factory() for name, factory in FACTORIES.items()}
        mean16 = metrics.Mean(name="loss", dtype="bfloat16")
    for name, m in made.items():
        assert m.name == name.replace("_logits", "")
        assert m.dtype == jnp.float32
        assert [v.name for v in m.variables] == (["total"] if name == "sum" else
                                                 ["total", "count"])
        for v in m.variables:
            assert isinstance(v, jaxmirror.SyncOnReadVariable)
            assert v.aggregation is jaxmirror.VariableAggregation.SUM
            assert v.synchronization is jaxmirror.VariableSynchronization.ON_READ
            assert not v.trainable and v.shape == () and v.dtype == jnp.float32
    assert mean16.name == "loss" and mean16.dtype == jnp.bfloat16
    assert mean16.result().dtype == jnp.bfloat16
    assert repr(made["mean"]) == "<Mean name='mean' dtype=float32>"
    assert metrics.MeanMetricWrapper(jnp.subtract).name == "mean_metric_wrapper"


def test_a_custom_metric_with_add_weight():
    s = strategy(2)

    class Hits(metrics.Metric):
        def __init__(self):
            super().__init__()
            self.hits = self.add_weight("hits", shape=(2,))

        def update_state(self, x):
            self.hits.assign_add(jnp.stack([jnp.sum(x > 0), jnp.sum(x <= 0)]).astype(self.dtype))

        def result(self):
            return self.hits.read_value()

    with s.scope():
        h = Hits()
    assert h.name == "hits"
    x = s.experimental_distribute_values_from_function(
        lambda c: jnp.array([1.0, -1.0]) * (c.replica_id_in_sync_group + 1))
    s.run(lambda x: h.update_state(x), args=(x,))
    assert h.result().tolist() == [2.0, 2.0]
    h.reset_state()
    assert h.result().tolist() == [0.0, 0.0]
    with pytest.raises(NotImplementedError, match="update_state"):
        metrics.Metric().update_state(1.0)


# -- bad arguments -----------------------------------------------------------------------------


def test_shape_mismatch_is_refused_at_trace_time_naming_the_arguments():
    s = strategy(2)
    with s.scope():
        acc = metrics.Accuracy()

    @s.run
    def step(y, p):
        acc.update_state(y, p)

    y, p = np.zeros(4, np.int32), np.zeros((4, 3), np.float32)
    batch = next(iter(s.experimental_distribute_dataset([(y, p)])))
    with pytest.raises(ValueError, match=r"Accuracy\.update_state: `y_true` has shape \(2,\) but "
                                         r"`y_pred` has shape \(2, 3\); expected the same shape"):
        step(*batch)
    with pytest.raises(ValueError, match=r"`y_true` has shape \(4,\) but `y_pred` has shape"):
        acc.update_state(y, p)
    assert float(acc.count.numpy()) == 0.0


@pytest.mark.parametrize("make,args,error,match", [
    (metrics.SparseCategoricalAccuracy, (np.zeros((4, 3)), np.zeros((4, 3))), ValueError,
     r"SparseCategoricalAccuracy\.update_state: `y_true` has shape \(4, 3\) .* expected one class "
     r"index per row of `y_pred`: shape \(4,\)"),
    (metrics.SparseCategoricalCrossentropy, (np.zeros(4), np.zeros(4)), ValueError,
     r"`y_true` has shape \(4,\) but `y_pred` has shape \(4,\)"),
    (metrics.CategoricalAccuracy, (np.zeros((4, 3)), np.zeros((4, 2))), ValueError,
     r"CategoricalAccuracy\.update_state: `y_true` has shape \(4, 3\) but `y_pred` has shape "
     r"\(4, 2\)"),
    (metrics.MeanSquaredError, (np.zeros((4, 2)), np.zeros((3, 2))), ValueError,
     r"MeanSquaredError\.update_state: `y_true` has shape \(4, 2\)"),
    (metrics.BinaryAccuracy, (["a", "b"], [0.1, 0.2]), TypeError,
     r"BinaryAccuracy\.update_state: `y_true` must hold booleans, integers or floats"),
])
def test_bad_arguments_name_themselves(make, args, error, match):
    m = make()
    with pytest.raises(error, match=match):
        m.update_state(*args)
    _close(m.result(), 0.0)


def test_bad_values_and_sample_weights_name_themselves():
    m = metrics.Mean()
    with pytest.raises(ValueError, match=r"Mean\.update_state: `sample_weight` has shape \(2,\) "
                                         r"but the values it weighs have shape \(3,\)"):
        m.update_state([1.0, 2.0, 3.0], sample_weight=[1.0, 2.0])
    with pytest.raises(TypeError, match=r"`values` must be an array of numbers"):
        m.update_state([[1.0], [1.0, 2.0]])
    with pytest.raises(TypeError, match=r"`sample_weight` must hold booleans, integers or floats"):
        m.update_state([1.0], sample_weight=[None])
    _close(m.result(), 0.0)


def test_bad_constructor_arguments_and_contexts():
    with pytest.raises(ValueError, match=r"Mean: `dtype` must be a floating dtype"):
        metrics.Mean(dtype="int32")
    with pytest.raises(ValueError, match=r"`name` must be a string"):
        metrics.Sum(name=3)
    with pytest.raises(ValueError, match=r"`threshold` must be a real number"):
        metrics.BinaryAccuracy(threshold="0.5")
    with pytest.raises(TypeError, match=r"`fn` must be callable"):
        metrics.MeanMetricWrapper(3)
    s = strategy(2)
    with pytest.raises(RuntimeError, match=r"metric 'mean' was created inside `run`"):
        s.run(lambda: metrics.Mean())
    with s.scope():
        m = metrics.Mean()
    per_replica = s.experimental_distribute_values_from_function(lambda c: jnp.ones(2))
    with pytest.raises(TypeError, match=r"Mean\.update_state: `values` is a PerReplica"):
        m.update_state(per_replica)
    with pytest.raises(RuntimeError, match=r"traced values outside `strategy.run`"):
        jax.jit(lambda x: m.update_state(x))(jnp.ones(2))

    def in_merge_fn():
        jaxmirror.get_replica_context().merge_call(lambda _: m.update_state(jnp.ones(2)))

    with pytest.raises(RuntimeError, match=r"in cross-replica context inside `run`"):
        s.run(in_merge_fn)
    _close(m.result(), 0.0)
