"""``jax_debug_nans``/``jax_debug_infs`` check every call of a step, not only its first."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import strategy

import jaxmirror


@pytest.mark.parametrize("flag,make,message", [
    ("jax_debug_nans", jnp.log, "invalid value (nan) encountered in log"),
    ("jax_debug_infs", lambda t: 1.0 / (t + 2.0), "invalid value (inf) encountered in div"),
])
def test_a_nan_after_a_good_call_raises_naming_the_op_and_writes_nothing(flag, make, message):
    s = strategy(2)
    with s.scope():
        v = jaxmirror.Variable(1.0)

    @s.function
    def step(x):
        total = jaxmirror.get_replica_context().all_reduce("sum", x)
        v.assign(v * make(total))
        return make(total)

    good = float(make(jnp.float32(8.0)))  # 2 replicas x 4.0
    jax.config.update(flag, True)
    try:
        assert float(step(jnp.float32(4.0))) == pytest.approx(good)  # the compiling call
        for _ in range(2):  # JAX's cached calls after it: each one checked
            with pytest.raises(FloatingPointError) as failure:
                step(jnp.float32(-1.0))  # log(-2), 1 / 0
            assert str(failure.value) == message
            assert float(v.numpy()) == pytest.approx(good)  # the failed call's write undone
    finally:
        jax.config.update(flag, False)
    assert float(step(jnp.float32(4.0))) == pytest.approx(good)
    assert float(v.numpy()) == pytest.approx(good * good)


def test_a_fused_steps_nan_after_a_good_call_raises_and_keeps_the_steps_before():
    s = strategy(2)
    with s.scope():
        v = jaxmirror.Variable(0.0)

    def step(batch):
        total = jaxmirror.get_replica_context().all_reduce("sum", batch[0])
        v.assign(v + jnp.log(total))
        return total

    fused = s.function(step, steps_per_execution=2)
    data = [np.full(4, x, np.float32) for x in (1.0, 2.0, 3.0, -1.0)]
    it = iter(s.experimental_distribute_dataset(data))
    jax.config.update("jax_debug_nans", True)
    try:
        fused(it)  # the compiling call: steps on 2 and 4
        with pytest.raises(FloatingPointError) as failure:
            fused(it)  # the step on 6 is applied, the one on -2 is not
    finally:
        jax.config.update("jax_debug_nans", False)
    assert str(failure.value) == "invalid value (nan) encountered in log"
    assert float(v.numpy()) == pytest.approx(float(np.log(2.0 * 4.0 * 6.0)), rel=1e-6)
    assert s.experimental_local_results(next(it))[0].tolist() == [-1.0, -1.0]
