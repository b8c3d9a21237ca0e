"""flax's own ``BatchNorm(axis_name=<replica axis>)`` given ``mask=batch_mask`` over a padded
batch leaves the padding out of each replica's mean, but then ``pmean``s those means: every
replica weighs alike however many real rows it has, so the statistics differ from one device's
over the real rows (here 15.0 against 14.5, 3.4%). ``run`` warns, naming
``jaxmirror.nn.SyncBatchNorm``, whose statistics are exact; it stays quiet for that layer and
for batches without padding (issue 29)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, nnx

import jaxmirror
from conftest import ctx, strategy
from jaxmirror.experimental import PaddedRowsWarning
from jaxmirror.step.analysis import masked_stats

X = (np.arange(10.0, dtype=np.float32) + 10).reshape(10, 1)  # 4 replicas: 3, 3, 2, 2 rows


def _run(s, layer, x):
    """One step of ``layer`` (a fresh step function: jit caches traces) over ``x``: the
    ``PaddedRowsWarning``s raised and the running mean and variance (momentum 0: the batch's)."""
    graphdef, state = nnx.split(layer)

    def step(x, state):
        model = nnx.merge(graphdef, state)
        mask = ctx().batch_mask
        model(x, mask=jnp.ones(x.shape, bool) if mask is None else mask[:, None])
        return nnx.state(model)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = s.run(step, args=(x, state))
    found = [w for w in caught if issubclass(w.category, PaddedRowsWarning)]
    return found, float(state["mean"][...][0]), float(state["var"][...][0])


def _flax(s):
    return nnx.BatchNorm(1, axis_name=s.extended.axis_name, momentum=0.0,
                         use_running_average=False, rngs=nnx.Rngs(0))


def test_flax_batch_norm_masked_over_a_partial_batch_warns_and_is_off():
    s = strategy(4)
    batch = next(iter(s.experimental_distribute_dataset([X])))
    assert np.asarray(batch.row_counts).tolist() == [3, 3, 2, 2]
    found, mean, var = _run(s, _flax(s), batch)
    (w,) = found
    message = str(w.message)
    assert "jaxmirror.nn.SyncBatchNorm" in message and "BatchNorm" in message
    assert "psum" in message and w.filename == __file__  # at the call of the layer
    # One device, flax's own BatchNorm over the 10 real rows: mean 14.5, variance 8.25.
    one = nnx.BatchNorm(1, momentum=0.0, use_running_average=False, rngs=nnx.Rngs(0))
    one(jnp.asarray(X))
    assert (float(one.mean[...][0]), float(one.var[...][0])) == (14.5, 8.25)
    # flax under the strategy: the mean of the four replicas' means, each weighed alike.
    parts = np.split(X[:, 0].astype(np.float64), [3, 6, 8])
    flax_mean = np.mean([p.mean() for p in parts])
    flax_var = np.mean([(p ** 2).mean() for p in parts]) - flax_mean ** 2
    np.testing.assert_allclose([mean, var], [flax_mean, flax_var], rtol=1e-5)
    assert flax_mean == 15.0 and abs(mean / 14.5 - 1) > 0.03  # 3.4% off, silently before


def test_sync_batch_norm_over_the_same_batch_is_exact_and_quiet():
    s = strategy(4)
    batch = next(iter(s.experimental_distribute_dataset([X])))
    layer = jaxmirror.nn.SyncBatchNorm(1, momentum=0.0, use_running_average=False,
                                       rngs=nnx.Rngs(0))
    found, mean, var = _run(s, layer, batch)
    assert found == []
    np.testing.assert_allclose([mean, var], [14.5, 8.25], rtol=1e-6)


def test_flax_batch_norm_over_a_batch_without_padding_is_quiet():
    s = strategy(4)
    full = s.experimental_distribute_values_from_function(
        lambda c: X[2 * c.replica_id_in_sync_group:2 * c.replica_id_in_sync_group + 2])
    found, mean, var = _run(s, _flax(s), full)
    assert found == []
    np.testing.assert_allclose([mean, var], [13.5, 5.25], rtol=1e-6)  # X's first 8 rows


def _linen_step(x, counts):
    mask = (jnp.arange(2) < counts[jax.lax.axis_index("r")])[:, None]
    layer = linen.BatchNorm(use_running_average=False, axis_name="r", momentum=0.0)
    variables = layer.init(jax.random.key(0), x, mask=mask)
    return layer.apply(variables, x, mask=mask, mutable=["batch_stats"])[0]


def _hand_written_weighted(x, counts):
    mask = (jnp.arange(2) < counts[jax.lax.axis_index("r")])[:, None]
    total = jax.lax.psum(jnp.sum(jnp.where(mask, x, 0)), "r")
    return total / jax.lax.psum(jnp.sum(mask), "r")


def _sync_batch_norm_statistics(x, counts):
    mask = (jnp.arange(2) < counts[jax.lax.axis_index("r")])[:, None]
    return jaxmirror.nn.statistics.batch_statistics(x, (0,), mask=mask, axis_name="r")


def test_the_analysis_finds_flax_statistics_only():
    def found(fn):
        jaxpr = jax.make_jaxpr(fn, axis_env=[("r", 2)])(jnp.ones((2, 1)), jnp.ones(2, int))
        return masked_stats.per_replica_means(jaxpr.jaxpr, [0], [1], "r")

    (linen_found,) = found(_linen_step)
    assert linen_found.startswith("psum") and "normalization.py" in linen_found
    assert found(_hand_written_weighted) == []
    assert found(_sync_batch_norm_statistics) == []
