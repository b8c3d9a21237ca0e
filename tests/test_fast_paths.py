"""The loop's fast paths give the slow paths' results, bit for bit.

* ``strategy.reduce(op, out, axis=None)`` of a step's small per-replica result is answered from
  reductions the step's own program computed (no program of its own), equal to the reduction
  of the same components done apart;
* fused steps (``strategy.function(fn, steps_per_execution=K)``) give K single steps' results
  and leave the variables as K single steps do, also over padded, partial batches.
"""

import itertools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmirror as jm
from jaxmirror.collectives.cross_device_ops import CrossDeviceOps
from jaxmirror.core.values import attached_sum

from conftest import local


def _devices(n):
    return [f"CPU:{i}" for i in range(n)]


def _bits(x):
    return np.atleast_1d(np.asarray(x)).view(np.uint8).tolist()


def _results(s):
    """A step returning small per-replica values of several dtypes and shapes, and a nest."""

    @s.function
    def step(x):
        i = jm.get_replica_context().replica_id_in_sync_group
        return {"loss": jnp.sum(x * 1.1) / 7.0 + i,
                "vec": x[:3] * (1.3 + i),
                "half": (x[:2] * (3 + i)).astype(jnp.bfloat16),
                "f16": (x[:2] / (3 + i)).astype(jnp.float16)}

    x = s.experimental_distribute_values_from_function(
        lambda ctx: jnp.arange(5.0) + ctx.replica_id_in_sync_group * 0.37)
    return step(x)


@pytest.fixture
def no_reduce_program(monkeypatch):
    """Counts the eager reduction programs run (``CrossDeviceOps.sum_components``)."""
    calls = []
    original = CrossDeviceOps.sum_components

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CrossDeviceOps, "sum_components", counting)
    return calls


# -- reduce of a step's results ----------------------------------------------------------------
OPS = {
    "default": lambda: None,
    "packed": lambda: jm.NcclAllReduce(num_packs=1),
    "hierarchical": lambda: jm.HierarchicalCopyAllReduce(),
    "one_device": lambda: jm.ReductionToOneDevice(),
    "tenfold": lambda: jm.ReductionToOneDevice(accumulation_fn=lambda v: sum(v) * 10),
}


@pytest.mark.parametrize("n,ops", [(n, ops) for n in (2, 3, 4, 8) for ops in sorted(OPS)])
def test_reduce_of_a_step_result_equals_the_reduction_done_apart(n, ops, no_reduce_program):
    s = jm.MirroredStrategy(_devices(n), cross_device_ops=OPS[ops]())
    out = _results(s)
    for op in ("SUM", "MEAN"):
        fast = s.reduce(op, out, axis=None)
        assert not no_reduce_program, "reduce of a step's results ran a program of its own"
        for key, value in out.items():
            apart = s.reduce(op, jm.PerReplica(value.stacked), axis=None)  # no reductions
            assert fast[key].dtype == apart.dtype, (key, op)
            assert _bits(fast[key]) == _bits(apart), (key, op, fast[key], apart)
            assert _bits(s.reduce(op, value, axis=None)) == _bits(apart)
        no_reduce_program.clear()
    comps = local(s, out["loss"])
    expected = np.sum(comps, 0, dtype=np.float32) * (10 if ops == "tenfold" else 1)
    np.testing.assert_allclose(np.asarray(s.reduce("SUM", out["loss"], axis=None)), expected,
                               rtol=1e-6)


def test_reduce_with_a_narrow_wire_matches_the_reduction_done_apart(no_reduce_program):
    options = jm.experimental.CommunicationOptions(wire_dtype=jnp.bfloat16)
    s = jm.MultiWorkerMirroredStrategy(communication_options=options)  # no cluster: 8 local
    out = _results(s)
    for op in ("SUM", "MEAN"):
        for key, value in out.items():
            apart = s.reduce(op, jm.PerReplica(value.stacked), axis=None)
            no_reduce_program.clear()
            assert _bits(s.reduce(op, value, axis=None)) == _bits(apart), (key, op)
            # A MEAN over a narrow wire divides before it sums: the step's sum cannot serve.
            assert bool(no_reduce_program) == (op == "MEAN")


