"""Deleted (donated) arrays given to a step: a named error, never a crash; donating a copy.

JAX 0.10 kills the process (SIGSEGV) when an array whose buffers an earlier call donated
reaches a compiled program over several devices that already ran. Before the guard, these
tests crashed the whole pytest process (rc 139); now each raises an error naming the
argument's path, and the arrays that are still alive keep working.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmirror as jm
from conftest import strategy

DELETED = "holds arrays an earlier call donated or deleted"


def _plus_one(p):
    return jax.tree.map(lambda v: v + 1, p)


def _params(s, **values):
    return s.experimental_replicate({k: np.full(3, v, np.float32) for k, v in values.items()})


def test_a_donated_leaf_after_a_live_one_is_named_not_a_crash():
    s = strategy(2)
    step = s.function(_plus_one, donate_argnums=(0,))
    params = _params(s, a=0.0, w=10.0)
    new = step(params)  # compiled for this structure; params' arrays donated
    stale = {"a": new["a"], "w": params["w"]}  # first leaf alive, the second donated
    with pytest.raises(ValueError, match=r"_plus_one: argument 0 " + DELETED
                       + r": args\[0\]\['w'\] is deleted; pass that call's results"):
        step(stale)
    assert not new["a"].is_deleted()  # nothing ran: the live leaf was not donated
    assert step(new)["w"].tolist() == [12.0] * 3


def test_a_non_donating_step_given_a_donated_array_names_it():
    s = strategy(2)

    def plain(p, scale):
        return jax.tree.map(lambda v: v * scale, p)

    donating = s.function(_plus_one, donate_argnums=(0,))
    params = {"layers": [_params(s, bias=1.0), _params(s, bias=2.0)]}
    assert s.run(plain, args=(params, 2.0))["layers"][1]["bias"].tolist() == [4.0] * 3
    new = donating(params)
    with pytest.raises(ValueError, match=r"plain: argument 0 " + DELETED
                       + r": args\[0\]\['layers'\]\[0\]\['bias'\] is deleted"):
        s.run(plain, args=(params, 2.0))  # the same signature: JAX's cached program
    assert s.run(plain, args=(new, 2.0))["layers"][1]["bias"].tolist() == [6.0] * 3


def test_run_with_donating_options_and_keyword_arguments_names_the_keyword():
    s = strategy(2)

    def fn(x, p):
        return jax.tree.map(lambda v: v + x, p)

    options = jm.RunOptions(donate_argnums=(1,))
    p = _params(s, b=0.0, w=1.0)
    out = s.run(fn, args=(1.0, p), options=options)
    assert p["w"].is_deleted() and out["w"].tolist() == [2.0] * 3
    with pytest.raises(ValueError, match=r"fn: argument 1 " + DELETED + r": args\[1\]\['b'\]"):
        s.run(fn, args=(1.0, p), options=options)
    with pytest.raises(ValueError, match=r"fn: argument 'p' " + DELETED
                       + r": kwargs\['p'\]\['b'\] is deleted"):
        s.run(fn, args=(1.0,), kwargs={"p": p})
    assert s.run(fn, args=(1.0,), kwargs={"p": out})["b"].tolist() == [2.0] * 3


def test_an_array_deleted_by_hand_is_named_too():
    s = strategy(2)
    x = s.experimental_replicate(np.arange(3, dtype=np.float32))
    y = s.experimental_replicate(np.ones(3, np.float32))
    step = s.function(lambda a, b: a + b)
    assert step(x, y).tolist() == [1.0, 2.0, 3.0]
    y.delete()
    with pytest.raises(ValueError, match=r"<lambda>: argument 1 " + DELETED + r": args\[1\] "):
        step(x, y)


def test_nnx_state_restored_after_a_donating_step_is_named_by_its_attribute():
    s = strategy(2)
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    s.experimental_replicate(model)
    old_kernel = model.kernel[...]
    step = s.function(lambda m, x: m(x).sum(), donate_argnums=(0,))
    x = jnp.ones((1, 2))
    expected = float(model(x).sum())
    assert float(step(model, x)) == pytest.approx(expected)
    assert old_kernel.is_deleted()  # donated: the model holds the step's new arrays
    model.kernel[...] = old_kernel  # a notebook restoring the array it kept
    with pytest.raises(ValueError, match=r"<lambda>: argument 0 " + DELETED
                       + r": args\[0\]\.kernel\.value is deleted"):
        step(model, x)


def test_a_fused_step_given_donated_params_raises_not_crashes():
    s = strategy(2)

    def train(batch, params):
        return _plus_one(params), batch.sum()

    steps = s.function(train, steps_per_execution=2, carry_argnums=(1,), donate_argnums=(1,))
    data = s.experimental_distribute_dataset(
        [np.ones(4, np.float32) * i for i in range(6)])
    it = iter(data)
    params = _params(s, w=0.0)
    new, losses = steps(it, params)
    assert new["w"].tolist() == [2.0] * 3
    assert s.reduce("SUM", losses, axis=None).tolist() == [0.0, 4.0]
    with pytest.raises(ValueError, match=r"train: argument 1 " + DELETED
                       + r": args\[1\]\['w'\] is deleted"):
        steps(it, params)
    assert steps(it, new)[0]["w"].tolist() == [4.0] * 3


def test_donating_an_array_put_on_one_device_leaves_the_original_alive():
    s = strategy(2)
    x = jax.device_put(jnp.arange(3.0), jax.devices()[0])
    step = s.function(lambda p: p["x"] * 2, donate_argnums=(0,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = step({"x": x})
    assert any("were mirrored onto its devices" in str(w.message) for w in caught)
    assert out.tolist() == [0.0, 2.0, 4.0]
    assert not x.is_deleted() and x.tolist() == [0.0, 1.0, 2.0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert step({"x": x}).tolist() == [0.0, 2.0, 4.0]  # again: the original still there
    assert not x.is_deleted() and x.tolist() == [0.0, 1.0, 2.0]


def test_a_donating_step_inside_jax_jit_still_computes():
    s = strategy(2)
    step = s.function(lambda p: jax.tree.map(lambda v: v * v, p), donate_argnums=(0,))
    params = _params(s, w=3.0)
    assert jax.jit(lambda p: step(p))(params)["w"].tolist() == [9.0] * 3
    assert not params["w"].is_deleted()  # an outer jit's call donates nothing
    assert step(params)["w"].tolist() == [9.0] * 3 and params["w"].is_deleted()


@pytest.mark.parametrize("donated", [(0, 1), (0,)])
def test_an_array_given_twice_to_a_donating_step_is_named_not_a_crash(donated):
    s = strategy(2)  # JAX: "Attempt to donate the same buffer twice", then SIGSEGV
    step = s.function(lambda params, ema: (_plus_one(params), ema), donate_argnums=donated)
    params = _params(s, w=1.0)
    with pytest.raises(ValueError, match=r"args\[0\]\['w'\] and args\[1\]\['w'\] are the "
                       r"same array, and argument.* donated; .*jnp.copy"):
        step(params, params)  # TF's EMA habit: ema = params
    assert params["w"].tolist() == [1.0] * 3  # refused before anything ran
    new, ema = step(params, jax.tree.map(jnp.copy, params))
    assert new["w"].tolist() == [2.0] * 3 and ema["w"].tolist() == [1.0] * 3
    same = s.experimental_replicate(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"kwargs\['ema'\]"):
        s.function(lambda params, ema: params, donate_argnums=(0,))(same, ema=same)

