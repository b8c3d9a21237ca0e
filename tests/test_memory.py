"""Re-creating strategies, variables and steps (re-running notebook cells) does not grow memory
beyond what plain ``jax.jit`` of new functions does."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import gc, json, os, resource, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp
    import jaxmirror as jm

    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def plain_jit(i):
        f = jax.jit(lambda x: x * 2 + i)
        f(jnp.float32(1)).block_until_ready()

    def notebook_cell(i):  # what re-running a cell does: a new strategy, variable and step
        s = jm.MirroredStrategy(["CPU:0", "CPU:1"])
        with s.scope():
            v = jm.Variable(float(i))
            w = jm.Variable(jnp.zeros(4), synchronization="on_read", aggregation="sum")

        @s.function
        def step(x):
            v.assign_add(x)
            w.assign_add(jnp.ones(4))
            return jm.get_replica_context().all_reduce("sum", x)

        step(jnp.float32(1.0)).block_until_ready()
        assert float(v.numpy()) == i + 1.0

    growth = {}
    for name, body in [("jit", plain_jit), ("jaxmirror", notebook_cell)]:
        for i in range(30):  # warm up: caches that fill once
            body(i)
        gc.collect()
        start = rss_mib()
        for i in range(600):
            body(i)
        gc.collect()
        growth[name] = rss_mib() - start
    alive = sum(isinstance(o, jm.MirroredStrategy) for o in gc.get_objects())
    print(json.dumps({"growth": growth, "strategies_alive": alive}))
""")


def test_six_hundred_recreated_strategies_variables_and_steps_grow_like_plain_jit():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    growth = result["growth"]
    # Before programs were released with their functions this grew by about 1.5 MiB per cell
    # (+900 MiB here); plain jax.jit of new functions stays within a few MiB.
    assert growth["jaxmirror"] <= growth["jit"] + 40, growth
    assert result["strategies_alive"] <= 1, result


# ----------------------------------------------------------------------------------------------
# Device memory of params and optimizer state: one copy per device (benchmarks/memory.py prints
# the same counts for 1, 2, 4 and 8 devices).
#
# CPU devices report no memory_stats(), so bytes are summed over jax.live_arrays(): each array's
# addressable shards' buffers, deduplicated by (device, address), because a shard read as its own
# array shares its parent's buffer. Only buffers that appear after a snapshot count; the
# snapshot keeps its arrays alive so that no new buffer can take one of their addresses.
# ----------------------------------------------------------------------------------------------

import gc  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import jaxmirror as jm  # noqa: E402
from conftest import mirrored  # noqa: E402
from jaxmirror.core import inflight  # noqa: E402

N = 4
SIZES = (96, 64, 10)  # MLP layer sizes: ~30 KiB of params, ~90 KiB with adam's state
TX = optax.adam(1e-3)
LOSS_BYTES = 4  # a loss comes back as a float32 scalar replicated over the devices


def _buffers() -> dict:
    """``{(device id, buffer address): bytes}`` of every live array's addressable shards."""
    out = {}
    for x in jax.live_arrays():
        if not x.is_deleted():
            for shard in x.addressable_shards:
                data = shard.data
                out[shard.device.id, data.unsafe_buffer_pointer()] = data.nbytes
    return out


class _Snapshot:
    def __init__(self):
        gc.collect()
        self._keep = jax.live_arrays()
        self._keys = set(_buffers())

    def new(self, drain: bool = True) -> list:
        """Bytes per device (all 8) of the buffers that appeared since the snapshot.

        ``drain``: first wait for the steps in jaxmirror's in-flight queue (N >= 2 CPU devices),
        which holds each step's smallest output (here the 4-byte loss) for up to 8 steps.
        """
        if drain:
            inflight.drain()
        gc.collect()
        per = [0] * jax.device_count()
        for (dev, ptr), nbytes in _buffers().items():
            if (dev, ptr) not in self._keys:
                per[dev] += nbytes
        return per


def _host_params(seed=0) -> dict:
    rng = np.random.default_rng(seed)
    params = {}
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        params[f"w{i}"] = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        params[f"b{i}"] = np.zeros((b,), np.float32)
    return params


def _one_copy() -> int:
    """Bytes of one copy of params + adam state."""
    params = _host_params()
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves((params, TX.init(params))))


