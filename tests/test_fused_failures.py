"""A fused step (``steps_per_execution``) that fails loses no batch, and names a NaN's op."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import strategy

import jaxmirror

K = 5
BAD = 7.0  # the batch whose step fails, while `armed`
_armed = [False]


def _check(total):
    if _armed[0] and float(total) == 2 * BAD:
        raise RuntimeError("bad batch")
    return np.float32(total)


def _step_with(v):
    def step(batch):
        total = jaxmirror.get_replica_context().all_reduce("sum", batch[0])
        checked = jax.pure_callback(_check, jax.ShapeDtypeStruct((), jnp.float32), total)
        v.assign(v.read_value() * 0.5 + checked)
        return v.read_value()
    return step


def _data(n):
    return [np.full(4, float(i), np.float32) for i in range(n)]


def _single_steps(s, v, batches):
    """Each batch's result through single steps, from v = 0."""
    v.assign(0.0)
    single = s.function(_step_with(v))
    return [float(single(b)) for b in iter(s.experimental_distribute_dataset(batches))]


def _fused_results(out):
    return [float(x) for x in np.asarray(out)]


@pytest.mark.parametrize("thread", [False, True])
def test_failed_fused_call_gives_its_batches_back_and_a_retry_matches_single_steps(thread):
    s = strategy(2)
    with s.scope():
        v = jaxmirror.Variable(0.0)
    data = _data(8)  # windows 0-4 and 5-7 (a partial last one), batch 7 its 3rd step
    want = _single_steps(s, v, data)
    v.assign(0.0)
    fused = s.function(_step_with(v), steps_per_execution=K)
    ds = s.experimental_distribute_dataset(data, options=jaxmirror.InputOptions(
        prefetch_thread=thread))
    it = iter(ds)
    got = _fused_results(fused(it))
    _armed[0] = True
    try:
        with pytest.raises(Exception, match="bad batch") as failure:
            fused(it)
    finally:
        _armed[0] = False
    assert "3 elements" in "\n".join(getattr(failure.value, "__notes__", []))
    assert float(v.numpy()) == want[4]  # the failed window changed nothing
    assert int(it.checkpoint_state()[1]) == 5 and int(ds.checkpoint_state()[1]) == 5
    got += _fused_results(fused(it))  # the retry: the same 3 batches
    assert got == want
    assert float(v.numpy()) == want[-1]
    assert int(it.checkpoint_state()[1]) == 8
    with pytest.raises(StopIteration):
        fused(it)


def test_skipping_a_failed_window_continues_with_the_following_batches():
    s = strategy(2)
    with s.scope():
        v = jaxmirror.Variable(0.0)
    data = _data(15)  # the failing window, 5-9, is dropped
    want = _single_steps(s, v, data[:5] + data[10:])
    v.assign(0.0)
    fused = s.function(_step_with(v), steps_per_execution=K)
    it = iter(s.experimental_distribute_dataset(data))
    got = _fused_results(fused(it))
    _armed[0] = True
    try:
        with pytest.raises(Exception, match="bad batch"):
            fused(it)
    finally:
        _armed[0] = False
    skipped = [float(s.experimental_local_results(next(it))[0][0]) for _ in range(K)]
    assert skipped == [5.0, 6.0, 7.0, 8.0, 9.0]
    got += _fused_results(fused(it))
    assert got == want and float(v.numpy()) == want[-1]


def test_a_plain_iterator_hands_back_the_elements_a_failed_call_did_not_apply():
    s = strategy(2)
    with s.scope():
        v = jaxmirror.Variable(0.0)
    fused = s.function(_step_with(v), steps_per_execution=3)
    elements = list(iter(s.experimental_distribute_dataset(_data(9)[6:])))
    _armed[0] = True
    try:
        with pytest.raises(Exception, match="bad batch") as failure:
            fused(iter(elements))
    finally:
        _armed[0] = False
    assert failure.value.unapplied_elements == elements
    assert float(v.numpy()) == 0.0


def test_a_fused_steps_nan_error_names_the_op_as_a_single_step_does():
    s = strategy(2)

    def step(batch):
        return jnp.log(-batch[0])

    data = [np.full(4, -1.0, np.float32), np.full(4, 1.0, np.float32)]
    fused, single = s.function(step, steps_per_execution=2), s.function(step)
    it = iter(s.experimental_distribute_dataset(data))
    errors = []
    jax.config.update("jax_debug_nans", True)  # JAX checks a program's first call
    try:
        with pytest.raises(FloatingPointError) as failure:
            fused(it)
        errors.append(failure.value)
        with pytest.raises(FloatingPointError) as failure:
            single(next(iter(s.experimental_distribute_dataset(data[1:]))))
        errors.append(failure.value)
    finally:
        jax.config.update("jax_debug_nans", False)
    assert str(errors[0]) == str(errors[1]) == "invalid value (nan) encountered in log"
    # The step before ran as a single step would; the NaN's batch is back in the iterator.
    assert int(it.checkpoint_state()[1]) == 1
    assert s.experimental_local_results(next(it))[0].tolist() == [1.0, 1.0]


