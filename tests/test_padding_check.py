"""A hand-written sum over a padded batch's rows fed to a cross-replica collective warns once.

The batch: 3 rows over 2 replicas (2/1), padded to 2 rows per replica, so replica 1 holds one
padded row. ``jnp.mean(x)`` there counts it; reduced across replicas the statistic differs from
one-device training. Masked reductions (``compute_average_loss``, ``batch_mask``), max/min, and
reductions that never meet a collective stay quiet.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmirror
from conftest import ctx, strategy
from jaxmirror.step.analysis.padding_check import (GATHERED, RETURNED, PaddedRowsWarning,
                                                   unmasked_row_reductions)

X = np.arange(6.0, dtype=np.float32).reshape(3, 2)
Y = np.array([1.0, 0.0, 2.0], np.float32)


@pytest.fixture(scope="module")
def setup():
    s = strategy(2)
    batch = next(iter(s.experimental_distribute_dataset([(X, Y)])))
    return s, batch


def warnings_of(s, fn, args) -> list:
    """The ``PaddedRowsWarning``s one ``run`` of a fresh ``fn`` raised (jit caches traces)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s.run(fn, args=args)
    return [w for w in caught if issubclass(w.category, PaddedRowsWarning)]


# --- through strategy.run ---------------------------------------------------------------------


def test_mean_all_reduced_warns_at_the_run_call(setup):
    s, batch = setup

    def step(x, y):
        return ctx().all_reduce("mean", jnp.mean(x))

    with pytest.warns(PaddedRowsWarning) as caught:
        s.run(step, args=batch)
    (w,) = caught
    message = str(w.message)
    assert message.startswith("run: a sum or mean over the rows of a padded batch")
    assert "psum at test_padding_check.py" in message and "reduce_sum at" in message
    for fix in ("compute_average_loss", "batch_mask", "jaxmirror.nn.SyncBatchNorm"):
        assert fix in message
    assert w.filename == __file__  # the user's `run` call, not jaxmirror or jax


def test_warns_once_per_trace(setup):
    s, batch = setup

    def step(x, y):
        return ctx().all_reduce("sum", jnp.sum(y))

    assert len(warnings_of(s, step, batch)) == 1
    assert warnings_of(s, step, batch) == []  # same signature: no new trace


def test_flax_batch_norm_with_a_replica_axis_warns(setup):
    s, batch = setup
    graphdef, state = nnx.split(nnx.BatchNorm(2, axis_name="replica", rngs=nnx.Rngs(0)))

    def step(x, y, state):
        model = nnx.merge(graphdef, state)
        return model(x), nnx.state(model)

    (w,) = warnings_of(s, step, (*batch, state))
    assert "normalization.py" in str(w.message)  # flax's statistics, named


def test_standard_training_step_does_not_warn(setup):
    s, batch = setup
    params = {"w": jnp.ones((2,)), "b": jnp.zeros(())}

    def step(x, y, params):
        def loss_fn(p):
            per_example = (x @ p["w"] + p["b"] - y) ** 2
            return jaxmirror.compute_average_loss(per_example)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = ctx().all_reduce("sum", grads)
        return ctx().all_reduce("sum", loss), jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    assert warnings_of(s, step, (*batch, params)) == []


QUIET = {
    "masked_sum": lambda x, y: ctx().all_reduce("sum", jnp.sum(x * ctx().batch_mask[:, None])),
    "where_masked_mean": lambda x, y: ctx().all_reduce(
        "mean", jnp.sum(jnp.where(ctx().batch_mask, y, 0)) / jnp.sum(ctx().batch_mask)),
    "max": lambda x, y: ctx().all_reduce("sum", jnp.max(x)),
    "argmin": lambda x, y: ctx().all_reduce("sum", jnp.argmin(y)),
    "masked_returned": lambda x, y: jnp.sum(y * ctx().batch_mask),
    "rows_returned": lambda x, y: x * 2,  # local results and gather keep the real rows only
}


@pytest.mark.parametrize("name", sorted(QUIET))
def test_quiet_steps(setup, name):
    s, batch = setup
    body = QUIET[name]

    def step(x, y):  # a fresh function per case: jit caches traces
        return body(x, y)

    assert warnings_of(s, step, batch) == []


def test_no_padded_batch_no_warning():
    s = strategy(2)

    def step(x):
        return ctx().all_reduce("mean", jnp.mean(x))

    assert warnings_of(s, step, (jnp.asarray(X),)) == []


