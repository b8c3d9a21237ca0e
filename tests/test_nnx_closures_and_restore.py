"""TF habits with flax NNX that would fail silently: a step reading a model by closure (TF's
``test_step``), ``@jax.jit`` around a distributed step, and restoring a checkpoint into models."""

import functools
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmirror as jm
from conftest import strategy

X = np.ones((4, 2), np.float32)


def _model(s, seed=0):
    return s.init(lambda: nnx.Linear(2, 1, rngs=nnx.Rngs(seed)))


MODEL = None  # a module-level model, as a notebook's global


def _reads_global(x):
    return MODEL(x).sum()


def test_a_step_reading_a_model_by_closure_is_refused_before_it_runs():
    global MODEL
    s = strategy(2)
    MODEL = _model(s)
    local = MODEL

    def helper(x):
        return MODEL(x).sum()

    cases = {
        "MODEL": _reads_global,                               # a global of the step's module
        "local": lambda x: local(x).sum(),                    # a closure cell
        "self": MODEL.__call__,                               # a bound method
        "partial argument 0": functools.partial(lambda m, x: m(x).sum(), MODEL),
    }
    for name, fn in cases.items():
        with pytest.raises(ValueError, match=rf"reaches by closure.*`{name}` \(Linear\).*"
                                             r"Pass the object as an argument"):
            s.run(fn, args=(X,))
    with pytest.raises(ValueError, match="`MODEL`"):  # through a helper of the same module
        s.run(lambda x: helper(x), args=(X,))
    fused = s.function(lambda b: MODEL(b).sum(), steps_per_execution=2)
    with pytest.raises(ValueError, match="`MODEL`"):
        fused(iter(s.experimental_distribute_dataset([X, X])))


def test_the_same_steps_taking_the_model_as_an_argument_see_its_updates():
    s = strategy(2)
    model = _model(s)
    opt = s.init(lambda: nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param))

    @s.run
    def test_step(model, x):
        return model(x).sum()

    @s.run
    def train_step(model, opt, x):
        grads = nnx.grad(lambda m: m(x).sum())(model)
        opt.update(model, jm.get_replica_context().all_reduce("sum", grads))

    seen = []
    for _ in range(3):
        seen.append(float(s.reduce("mean", test_step(model, X), axis=None)))
        np.testing.assert_allclose(seen[-1], float(model(X).sum()), rtol=1e-6)
        train_step(model, opt, X)
    assert seen[0] > seen[1] > seen[2]  # the step saw every update
    # Reading only a static attribute by closure bakes no state: allowed.
    assert float(s.run(lambda x: jnp.sum(x) * model.in_features, args=(X,))) == 16.0


def test_jit_around_a_step_given_nnx_objects_says_to_call_it_directly():
    s = strategy(2)
    model = _model(s)
    before = np.asarray(model.kernel[...])
    step = s.function(lambda m, x: m(x))
    for outer in (jax.jit, nnx.jit):
        with pytest.raises(RuntimeError, match=r"inside jax.jit, nnx.jit.*call the step "
                                               r"directly"):
            outer(step)(model, X)
    np.testing.assert_array_equal(model.kernel[...], before)
    assert step(model, X) is not None  # called directly it runs

    @jax.jit  # TF's @tf.function around a distributed step that uses a global model
    def distributed_step(x):
        return s.reduce("sum", step(model, x), axis=None)
    with pytest.raises(RuntimeError, match="call the step directly"):
        distributed_step(X)
    np.testing.assert_array_equal(model.kernel[...], before)


def test_closure_reads_through_wrappers_objects_and_inner_jits_are_refused():
    s = strategy(2)
    model = _model(s)

    class Trainer:  # a plain object holding the model, its method as the step
        def __init__(self, model):
            self.model = model

        def step(self, x):
            return self.model(x).sum()

    jitted = jax.jit(lambda x: model(x).sum())  # the closure is read by an inner jit
    for fn, name in ((model, "the step itself"), (Trainer(model).step, "self.model"),
                     (lambda x: jitted(x), "model")):
        with pytest.raises(ValueError, match=f"`{name}` \\(Linear\\)"):
            s.run(fn, args=(X,))
    # A big or self-referencing container reached by the step is searched only so far.
    loop = [list(range(5000))]
    loop.append(loop)
    assert float(s.run(lambda x: jnp.sum(x) + len(loop), args=(X,))) == 10.0


def test_float_of_a_per_replica_value_says_what_to_do():
    s = strategy(2)
    v = s.experimental_distribute_values_from_function(lambda ctx: 1.0)
    with pytest.raises(TypeError, match=r"float\(strategy.reduce\('sum', v, axis=None\)\)"):
        float(v)


def test_restore_updates_nnx_objects_in_place_as_it_does_variables():
    s = strategy(2)

    def build(seed):
        model = _model(s, seed)
        return model, s.init(lambda: nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param))
    model, opt = build(0)
    path = os.path.join(tempfile.mkdtemp(), "ckpt")
    with s.scope():
        steps = jm.Variable(7)
    jm.checkpoint.save(path, {"model": model, "optimizer": opt, "steps": steps})
    other, other_opt = build(1)
    with s.scope():
        other_steps = jm.Variable(0)
    assert not np.array_equal(other.kernel[...], model.kernel[...])
    out = jm.checkpoint.restore(path, {"model": other, "optimizer": other_opt,
                                       "steps": other_steps})
    assert out["model"] is other and out["optimizer"] is other_opt and out["steps"] is other_steps
    np.testing.assert_array_equal(other.kernel[...], model.kernel[...])
    np.testing.assert_array_equal(other.bias[...], model.bias[...])
    assert int(other_steps.numpy()) == 7
    assert other.kernel[...].sharding.is_fully_replicated  # placed as the target was
    bare = nnx.Param(jnp.zeros(3))
    jm.checkpoint.save(path, {"p": nnx.Param(jnp.arange(3.0))}, force=True)
    assert jm.checkpoint.restore(path, {"p": bare})["p"] is bare
    assert bare[...].tolist() == [0.0, 1.0, 2.0]