def _host_batch(rows=32, seed=1):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, SIZES[0])).astype(np.float32),
            rng.integers(0, SIZES[-1], rows).astype(np.int32))


def _mlp(params, x):
    n = len(params) // 2
    for i in range(n):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        if i < n - 1:
            x = jax.nn.relu(x)
    return x


def _train_update(params, opt_state, x, y):
    def loss_fn(p):
        per_example = optax.softmax_cross_entropy_with_integer_labels(_mlp(p, x), y)
        return jm.compute_average_loss(per_example)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    ctx = jm.get_replica_context()
    updates, opt_state = TX.update(ctx.all_reduce("sum", grads), opt_state, params)
    return optax.apply_updates(params, updates), opt_state, ctx.all_reduce("sum", loss)


def _batch(s):
    return next(iter(s.experimental_distribute_dataset([_host_batch()])))


def _assert_one_copy_each(per, extra=0, n=N):
    size = _one_copy()
    assert per[:n] == [size + extra] * n, (
        f"bytes per device {per[:n]}, want one copy of params + adam state ({size}) + {extra} "
        f"on each: {[round((b - extra) / size, 3) for b in per[:n]]} copies")
    assert per[n:] == [0] * (len(per) - n), f"bytes on devices outside the strategy: {per[n:]}"
    assert sum(per) - n * extra == n * size  # N copies in all, not one per simulated device


@pytest.mark.parametrize("build", ["init", "experimental_replicate"])
def test_params_and_adam_state_hold_one_copy_per_device_after_init(build):
    s = mirrored(N)
    snap = _Snapshot()
    if build == "init":
        state = s.init(lambda: (lambda p: (p, TX.init(p)))(_host_params()))
    else:
        params = s.experimental_replicate(_host_params())
        state = (params, s.experimental_replicate(TX.init(params)))
    jax.block_until_ready(state)
    _assert_one_copy_each(snap.new())


@pytest.mark.parametrize("donate", [(0, 1), ()], ids=["donated", "not_donated"])
def test_pytree_steps_keep_one_copy_per_device(donate):
    s = mirrored(N)
    x, y = _batch(s)  # made before the snapshot: not counted
    step = s.function(_train_update, donate_argnums=donate)
    snap = _Snapshot()
    params, opt_state = s.init(lambda: (lambda p: (p, TX.init(p)))(_host_params()))
    loss = None
    for _ in range(5):
        params, opt_state, loss = step(params, opt_state, x, y)
    jax.block_until_ready((params, opt_state, loss))
    _assert_one_copy_each(snap.new(), extra=LOSS_BYTES)  # and the loss we hold
    assert (step.trace_count, step.compile_count) == (1, 1)


def test_donated_step_deletes_the_old_arrays_and_live_bytes_do_not_grow():
    s = mirrored(N)
    x, y = _batch(s)
    step = s.function(_train_update, donate_argnums=(0, 1))
    snap = _Snapshot()
    params, opt_state = s.init(lambda: (lambda p: (p, TX.init(p)))(_host_params()))
    history = []
    for i in range(10):
        old = jax.tree.leaves((params, opt_state))
        params, opt_state, loss = step(params, opt_state, x, y)
        jax.block_until_ready(loss)
        alive = [a.shape for a in old if not a.is_deleted()]
        assert not alive, f"step {i}: donated arrays still alive: {alive}"
        del old
        history.append(snap.new(drain=False)[:N])
    # Undrained, the in-flight queue holds up to 8 losses (4 bytes each) of finished steps:
    # bytes may rise by that much over the first 8 steps, then stay flat.
    first = history[0][0]
    assert all(h == [h[0]] * N for h in history), history
    assert max(h[0] for h in history) - first <= (inflight.MAX_IN_FLIGHT - 1) * LOSS_BYTES, [
        h[0] - first for h in history]
    assert history[-1] == history[-2] == history[-3], [h[0] - first for h in history]
    _assert_one_copy_each(snap.new(), extra=LOSS_BYTES)


def _variable_training(s):
    """Params and adam state as variables made in ``s.scope()``, and a step capturing them."""
    with s.scope():
        pv = jax.tree.map(jm.Variable, _host_params())
        ov = jax.tree.map(jm.Variable, TX.init(_host_params()))

    @s.function
    def step(x, y):
        params, opt_state = jm.read_values((pv, ov))
        params, opt_state, loss = _train_update(params, opt_state, x, y)
        jm.assign_values((pv, ov), (params, opt_state))
        return loss

    return (pv, ov), step