def test_only_the_same_strategy_without_options_or_axis_uses_the_steps_reductions(
        no_reduce_program):
    s = jm.MirroredStrategy(_devices(2))
    other = jm.MirroredStrategy(_devices(2), cross_device_ops=OPS["tenfold"]())
    loss = _results(s)["loss"]
    assert attached_sum(loss, s.extended) is not None
    assert attached_sum(loss, other.extended) is None
    # Another strategy reduces with its own ops (10x), by a program of its own.
    np.testing.assert_allclose(float(other.reduce("SUM", loss, axis=None)),
                               10 * float(s.reduce("SUM", loss, axis=None)), rtol=1e-6)
    assert no_reduce_program
    no_reduce_program.clear()
    # With an axis or explicit options, or after a tree map, the reduction is done apart.
    options = jm.experimental.CommunicationOptions()
    assert _bits(s.extended.reduce_to("SUM", loss, "CPU:0", options=options)) == _bits(
        s.reduce("SUM", loss, axis=None))
    vec = _results(s)["vec"]
    no_reduce_program.clear()
    np.testing.assert_allclose(np.asarray(s.reduce("SUM", vec, axis=0)),
                               np.sum(local(s, vec)), rtol=1e-6)
    assert no_reduce_program
    squared = jax.tree.map(lambda x: x ** 2, vec)  # a new value: its own reduction
    np.testing.assert_allclose(np.asarray(s.reduce("SUM", squared, axis=None)),
                               np.sum(np.square(local(s, vec)), 0), rtol=1e-6)


def test_large_integer_and_batch_results_are_not_reduced_in_the_step(no_reduce_program):
    s = jm.MirroredStrategy(_devices(2))

    @s.function
    def step(x):
        i = jm.get_replica_context().replica_id_in_sync_group
        return jnp.ones(2048) * i, jnp.arange(3) + i, x * 2

    batch = next(iter(s.experimental_distribute_dataset([np.arange(6.0)])))
    big, ints, rows = step(batch)
    for value in (big, ints, rows):
        assert attached_sum(value, s.extended) is None
    assert float(s.reduce("SUM", big, axis=None)[0]) == 1.0
    assert s.reduce("SUM", ints, axis=None).tolist() == [1, 3, 5]
    assert s.reduce("SUM", rows, axis=None).tolist() == [6.0, 10.0, 14.0]
    hlo = step.lower(batch).compile().as_text()
    assert "f32[2048]" not in "".join(l for l in hlo.splitlines() if "all-reduce" in l)


def test_a_steps_results_are_unchanged_by_the_reductions_made_with_them():
    s = jm.MirroredStrategy(_devices(4))
    out = _results(s)
    want = [(np.arange(3.0) + 0.37 * i) * (1.3 + i) for i in range(4)]
    np.testing.assert_allclose(local(s, out["vec"]), want, rtol=1e-6)
    assert out["half"].stacked.dtype == jnp.bfloat16 and out["vec"].row_counts is None


# -- fused steps ---------------------------------------------------------------------------------
def _training(s, sizes=(5, 8, 3), lr=0.1):
    """Variables of a small linear model and a TF-style step on an (x, y) element."""
    rng = np.random.default_rng(0)
    with s.scope():
        w = jm.Variable(rng.standard_normal(sizes[:2]).astype(np.float32), name="w")
        b = jm.Variable(np.zeros(sizes[1], np.float32), name="b")
        seen = jm.Variable(0.0, name="seen")

    def step(element):
        x, y = element
        ctx = jm.get_replica_context()

        def loss_fn(w_, b_):
            logits = x @ w_ + b_
            per_row = (logits - y) ** 2
            return jm.compute_average_loss(per_row.sum(-1), global_batch_size=12)

        loss, (gw, gb) = jax.value_and_grad(loss_fn, argnums=(0, 1))(w.read_value(),
                                                                      b.read_value())
        gw, gb = ctx.all_reduce("SUM", (gw, gb))
        w.assign_sub(lr * gw)
        b.assign_sub(lr * gb)
        mask = ctx.batch_mask  # None: nothing padded (one replica, or whole host arrays)
        real = jnp.int32(x.shape[0]) if mask is None else mask.sum()
        seen.assign_add(ctx.all_reduce("SUM", real.astype(jnp.float32)))
        return loss, real

    return (w, b, seen), step