def test_all_gathered_mean_warns(setup):
    s, batch = setup

    def step(x, y):
        return ctx().all_gather(jnp.mean(x, axis=0, keepdims=True), axis=0)

    (w,) = warnings_of(s, step, batch)
    assert "all_gather at" in str(w.message)


# --- the analysis on small jaxprs -------------------------------------------------------------


def found(fn, *shapes, counts=True, axes=(("r", 2),)):
    """``unmasked_row_reductions`` of ``fn(x, ..., counts)``: the first argument is padded."""
    args = [jnp.ones(s) for s in shapes] + ([jnp.ones(2, jnp.int32)] if counts else [])
    jaxpr = jax.make_jaxpr(fn, axis_env=list(axes))(*args).jaxpr
    return unmasked_row_reductions(jaxpr, {0: 0}, [len(args) - 1] if counts else [], "r")


def mask(counts, rows=4):
    return jnp.arange(rows) < counts[jax.lax.axis_index("r")]


def kinds(findings):
    """``[(collective, reduction)]`` of findings."""
    return [(f.split(" at ")[0], f.split(" of ")[1].split(" at ")[0]) for f in findings]


FOUND = {
    "mean": (lambda x, c: jax.lax.psum(jnp.mean(x), "r"), ("psum", "reduce_sum")),
    "pmean_of_variance": (lambda x, c: jax.lax.pmean(jnp.var(x, axis=0), "r"),
                          ("psum", "reduce_sum")),
    "gram": (lambda x, c: jax.lax.psum(x.T @ x, "r"), ("psum", "dot_general")),
    "reverse_cumsum": (lambda x, c: jax.lax.psum(jax.lax.cumsum(x, 0, reverse=True)[0], "r"),
                       ("psum", "cumsum")),
    "all_gather": (lambda x, c: jax.lax.all_gather(x.sum(0), "r"), ("all_gather", "reduce_sum")),
    "psum_scatter": (lambda x, c: jax.lax.psum_scatter(x.sum(0)[:2], "r", tiled=True),
                     ("reduce_scatter", "reduce_sum")),
    "inside_jit": (lambda x, c: jax.jit(lambda a: jax.lax.psum(a.mean(0), "r"))(x),
                   ("psum", "reduce_sum")),
    "after_masked_work": (lambda x, c: jax.lax.psum(jnp.mean(x) + jnp.sum(x * mask(c)[:, None]),
                                                    "r"), ("psum", "reduce_sum")),
    "cond_branch": (lambda x, c: jax.lax.cond(x[0, 0] > 0, lambda a: jax.lax.psum(a.sum(), "r"),
                                              lambda a: a[0, 0], x), ("psum", "reduce_sum")),
    "scanned_layers_carry_rows": (
        lambda x, c: jax.lax.scan(lambda h, _: (h - jax.lax.pmean(h.mean(0), "r"), None), x,
                                  None, length=3)[0], ("psum", "reduce_sum")),
    "while_carry": (lambda x, c: jax.lax.psum(jax.lax.fori_loop(0, 3, lambda i, a: a * 2,
                                                                x.sum()), "r"),
                    ("psum", "reduce_sum")),
}


@pytest.mark.parametrize("name", sorted(FOUND))
def test_unmasked_reductions_reaching_collectives_are_found(name):
    fn, expected = FOUND[name]
    assert kinds(found(fn, (4, 3)))[:1] == [expected]


def test_convolution_keeps_rows_and_its_weight_gradient_sums_them():
    dn = ("NHWC", "HWIO", "NHWC")

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn)

    def bn_after_conv(x, w, c):
        return jax.lax.pmean(jnp.mean(jax.nn.relu(conv(x, w)), axis=(0, 1, 2)), "r")

    def weight_gradient(x, w, c):
        return jax.lax.psum(jax.grad(lambda w: conv(x, w).sum())(w), "r")

    def masked_weight_gradient(x, w, c):
        loss = lambda w: jnp.sum(jnp.where(mask(c)[:, None, None, None], conv(x, w), 0))
        return jax.lax.psum(jax.grad(loss)(w), "r")

    shapes = ((4, 5, 5, 3), (3, 3, 3, 2))
    assert kinds(found(bn_after_conv, *shapes)) == [("psum", "reduce_sum")]
    assert kinds(found(weight_gradient, *shapes)) == [("psum", "conv_general_dilated")]
    assert found(masked_weight_gradient, *shapes) == []


