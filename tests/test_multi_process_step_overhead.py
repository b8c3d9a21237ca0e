"""The step call's per-call work (issue 32): ``strategy.reduce`` of a step's small result returns
the sum the step made with it, already counted against the in-flight bound with the step (not
again), with the same values as reducing the components; across processes too."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np

import jaxmirror as jm
from conftest import mirrored
from jaxmirror.core import inflight

LR = 0.1


def _train(s, steps, older=False):
    """A small SGD loop in TF's style (``@s.run``, all-reduced grads); the reduced losses, and
    the in-flight queue's length after each step's call and after its reduce."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * s.num_replicas_in_sync, 3)).astype(np.float32)
    batches = iter(s.experimental_distribute_dataset(lambda: iter([(x, x.sum(1))] * steps)))
    params = s.experimental_replicate({"w": np.ones(3, np.float32) / 3})

    @s.run
    def step(p, xb, yb):
        def loss_fn(p):
            return jm.compute_average_loss((xb @ p["w"] - yb) ** 2, global_batch_size=len(x))

        loss, grads = jax.value_and_grad(loss_fn)(p)
        grads = jm.get_replica_context().all_reduce("SUM", grads)
        return jax.tree.map(lambda a, g: a - LR * g, p, grads), loss

    losses, lengths, previous = [], [], None
    for xb, yb in batches:
        params, loss = step(params, xb, yb)
        after_step = len(inflight.queued())
        which = previous if older and previous is not None else loss
        losses.append(s.reduce("SUM", which, axis=None))
        lengths.append((after_step, len(inflight.queued())))
        previous = loss
    return losses, lengths, step


def test_reduce_of_the_last_steps_loss_is_not_counted_twice_and_gives_the_same_values():
    inflight.drain()
    s = mirrored(4)
    losses, lengths, _ = _train(s, 3 * inflight.MAX_IN_FLIGHT)
    # Each step adds one entry; its reduce (the sum made in the step) adds none.
    assert all(a == b for a, b in lengths), lengths
    assert [a for a, _ in lengths[:inflight.MAX_IN_FLIGHT]] == list(
        range(1, inflight.MAX_IN_FLIGHT + 1))
    assert all(a <= inflight.MAX_IN_FLIGHT for a, _ in lengths)
    # Counted once or twice, the values are the same: a second run's, bit for bit.
    inflight.drain()
    again, _, _ = _train(s, 3 * inflight.MAX_IN_FLIGHT)
    assert [float(v) for v in losses] == [float(v) for v in again]


def test_reduce_of_an_older_steps_loss_is_counted_and_bounded():
    inflight.drain()
    s = mirrored(4)
    losses, lengths, _ = _train(s, 3 * inflight.MAX_IN_FLIGHT, older=True)
    # Not the last step's own sum: counted as before (the bound is kept either way).
    assert lengths[0] == (1, 1) and lengths[1] == (2, 3), lengths[:2]
    assert all(b <= inflight.MAX_IN_FLIGHT for _, b in lengths), lengths
    assert len(losses) == 3 * inflight.MAX_IN_FLIGHT


def test_reduced_sum_equals_the_sum_of_the_local_results():
    inflight.drain()
    s = mirrored(4)
    v = s.experimental_distribute_values_from_function(
        lambda c: jnp.float32(c.replica_id_in_sync_group) / 3)
    step = s.run(lambda a: a * 2.0)  # a step returning a small per-replica result
    out = step(v)
    fast = s.reduce("SUM", out, axis=None)  # the sum made in the step
    slow = sum(np.asarray(c) for c in s.experimental_local_results(out))
    assert np.allclose(float(fast), float(slow), rtol=1e-6)
    assert float(s.reduce("MEAN", out, axis=None)) == float(fast) / 4


def test_across_two_processes_each_step_is_counted_once_and_losses_agree():
    # Shipped by value (cloudpickle): the workers do not import this module (nor conftest).
    train_source = _TRAIN_SOURCE

    def worker():
        from jaxmirror.core import inflight as flight

        s = jm.MultiWorkerMirroredStrategy()
        scope = {"jax": __import__("jax"), "np": __import__("numpy"), "jm": jm,
                 "inflight": flight, "LR": 0.1}
        exec(train_source, scope)  # noqa: S102 - this module's own _train
        flight.drain()
        losses, lengths, _ = scope["_train"](s, 2 * flight.MAX_IN_FLIGHT)
        flight.drain()
        older, older_lengths, _ = scope["_train"](s, 2 * flight.MAX_IN_FLIGHT, older=True)
        return ([float(v) for v in losses], lengths, [float(v) for v in older], older_lengths,
                flight.MAX_IN_FLIGHT)

    results = jm.launch.run(worker, workers=2, devices_per_worker=2, timeout=300)
    (values, lengths, older, older_lengths, bound), other = results[0], results[1]
    assert other[0] == values  # the same all-reduced sums on both workers, bit for bit
    assert all(a == b <= bound for a, b in lengths), lengths
    assert all(b <= bound for _, b in older_lengths), older_lengths
    # The older step's loss reduced: the same values one step later.
    assert older[1:] == values[:len(older) - 1]


_TRAIN_SOURCE = inspect.getsource(_train)