def _data(rows=(12, 12, 12, 12, 12, 12, 7)):
    rng = np.random.default_rng(1)
    return [(rng.standard_normal((r, 5)).astype(np.float32),
             rng.standard_normal((r, 8)).astype(np.float32)) for r in rows]


def _single_run(n, data, **options):
    s = jm.MirroredStrategy(_devices(n))
    variables, fn = _training(s)
    step = s.function(fn)
    dist = s.experimental_distribute_dataset(
        data, options=jm.InputOptions(**options) if options else None)
    losses, masks = [], []
    for element in dist:
        loss, mask = step(element)
        losses.append(np.asarray(s.reduce("SUM", loss, axis=None)))
        masks.append([int(m) for m in s.experimental_local_results(mask)])
    return losses, masks, [np.asarray(v.numpy()) for v in variables]


@pytest.mark.parametrize("n,k", [(2, 3), (3, 4), (4, 7), (8, 2)])
def test_fused_steps_equal_single_steps_over_a_partial_last_batch(n, k):
    data = _data()
    losses, masks, final = _single_run(n, data)
    s = jm.MirroredStrategy(_devices(n))
    variables, fn = _training(s)
    steps = s.function(fn, steps_per_execution=k)
    it = iter(s.experimental_distribute_dataset(data))
    fused_losses, fused_masks, calls = [], [], 0
    while True:
        try:
            loss, mask = steps(it)
        except StopIteration:
            break
        calls += 1
        assert isinstance(loss, jm.PerReplica) and loss.stacked.shape[:2] == (
            n, min(k, len(data) - len(fused_losses)))
        fused_losses += list(np.asarray(s.reduce("SUM", loss, axis=None)))
        fused_masks += [list(r) for r in zip(*[np.asarray(m).tolist()
                                               for m in s.experimental_local_results(mask)])]
    assert calls == -(-len(data) // k)
    assert _bits(fused_losses) == _bits(losses)
    assert fused_masks == masks  # each step saw its own batch's mask
    for got, want in zip((np.asarray(v.numpy()) for v in variables), final):
        assert _bits(got) == _bits(want)
    assert float(variables[2].numpy()) == 79.0  # every real row counted once
    # One program per number of steps in a call (k, and the remainder), traced once each.
    assert steps.compile_count == steps.trace_count == (1 if len(data) % k == 0 else 2)


@pytest.mark.parametrize("source", ["thread", "list", "host_arrays"])
def test_fused_steps_from_other_iterators_equal_single_steps(source):
    data = _data((12,) * 6)
    losses, _, final = _single_run(2, data)
    s = jm.MirroredStrategy(_devices(2))
    variables, fn = _training(s)
    steps = s.function(fn, steps_per_execution=3)
    if source == "thread":
        it = iter(s.experimental_distribute_dataset(data, jm.InputOptions(prefetch_thread=True)))
    elif source == "list":
        it = iter(list(s.experimental_distribute_dataset(data)))
    else:  # whole host batches: every replica gets all 12 rows; compare with that below
        it = iter(data)
    got = []
    for _ in range(2):
        loss, _ = steps(it)
        got += list(np.asarray(s.reduce("SUM", loss, axis=None)))
    with pytest.raises(StopIteration):
        steps(it)
    if source == "host_arrays":
        assert len(got) == 6 and all(np.isfinite(got))
        return
    assert _bits(got) == _bits(losses)
    for v, want in zip(variables, final):
        assert _bits(v.numpy()) == _bits(want)


def test_fused_steps_on_one_replica_equal_single_steps():
    data = _data((12,) * 6)
    losses, _, final = _single_run(1, data)
    s = jm.MirroredStrategy(_devices(1))
    variables, fn = _training(s)
    steps = s.function(fn, steps_per_execution=4)
    it = iter(s.experimental_distribute_dataset(data))
    got = list(np.asarray(s.reduce("SUM", steps(it)[0], axis=None)))
    got += list(np.asarray(s.reduce("SUM", steps(it)[0], axis=None)))
    assert _bits(got) == _bits(losses)
    for v, want in zip(variables, final):
        assert _bits(v.numpy()) == _bits(want)


def test_fused_steps_pass_other_arguments_to_every_step_and_donate():
    s = jm.MirroredStrategy(_devices(2))
    with s.scope():
        total = jm.Variable(0.0)

    def step(x, scale, extra):
        total.assign_add(jm.get_replica_context().all_reduce("SUM", x.sum()) * scale)
        return extra + 1.0

    steps = s.function(step, steps_per_execution=2, donate_argnums=(2,))
    it = iter(s.experimental_distribute_dataset([np.ones(4)] * 4))
    extra = s.experimental_replicate(jnp.zeros(3))
    with pytest.warns(UserWarning, match="returns a value shaped as its argument 2"):
        out = steps(it, 2.0, extra)
    assert out.shape == (2, 3) and np.asarray(out).tolist() == [[1.0] * 3] * 2
    assert float(total.numpy()) == 16.0
    out = steps(it, scale=jnp.float32(0.5), extra=s.experimental_replicate(jnp.ones(3)))
    assert float(total.numpy()) == 20.0


def test_fused_steps_refuse_bad_arguments():
    s = jm.MirroredStrategy(_devices(2))
    with pytest.raises(ValueError, match="steps_per_execution` must be an int >= 1; got 0"):
        s.function(lambda x: x, steps_per_execution=0)
    with pytest.raises(ValueError, match="steps_per_execution` must be an int >= 1; got True"):
        s.function(lambda x: x, steps_per_execution=True)
    with pytest.raises(ValueError, match="argument 0 is the element"):
        s.function(lambda x: x, steps_per_execution=2, donate_argnums=(0,))
    steps = s.function(lambda x: x, steps_per_execution=2)
    with pytest.raises(TypeError, match="takes an iterator as its first argument"):
        steps(np.ones(4))
    with pytest.raises(ValueError, match=r"results differ in shape \(\[\(1, 4\), \(1, 5\)\]"):
        steps(iter([np.ones(4), np.ones(5)]))  # runs both; per-row results cannot be stacked
    with pytest.raises(StopIteration, match="exhausted"):
        steps(iter([]))
    with pytest.raises(ValueError, match=r"function: `carry_argnums` must be non-negative ints; "
                                         r"got \(1, -1\)"):
        s.function(lambda x: x, steps_per_execution=2, carry_argnums=(1, -1))
    with pytest.raises(ValueError, match="RunOptions: `donate_argnums` must be non-negative ints"):
        s.function(lambda x: x, donate_argnums="0")
    with pytest.raises(ValueError, match="`carry_argnums` is for fused steps"):
        s.function(lambda x: x, carry_argnums=(1,))
    assert s.function(lambda x: x, steps_per_execution=np.int64(2)).steps_per_execution == 2


def test_fused_steps_run_elements_of_different_shapes_as_consecutive_programs():
    data = _data((12, 12, 12, 12, 12, 7))  # one replica: the last batch is shorter
    losses, _, final = _single_run(1, data)
    s = jm.MirroredStrategy(_devices(1))
    variables, fn = _training(s)
    steps = s.function(fn, steps_per_execution=4)
    it = iter(s.experimental_distribute_dataset(data))
    got = list(np.asarray(s.reduce("SUM", steps(it)[0], axis=None)))
    loss, real = steps(it)  # 12 and 7 rows: two programs, results joined
    assert real.tolist() == [12, 7]
    got += list(np.asarray(s.reduce("SUM", loss, axis=None)))
    assert _bits(got) == _bits(losses)
    for v, want in zip(variables, final):
        assert _bits(v.numpy()) == _bits(want)


def test_a_failed_fused_step_leaves_variables_unchanged():
    s = jm.MirroredStrategy(_devices(2))
    with s.scope():
        v = jm.Variable(1.0)
    calls = itertools.count()

    def step(x):
        v.assign_add(x.sum())
        if next(calls) == 1:  # the trace of the scanned steps fails
            raise RuntimeError("boom in the second step")
        return v.read_value()

    steps = s.function(step, steps_per_execution=3)
    with pytest.raises(RuntimeError, match="boom in the second step"):
        steps(iter(s.experimental_distribute_dataset([np.ones(2)] * 3)))
    assert float(v.numpy()) == 1.0


def test_fused_steps_from_threads_share_variables():
    s = jm.MirroredStrategy(_devices(2))
    with s.scope():
        v = jm.Variable(0.0)

    def step(x):
        v.assign_add(jm.get_replica_context().all_reduce("SUM", x.sum()))
        return v.read_value()

    steps = s.function(step, steps_per_execution=5)

    def work():
        it = iter(s.experimental_distribute_dataset([np.ones(2)] * 10))
        steps(it)
        steps(it)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert float(v.numpy()) == 40.0


def _key_free(x):
    x = getattr(x, "stacked", x)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_fused_steps_carry_nnx_models_and_optimizers_as_single_steps_do(n):
    import optax
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(5, 16, rngs=rngs)
            self.drop = nnx.Dropout(0.3, rngs=rngs)  # random: each step its own masks
            self.l2 = nnx.Linear(16, 3, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.drop(jax.nn.relu(self.l1(x))))

    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((12, 5)).astype(np.float32),
             rng.integers(0, 3, 12).astype(np.int32)) for _ in range(6)]

    def step(batch, model, opt):
        x, y = batch

        def loss_fn(m):
            per_row = optax.softmax_cross_entropy_with_integer_labels(m(x), y)
            return jm.compute_average_loss(per_row, global_batch_size=12)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, jm.get_replica_context().all_reduce("SUM", grads))
        return loss

    def make():
        model = Model(nnx.Rngs(0, dropout=1))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    s = jm.MirroredStrategy(_devices(n))
    m1, o1 = make()
    single = s.function(step)
    want = [np.asarray(s.reduce("SUM", single(b, m1, o1), axis=None))
            for b in s.experimental_distribute_dataset(data)]
    m2, o2 = make()
    steps = s.function(step, steps_per_execution=4)
    it = iter(s.experimental_distribute_dataset(data))
    got = list(np.asarray(s.reduce("SUM", steps(it, m2, o2), axis=None)))
    got += list(np.asarray(s.reduce("SUM", steps(it, m2, o2), axis=None)))
    # Not bit for bit: the scan's body is another XLA program than the single step, and XLA
    # may fuse adam's multiply-adds differently there (seen: 1 ulp in one moment).
    np.testing.assert_allclose(got, np.ravel(want), rtol=1e-6)
    for a, b in ((m1, m2), (o1, o2)):
        leaves = zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b)))
        for x, y in leaves:
            np.testing.assert_allclose(_key_free(y), _key_free(x), rtol=1e-6, atol=1e-8)