NOT_FOUND = {
    "masked_mean": lambda x, c: jax.lax.psum(jnp.sum(x * mask(c)[:, None]) / c.sum(), "r"),
    "where_masked": lambda x, c: jax.lax.psum(jnp.where(mask(c)[:, None], x, 0).sum(0), "r"),
    "max_min_argmax": lambda x, c: jax.lax.psum(x.max() + x.min(0).sum() + x.argmax(0).sum(),
                                                "r"),
    "per_row_values": lambda x, c: jax.lax.psum(jnp.tanh(x @ jnp.ones((3, 2))), "r"),
    "forward_cumsum_rows": lambda x, c: jax.lax.psum(jnp.cumsum(x, 0), "r"),
    "masked_grad": lambda x, c: jax.lax.psum(jax.grad(
        lambda w: jnp.sum(jnp.where(mask(c), (x @ w) ** 2, 0)) / c.sum())(jnp.ones(3)), "r"),
    # What a loop the row counts stop carries depends on them: masked, like any dependency.
    "carry_of_a_loop_stopped_by_counts": lambda x, c: jax.lax.psum(jax.lax.while_loop(
        lambda a: a[1] < c[0], lambda a: (a[0] * 2, a[1] + 1), (x, 0))[0].mean(), "r"),
}


@pytest.mark.parametrize("name", sorted(NOT_FOUND))
def test_masked_or_harmless_reductions_are_not_found(name):
    assert found(NOT_FOUND[name], (4, 3), axes=(("r", 2), ("other", 2))) == []


# Not sums across replicas: only the returned value, which still counts the padding, is found.
NOT_SUMMED_ACROSS_REPLICAS = {
    "pmax": lambda x, c: jax.lax.pmax(jnp.mean(x), "r"),
    "no_collective": lambda x, c: jnp.mean(x),
    "other_axis": lambda x, c: jax.lax.psum(jnp.mean(x), "other"),
}


@pytest.mark.parametrize("name", sorted(NOT_SUMMED_ACROSS_REPLICAS))
def test_collectives_that_do_not_sum_across_replicas_are_not_found(name):
    findings = found(NOT_SUMMED_ACROSS_REPLICAS[name], (4, 3), axes=(("r", 2), ("other", 2)))
    assert [f.split(" at ")[0] for f in findings] == [RETURNED + "reduce_sum"]


def test_reduction_of_an_unpadded_input_is_not_found():
    jaxpr = jax.make_jaxpr(lambda x, y: jax.lax.psum(jnp.mean(y), "r"), axis_env=[("r", 2)])(
        jnp.ones((4, 3)), jnp.ones((4, 3))).jaxpr
    assert unmasked_row_reductions(jaxpr, {0: 0}, [], "r") == []
    assert len(unmasked_row_reductions(jaxpr, {1: 0}, [], "r")) == 1


def test_a_sum_over_rows_returned_by_the_step_is_found_once():
    # TF's counting idiom: sum in the step, strategy.reduce outside; padding would be counted.
    def step(x, c):
        mean = jnp.mean(x)
        gram = x.T @ x
        return mean, gram, jax.lax.psum(jnp.sum(x), "r")

    findings = found(step, (4, 3))
    assert [f.split(" at ")[0] for f in findings] == [
        "psum", RETURNED + "reduce_sum", RETURNED + "dot_general"]


def test_an_all_gather_of_a_padded_batchs_rows_is_found():
    assert [f.split(" at ")[0] for f in found(lambda x, c: jax.lax.all_gather(x.sum(1), "r"),
                                               (4, 3))] == [GATHERED + "all_gather"]
    # Masked rows (padding zeroed) and rows of unpadded inputs are fine.
    assert found(lambda x, c: jax.lax.all_gather(jnp.where(mask(c)[:, None], x, 0), "r"),
                 (4, 3)) == []


def test_returned_and_gathered_padding_warn_through_run(setup):
    s, batch = setup

    def count(x, y):
        return jnp.sum(y)

    (w,) = warnings_of(s, count, batch)
    assert str(w.message).startswith("run: a sum or mean over the rows of a padded batch is a "
                                     "result of the step")
    # What the warning is about: 3 real rows, summed with the padded copy.
    assert float(s.reduce("sum", s.run(count, args=batch), axis=None)) == 3.0 + 2.0

    def gathered(x, y):
        return ctx().all_gather(y, axis=0)

    (w,) = warnings_of(s, gathered, batch)
    assert "all_gather of a padded batch's rows gathers the padded rows too" in str(w.message)
    assert "strategy.gather" in str(w.message)