def test_nnx_objects_of_a_failed_fused_call_keep_their_state_and_the_retry_continues():
    from flax import nnx

    s = strategy(2)

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros(()))

    def step(batch, model):
        total = jaxmirror.get_replica_context().all_reduce("sum", batch[0])
        model.w[...] = model.w[...] + jax.pure_callback(
            _check, jax.ShapeDtypeStruct((), jnp.float32), total)
        return model.w[...]

    model = Model()
    fused = s.function(step, steps_per_execution=3)
    it = iter(s.experimental_distribute_dataset(_data(9)))
    assert np.asarray(fused(it, model)).tolist() == [0.0, 2.0, 6.0]
    _armed[0] = True  # batch 7: the 2nd step of the window 6-8
    try:
        assert np.asarray(fused(it, model)).tolist() == [12.0, 20.0, 30.0]
        with pytest.raises(Exception, match="bad batch"):
            fused(it, model)
    finally:
        _armed[0] = False
    assert float(model.w[...]) == 30.0
    assert np.asarray(fused(it, model)).tolist() == [42.0, 56.0, 72.0]


def _carry_step(batch, params):
    total = jaxmirror.get_replica_context().all_reduce("sum", batch[0])
    checked = jax.pure_callback(_check, jax.ShapeDtypeStruct((), jnp.float32), total)
    return {"w": params["w"] + checked}, checked


def test_a_donating_fused_call_that_fails_raises_its_own_error_and_says_what_it_used_up():
    s = strategy(2)
    fused = s.function(_carry_step, steps_per_execution=3, carry_argnums=(1,),
                       donate_argnums=(1,))
    it = iter(s.experimental_distribute_dataset(_data(9)[6:]))
    params = s.experimental_replicate({"w": np.zeros((), np.float32)})
    _armed[0] = True
    try:
        with pytest.raises(Exception, match="bad batch") as failure:  # not "donated earlier"
            fused(it, params)
    finally:
        _armed[0] = False
    note = "\n".join(failure.value.__notes__)
    assert "donate_argnums=(1,)" in note and "used up" in note and "3 elements" in note
    assert int(it.checkpoint_state()[1]) == 0  # the batches are back
    fresh = s.experimental_replicate({"w": np.zeros((), np.float32)})
    out, totals = fused(it, fresh)  # a retry from a copy made before the call
    assert float(out["w"]) == 2 * (6.0 + 7.0 + 8.0)


def test_steps_applied_before_a_nan_give_their_carried_results_on_the_error():
    s = strategy(2)

    def step(batch, params):
        total = jaxmirror.get_replica_context().all_reduce("sum", batch[0])
        return {"w": params["w"] + jnp.log(total)}, total

    fused = s.function(step, steps_per_execution=4, carry_argnums=(1,))
    half_e = np.float32(np.e / 2)
    it = iter(s.experimental_distribute_dataset(
        [np.full(4, half_e, np.float32)] * 2 + [np.full(4, -1.0, np.float32)] * 2))
    params = s.experimental_replicate({"w": np.zeros((), np.float32)})
    jax.config.update("jax_debug_nans", True)
    try:
        with pytest.raises(FloatingPointError, match="log") as failure:
            fused(it, params)
    finally:
        jax.config.update("jax_debug_nans", False)
    applied, totals = failure.value.applied_results
    assert float(applied["w"]) == pytest.approx(2.0, rel=1e-6)  # two steps of log(e)
    assert np.asarray(totals).tolist() == [2 * half_e] * 2
    assert "2 of its steps were applied" in "\n".join(failure.value.__notes__)
    assert int(it.checkpoint_state()[1]) == 2 and float(params["w"]) == 0.0


def test_programs_of_a_call_that_ran_before_the_failed_one_give_their_results():
    s = strategy(2)
    fused = s.function(_carry_step, steps_per_execution=4, carry_argnums=(1,))
    # Three batches of 4 rows, then one of 6 (BAD): two programs in one call, the 2nd fails.
    elements = list(iter(s.experimental_distribute_dataset(
        [np.full(4, 1.0, np.float32)] * 3 + [np.full(6, BAD, np.float32)])))
    params = s.experimental_replicate({"w": np.zeros((), np.float32)})
    _armed[0] = True
    try:
        with pytest.raises(Exception, match="bad batch") as failure:
            fused(iter(elements), params)
    finally:
        _armed[0] = False
    applied, totals = failure.value.applied_results
    assert float(applied["w"]) == 6.0 and np.asarray(totals).tolist() == [2.0] * 3
    assert failure.value.unapplied_elements == elements[3:]


def test_a_caught_failure_is_not_raised_again_by_effects_barrier():
    s = strategy(2)
    fused = s.function(_carry_step, steps_per_execution=2, carry_argnums=(1,))
    it = iter(s.experimental_distribute_dataset(_data(8)[6:]))
    params = s.experimental_replicate({"w": np.zeros((), np.float32)})
    _armed[0] = True
    try:
        with pytest.raises(Exception, match="bad batch"):
            fused(it, params)
    finally:
        _armed[0] = False
    jax.effects_barrier()  # would raise the failed step's error again
    assert float(fused(it, params)[0]["w"]) == 2 * (6.0 + 7.0)


def test_after_a_failed_call_initialize_starts_over_and_a_good_call_keeps_nothing_back():
    s = strategy(2)
    with s.scope():
        v = jaxmirror.Variable(0.0)
    fused = s.function(_step_with(v), steps_per_execution=2)
    it = s.make_dataset_iterator(_data(10)[5:])  # 5, 6, 7 (BAD), 8, 9
    fused(it)
    it.put_back(1)  # the call succeeded: nothing of it can come back
    assert s.experimental_local_results(next(it))[0].tolist() == [7.0, 7.0]
    it.initialize()
    _armed[0] = True
    try:
        with pytest.raises(Exception, match="bad batch"):
            fused(it)  # 5 and 6
            fused(it)  # 7 fails
    finally:
        _armed[0] = False
    it.initialize()  # TF: the iterator starts over
    assert s.experimental_local_results(next(it))[0].tolist() == [5.0, 5.0]
    assert int(it.checkpoint_state()[1]) == 1