# -- what the review and the new-user trial found --------------------------------------------
def test_many_small_results_are_summed_by_one_collective_per_dtype():
    s = jm.MirroredStrategy(_devices(4))

    @s.function
    def step(x):
        i = jnp.float32(jm.get_replica_context().replica_id_in_sync_group)
        metrics = {f"m{j}": x.sum() * j + i for j in range(50)}
        metrics["half"] = (x[:2] * i).astype(jnp.bfloat16)
        return metrics

    x = s.experimental_replicate(jnp.ones(3))
    hlo = step.lower(x).compile().as_text()
    all_reduces = [line for line in hlo.splitlines() if " all-reduce(" in line
                   or "all-reduce-start(" in line]
    # One float32 buffer of the 50, one bfloat16 (XLA on CPU may merge the two).
    assert len(all_reduces) <= 2 and "f32[50]" in "".join(all_reduces), all_reduces
    out = step(x)
    sums = s.reduce("SUM", out, axis=None)
    assert [float(sums[f"m{j}"]) for j in (0, 1, 49)] == [6.0, 18.0, 594.0]
    assert sums["half"].tolist() == [6.0, 6.0]


def test_the_new_state_of_nnx_objects_is_not_summed():
    from flax import nnx

    s = jm.MirroredStrategy(_devices(2))
    model = nnx.BatchNorm(3, rngs=nnx.Rngs(0))  # its statistics differ per replica

    @s.function
    def step(m, x):
        return m(x).sum()

    batch = next(iter(s.experimental_distribute_dataset([np.arange(12.0).reshape(4, 3)])))
    loss = step(model, batch)
    assert attached_sum(loss, s.extended) is not None
    mean = nnx.state(model)["mean"].get_value()
    assert isinstance(mean, jm.PerReplica) and attached_sum(mean, s.extended) is None