def test_variables_hold_one_copy_per_device_once_read():
    s = mirrored(N)
    x, y = _batch(s)
    snap = _Snapshot()
    variables, step = _variable_training(s)
    _assert_one_copy_each(snap.new())
    for _ in range(5):
        loss = step(x, y)
    jax.block_until_ready(loss)
    for v in jax.tree.leaves(variables):
        v.read_value()  # an eager read closes the steps still open on the variable
    _assert_one_copy_each(snap.new(), extra=LOSS_BYTES)
    for v in jax.tree.leaves(variables):  # one array, replicated over the 4 devices
        assert len(v.values) == N and len({a.unsafe_buffer_pointer() for a in v.values}) == N


def test_variables_keep_one_more_copy_in_tfs_loop_until_the_next_step():
    """In TF's loop (the loss read after every step) variables hold two copies of params and
    adam state per device between steps: the step's new arrays, and the last ones known good,
    kept until the step is known to have succeeded (a failed step rolls back to them;
    ``variables/state.py``). That is no more than a step needs anyway while it runs (its
    inputs and its outputs); the next step (or an eager read) drops the older copy. One copy
    throughout: pytree steps with ``donate_argnums`` (above)."""
    s = mirrored(N)
    x, y = _batch(s)
    snap = _Snapshot()
    variables, step = _variable_training(s)
    step(x, y)  # compile; then read, so that nothing is open
    for v in jax.tree.leaves(variables):
        v.read_value()
    for _ in range(5):
        loss = step(x, y)
        float(s.reduce("sum", loss, axis=None))
        per = snap.new()
        copies = [round((b - LOSS_BYTES) / _one_copy(), 3) for b in per[:N]]
        assert copies == [2.0] * N, f"copies of params + adam state per device: {copies}"
    for v in jax.tree.leaves(variables):
        v.read_value()
    _assert_one_copy_each(snap.new(), extra=LOSS_BYTES)


@pytest.mark.parametrize("n", [N, 1])
def test_epoch_with_a_partial_last_batch_compiles_one_program(n):
    """Batches of 256, 256 and 100 rows (global batch 256): one program for the epoch.

    On N replicas the partial batch is padded to the full per-replica size with row counts
    riding along. With one replica batches are plain arrays of their real size, as TF's
    (padding them would silently count padded rows in a hand-written ``jnp.mean`` that is
    exact today): the 100-row batch compiles a second program there, as it retraces TF's
    ``tf.function``; ``drop_remainder=True`` keeps one (the test below).
    """
    s = jm.MirroredStrategy(jax.devices()[:n])
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((rows, SIZES[0])).astype(np.float32),
                rng.integers(0, SIZES[-1], rows).astype(np.int32)) for rows in (256, 256, 100)]
    step = s.function(_train_update, donate_argnums=(0, 1))
    params, opt_state = s.init(lambda: (lambda p: (p, TX.init(p)))(_host_params()))
    losses = []
    for x, y in s.experimental_distribute_dataset(batches):
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(float(s.reduce("sum", loss, axis=None)))
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert hasattr(step, "compile_count")
    want = (1, 1) if n > 1 else (2, 2)
    assert (step.trace_count, step.compile_count) == want, (
        f"{n} replica(s): traced {step.trace_count}, compiled {step.compile_count} for one epoch")


def test_epoch_with_a_partial_last_batch_compiles_one_program_one_replica_drop():
    s = jm.MirroredStrategy(jax.devices()[:1])
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((rows, SIZES[0])).astype(np.float32),
                rng.integers(0, SIZES[-1], rows).astype(np.int32)) for rows in (256, 256, 100)]
    step = s.function(_train_update, donate_argnums=(0, 1))
    params, opt_state = s.init(lambda: (lambda p: (p, TX.init(p)))(_host_params()))
    dist = s.experimental_distribute_dataset(batches, jm.InputOptions(drop_remainder=True))
    for x, y in dist:
        params, opt_state, _ = step(params, opt_state, x, y)
    assert (step.trace_count, step.compile_count) == (1, 1)
