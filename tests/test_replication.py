"""Which results ``run`` returns as Mirrored (replicated) and which as PerReplica."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxmirror as jm
from conftest import mirrored


def rid():
    return jm.get_replica_context().replica_id_in_sync_group


def ctx():
    return jm.get_replica_context()


S = None


def kinds(fn, *args):
    global S
    S = S or mirrored(4)
    out = S.run(fn, args=args)
    return jax.tree.map(lambda x: "P" if isinstance(x, jm.PerReplica) else "M", out,
                        is_leaf=lambda x: isinstance(x, jm.PerReplica))


def varying_input():
    s = S or mirrored(4)
    return s.experimental_distribute_values_from_function(lambda c: np.float32(c.replica_id_in_sync_group))


def test_elementwise_follow_inputs():
    x = varying_input()
    assert kinds(lambda x, w: (x * w, w * 2, jnp.sin(w) + 1), x, jnp.float32(2)) == ("P", "M", "M")


@pytest.mark.parametrize("collective", [
    lambda v: lax.psum(v, "replica"), lambda v: lax.pmax(v, "replica"),
    lambda v: lax.pmin(v, "replica"), lambda v: ctx().all_reduce("mean", v),
    lambda v: ctx().all_gather(v[None], 0),
])
def test_replicating_collectives(collective):
    assert kinds(lambda x: collective(x), varying_input()) == "M"


@pytest.mark.parametrize("source", [
    lambda v: v + rid(),
    lambda v: lax.ppermute(v, "replica", [(i, (i + 1) % 4) for i in range(4)]),
    lambda v: lax.psum_scatter(jnp.broadcast_to(v, (4,)), "replica", tiled=True),
    lambda v: lax.all_to_all(jnp.broadcast_to(v, (4,)), "replica", 0, 0, tiled=True),
])
def test_varying_sources_even_from_replicated_inputs(source):
    assert kinds(source, jnp.float32(1)) == "P"


def test_nested_jit_is_followed():
    @jax.jit
    def inner(w, x):
        g = ctx().all_reduce("sum", x * w)
        return w - g, x * 2

    assert kinds(lambda w, x: inner(w, x), jnp.float32(1), varying_input()) == ("M", "P")


def test_custom_jvp_and_checkpoint_are_followed():
    f = jax.checkpoint(lambda w: jax.nn.relu(w) * 2)
    assert kinds(lambda w, x: (f(w), f(x)), jnp.ones(2), varying_input()) == ("M", "P")


def test_scan_carry_fixpoint():
    x = varying_input()

    def train(w, x):
        def body(w, _):
            return w - ctx().all_reduce("mean", w * x), None
        w2, _ = lax.scan(body, w, None, length=3)
        def body2(c, _):
            return c + x, c  # the carry becomes varying after one step
        c2, ys = lax.scan(body2, jnp.float32(0), None, length=2)
        return w2, c2, ys

    assert kinds(train, jnp.float32(1), x) == ("M", "P", "P")


def test_scan_with_axis_index_in_body_varies():
    def fn(w):
        out, _ = lax.scan(lambda c, _: (c + rid(), None), w, None, length=2)
        return out

    assert kinds(fn, jnp.float32(0)) == "P"


def test_cond_and_while():
    x = varying_input()

    def fn(w, x):
        same = lax.cond(w > 0, lambda: w, lambda: -w)
        differs = lax.cond(x > 1, lambda: w, lambda: -w)  # predicate varies
        loop_same = lax.while_loop(lambda c: c < 5, lambda c: c + 1, w)
        loop_diff = lax.while_loop(lambda c: c < x + 5, lambda c: c + 1, w)  # trip count varies
        return same, differs, loop_same, loop_diff

    assert kinds(fn, jnp.float32(1), x) == ("M", "P", "M", "P")


def test_rng_from_replicated_key_is_replicated_and_folded_key_varies():
    key = jax.random.key(0)

    def fn(key):
        same = jax.random.normal(key, (2,))
        differs = jax.random.normal(jax.random.fold_in(key, rid()), (2,))
        return same, differs

    out = kinds(fn, key)
    assert out == ("M", "P")


def test_train_step_kinds():
    x = varying_input()

    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jm.compute_average_loss((w * x)[None] ** 2))(w)
        g = ctx().all_reduce("sum", g)
        return w - 0.1 * g, loss, g, ctx().all_reduce("sum", loss)

    assert kinds(step, jnp.float32(1), x) == ("M", "P", "M", "M")