def test_reduce_of_a_result_after_its_sum_was_donated_reduces_the_components():
    s = jm.MirroredStrategy(_devices(2))
    loss = s.run(lambda: jnp.float32(jm.get_replica_context().replica_id_in_sync_group + 1))
    first = s.reduce("SUM", loss, axis=None)
    s.function(lambda t: t * 2, donate_argnums=0)(first)  # gives the sum's buffer away
    assert first.is_deleted()
    assert float(s.reduce("SUM", loss, axis=None)) == 3.0


def test_results_pickle_and_copy_without_their_sum_or_strategy():
    import copy
    import gc
    import pickle
    import weakref

    s = jm.MirroredStrategy(_devices(2))
    loss = s.run(lambda: jnp.float32(jm.get_replica_context().replica_id_in_sync_group + 1))
    for again in (pickle.loads(pickle.dumps(loss)), copy.deepcopy(loss)):
        assert isinstance(again, jm.PerReplica) and attached_sum(again, s.extended) is None
        assert float(s.reduce("SUM", again, axis=None)) == 3.0
    ref = weakref.ref(s)
    del s
    gc.collect()
    assert ref() is None, "a step's result kept its strategy alive"
    assert float(np.asarray(loss.stacked).sum()) == 3.0


def test_debug_nans_and_infs_see_no_sum_nobody_asked_for():
    s = jm.MirroredStrategy(_devices(8))

    @s.function
    def step(x):
        return (x * 20000.0).astype(jnp.float16)  # 8 x 20000 overflows float16

    with jax.debug_infs(True):
        out = step(s.experimental_replicate(jnp.float32(1.0)))
        assert [float(c) for c in local(s, out)] == [20000.0] * 8
    assert attached_sum(out, s.extended) is None


