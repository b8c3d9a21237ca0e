"""Clear errors and warnings for TF habits with flax NNX (issue 29).

A TF-style ``test_step`` reading a model with ``nnx.Dropout`` by closure gets jaxmirror's "pass
it as an argument" error, not flax's ``TraceContextError``; and the ``PaddedRowsWarning`` for a
hand-written ``jnp.mean`` loss over a padded batch names the user's ``jnp.mean`` line, not the
flax layer whose gradient sums the rows.
"""

import inspect
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import errors as flax_errors
from flax import nnx

import jaxmirror as jm
from conftest import strategy
from jaxmirror.step.analysis.padding_check import PaddedRowsWarning

X = np.arange(8.0, dtype=np.float32).reshape(4, 2)


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(2, 3, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.linear(x))


def _net():
    return _Net(nnx.Rngs(0, dropout=1))


def test_dropout_model_read_by_closure_says_to_pass_it_as_an_argument():
    s = strategy(2)
    model = s.init(_net)  # train mode: Dropout draws from its nnx.Rngs

    def test_step(x):  # TF's tutorial style: the model by closure
        return model(x).sum()

    with pytest.raises(ValueError, match=r"^run: .*reaches by closure; pass them as arguments.*"
                                         r"`model` \(_Net\).*model\.eval\(\)"
                                         r".*deterministic=True") as caught:
        s.run(test_step, args=(X,))
    assert isinstance(caught.value.__cause__, flax_errors.TraceContextError)
    assert "RngCount" in str(caught.value)  # what flax could not update


def test_dropout_model_passed_as_an_argument_matches_nnx_jit():
    s = strategy(1)  # one replica: the same random numbers as nnx.jit on one device
    model, reference = s.init(_net), _net()

    def step(model, x):
        return model(x)

    jitted = nnx.jit(step)
    for _ in range(2):  # the RNG count moves on between calls, as with nnx.jit
        got = np.asarray(s.run(step, args=(model, X)))
        want = np.asarray(jitted(reference, X))
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert (got == 0).any() and (got != 0).any()  # dropout was on
    counts = [[int(c) for c in jax.tree.leaves(nnx.state(m, nnx.RngCount))]
              for m in (model, reference)]
    assert counts[0] == counts[1] and 2 in counts[0]


def test_padded_rows_warning_names_the_users_mean_line():
    s = strategy(2)
    model = s.init(lambda: nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
    x, y = X[:3], np.ones((3, 1), np.float32)  # a partial batch: replica 1 gets a padded row
    batch = next(iter(s.experimental_distribute_dataset([(x, y)])))

    def step(model, x, y):
        def loss_fn(m):
            return jnp.mean((m(x) - y) ** 2)  # MEAN-LINE

        grads = nnx.grad(loss_fn)(model)
        return jm.get_replica_context().all_reduce("sum", grads)

    source, first = inspect.getsourcelines(step)
    line = first + next(i for i, text in enumerate(source) if "MEAN-LINE" in text)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s.run(step, args=(model, *batch))
    (w,) = [w for w in caught if issubclass(w.category, PaddedRowsWarning)]
    assert (w.filename, w.lineno) == (__file__, line)
    # The user's line first, then the flax layer whose bias gradient summed the rows.
    assert re.search(rf"of reduce_sum at test_clear_errors.py:{line} \([\w.<>]*loss_fn\) via "
                     r"linear.py:\d+ \(Linear.__call__\)\)", str(w.message))


def test_a_python_if_on_the_replica_id_says_what_to_use_instead():
    s = strategy(2)

    def step():
        if jm.get_replica_context().replica_id_in_sync_group == 0:  # TF 1's eager habit
            return 1.0
        return 0.0

    with pytest.raises(jax.errors.TracerBoolConversionError) as failure:
        s.run(step)
    note = "\n".join(failure.value.__notes__)
    assert "traced once for all replicas" in note and "jnp.where" in note
    ids = s.run(lambda: jnp.where(jm.get_replica_context().replica_id_in_sync_group == 0,
                                  1.0, 0.0))
    assert [float(x) for x in s.experimental_local_results(ids)] == [1.0, 0.0]


def test_distribute_values_from_function_inside_run_says_to_call_it_outside():
    s = strategy(2)

    def step():
        return s.experimental_distribute_values_from_function(lambda ctx: 1.0)

    with pytest.raises(RuntimeError, match=r"experimental_distribute_values_from_function: "
                       r"called inside `run`; .* call it outside and pass the result"):
        s.run(step)
    values = s.experimental_distribute_values_from_function(
        lambda ctx: float(ctx.replica_id_in_sync_group))
    doubled = s.run(lambda v: v * 2, args=(values,))
    assert [float(x) for x in s.experimental_local_results(doubled)] == [0.0, 2.0]