def test_next_works_under_a_transfer_guard():
    s = jm.MirroredStrategy(_devices(2))
    it = iter(s.experimental_distribute_dataset([np.ones((4, 3), np.float32)] * 2))
    with jax.transfer_guard("disallow"):
        batch = next(it)
    assert batch.stacked.shape == (2, 2, 3)
    with jax.transfer_guard("disallow_explicit"):  # as jax.device_put, which it stands for
        with pytest.raises(Exception, match="host-to-device"):
            next(it)


def test_fused_steps_carry_arguments_named_in_carry_argnums():
    import optax

    tx = optax.adam(0.05)
    rng = np.random.default_rng(2)
    data = [(rng.standard_normal((8, 5)).astype(np.float32),
             rng.standard_normal((8, 3)).astype(np.float32)) for _ in range(5)]
    params0 = {"w": rng.standard_normal((5, 3)).astype(np.float32), "b": np.zeros(3, np.float32)}

    def step(batch, params, opt_state):
        x, y = batch

        def loss_fn(p):
            return jm.compute_average_loss(((x @ p["w"] + p["b"] - y) ** 2).sum(-1),
                                           global_batch_size=8)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = jm.get_replica_context().all_reduce("SUM", grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    s = jm.MirroredStrategy(_devices(2))
    params, opt_state = s.init(lambda: (params0, tx.init(params0)))
    single = s.function(step)
    want = []
    for batch in s.experimental_distribute_dataset(data):
        params, opt_state, loss = single(batch, params, opt_state)
        want.append(float(s.reduce("SUM", loss, axis=None)))
    p, o = s.init(lambda: (params0, tx.init(params0)))
    steps = s.function(step, steps_per_execution=3, carry_argnums=(1, 2), donate_argnums=(1, 2))
    it = iter(s.experimental_distribute_dataset(data))
    got = []
    for _ in range(2):
        old = p["w"]
        p, o, losses = steps(it, p, o)
        assert old.is_deleted()  # donated, and carried: the buffer was reused
        got += list(np.asarray(s.reduce("SUM", losses, axis=None)))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for k in params:
        np.testing.assert_allclose(np.asarray(p[k]), np.asarray(params[k]), rtol=1e-6,
                                   atol=1e-7)
    with pytest.raises(ValueError, match="result 0 must be argument 1 updated"):
        bad = s.function(lambda b, q: (q["w"], b[0].sum()), steps_per_execution=2,
                         carry_argnums=(1,))
        bad(iter(s.experimental_distribute_dataset(data)), params0)


def test_fused_steps_with_the_split_nnx_state_pattern_and_a_buffer_refilling_source():
    from flax import nnx

    s = jm.MirroredStrategy(_devices(2))
    graphdef, state = nnx.split(s.init(lambda: nnx.Linear(3, 1, rngs=nnx.Rngs(0))))

    def step(x, state):
        model = nnx.merge(graphdef, state)
        return jm.compute_average_loss(model(x)[:, 0] ** 2, global_batch_size=4)

    buffer = np.zeros((4, 3), np.float32)

    def refilled():  # a loader that reuses one buffer for every batch
        for i in range(4):
            buffer[...] = i
            yield buffer

    single = s.function(step)
    want = [float(s.reduce("SUM", single(b, state), axis=None))
            for b in s.experimental_distribute_dataset(refilled)]
    steps = s.function(step, steps_per_execution=4)
    got = s.reduce("SUM", steps(iter(s.experimental_distribute_dataset(refilled)), state),
                   axis=None)
    assert _bits(np.asarray(got)) == _bits(np.float32(want))
    assert len(set(want)) == 4


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int8, np.bool_, np.uint32,
                                   jnp.bfloat16])
def test_batches_placed_without_device_put_equal_device_puts(dtype):
    # The dataset places a batch's leaves without jax.device_put's Python dispatch
    # (_compat.put_host_arrays); the arrays must be those device_put makes.
    s = jm.MirroredStrategy(_devices(4))
    host = (np.arange(24).reshape(8, 3) % 5).astype(dtype)
    want = jax.device_put(host.reshape(4, 2, 3), s.extended.replica_sharding)
    for options in (None, jm.InputOptions(prefetch_thread=True)):
        batch = next(iter(s.experimental_distribute_dataset([host], options=options)))
        got = batch.stacked
        assert got.dtype == want.dtype and got.sharding == want.sharding
        assert got.committed == want.committed
        assert _bits(np.asarray(got)) == _bits(np.asarray(want))


def test_a_value_of_another_strategy_with_other_replicas_is_refused():
    four, two = jm.MirroredStrategy(_devices(4)), jm.MirroredStrategy(["CPU:4", "CPU:5"])
    value = four.run(lambda: jnp.float32(jm.get_replica_context().replica_id_in_sync_group))
    for method, call in (("reduce", lambda: two.reduce("SUM", value, axis=None)),
                         ("gather", lambda: two.gather(value, 0)),
                         ("experimental_local_results",
                          lambda: two.experimental_local_results(value))):
        with pytest.raises(ValueError, match=f"{method}: got a PerReplica with 4 components, "
                                             f"but this strategy has 2 replicas"):
            call()
