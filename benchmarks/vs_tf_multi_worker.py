#!/usr/bin/env python
"""TensorFlow's MultiWorkerMirroredStrategy training loop against the same loop on jaxmirror.

The same data-parallel training runs on W worker processes on this machine (loopback only),
once through each framework's ``MultiWorkerMirroredStrategy`` and its own loop, as users write
it: the same MLP, the same initial params, the same batches in the same order, the same global
batch. Each worker process builds both models and trains them one after the other.

  (TF) TF's multi-worker custom-training loop. The script starts W copies of itself (hidden
       ``--tf-worker``), each with a ``TF_CONFIG`` naming the same cluster of free
       ``127.0.0.1`` ports and its own task index. In each: ``strategy =
       tf.distribute.MultiWorkerMirroredStrategy()`` (its defaults: RING collectives on CPU),
       ``tf.Variable``s in ``strategy.scope()``, ``it = iter(strategy.experimental_distribute_
       dataset(tf.data.Dataset.from_tensor_slices((X, Y)).batch(B).repeat()))`` (auto-shard
       policy DATA, as in TF's multi-worker tutorial). The step is ``@tf.function def
       train_step(dist_inputs)``: ``strategy.run(step_fn, ...)``, then ``strategy.reduce(SUM,
       per_replica_losses, axis=None)``. ``step_fn`` takes the gradient of
       ``tf.nn.compute_average_loss(per_example_loss, global_batch_size=B)`` with a
       ``GradientTape``, all-reduces it (``get_replica_context().all_reduce(SUM, grads)``) and
       applies SGD with ``v.assign_sub(lr * g)``. Per step: ``float(train_step(next(it)))``.
  (jm) jaxmirror's public API: the loop of ``vs_tensorflow.py`` under
       ``jaxmirror.MultiWorkerMirroredStrategy``, its W workers started by
       ``jaxmirror.launch.run`` (as ``multi_worker.py`` does; ``TF_CONFIG`` on loopback too).
       ``jaxmirror.Variable``s in ``strategy.scope()``; ``train_step =
       strategy.function(step_fn)`` reads them, takes ``jax.value_and_grad`` of
       ``jaxmirror.compute_average_loss(per_example_loss, global_batch_size=B)``, all-reduces the
       grads (``get_replica_context().all_reduce("SUM", grads)``) and assigns ``w - lr * g``.
       Per step: ``x, y = next(iterator); float(strategy.reduce("SUM", train_step(x, y),
       axis=None))`` over ``strategy.experimental_distribute_dataset``.

Layouts: W workers x 1 device (default 2 x 1 and 4 x 1). TF's MultiWorkerMirroredStrategy cannot
run 2 workers x 2 devices on CPU: with a multi-worker cluster it takes one device per worker
unless the worker has GPUs or TPUs (``CollectiveAllReduceExtended._initialize_local_devices``:
``num_local_devices = 1`` for CPU; logical CPU devices are not counted), and its ``devices``
argument is only for a single worker. So each jaxmirror worker also gets 1 simulated CPU device.

Models (as in ``multi_worker.py``): small, an MLP 32 -> 64 -> 10 with global batch 256
(latency-bound: the all-reduce is the step), and wide, 256 -> 1024 -> 1024 -> 10 with global
batch 512 (1.3 M params: a 5 MB all-reduce per step). Softmax cross-entropy with integer labels,
SGD lr 0.1 written by hand, 8 host NumPy global batches cycled, float32 everywhere.

Method. Per layout, ``--rounds`` rounds; each round launches the TF cluster and the jaxmirror
cluster once each, TF first in even rounds and jaxmirror first in odd ones (never both at
once). In each launch every worker runs, per model: the first ``--check`` steps one at a time
(they trace and compile), ``--warmup`` untimed steps, then ``--steps`` timed steps
(``perf_counter`` around the whole loop, GC off); the step must not trace again while timed.
A launch's seconds per step are its slowest worker's (a step ends when the last worker's
does). The table gives medians over rounds and the ratio TF / jaxmirror taken within each round,
median [min-max]. Process start-up (imports, joining the cluster) is not timed. No A/A control:
each extra launch costs more start-up than it times. Beside them, the compute floor: in this
process, between launches, the same SGD step on the whole global batch as one plain
``jax.jit`` on 1 CPU device, ``float(loss)`` per step, no workers and no collectives. The
workers share this machine's cores, so no layout does the step's arithmetic faster: TF / floor
bounds the ratio TF / jaxmirror that any multi-worker loop could reach here.

Then (``--breakdown-rounds``, 0 skips it) where jaxmirror's small-model step goes on 2 x 1: the
loop as written against the same with batches made in ``next`` (no prefetch thread), without
``next`` (one batch kept), ``next`` alone, and a bare hand-written ``jax.jit(jax.shard_map(
lax.psum))`` of the gradients' size across the workers (gloo's round trip), in rotating order.

Agreement: within a launch, every worker's reduced losses equal worker 0's bit for bit (the
same all-reduce result). Between the frameworks, the first ``--check`` losses must agree with
``rtol 1e-5`` (``_timing.check_close``; TF's oneDNN kernels and XLA add in different orders, on
any platform); the largest relative difference over all the steps both ran is reported (float32
rounding drifts apart slowly along the trajectory).

Threads: both frameworks' defaults in every worker (each uses all host cores), as users get
them; only TF's C++ info logging is turned down (``TF_CPP_MIN_LOG_LEVEL=2`` unless set).
CPU only: TensorFlow here is ``tensorflow-cpu`` (the ``bench`` extra: ``pip install -e
'.[bench]'``), so jaxmirror runs on simulated CPU devices too (``JAX_PLATFORMS`` other than
``cpu`` is refused).

Run from the repository root:
    .venv/bin/python benchmarks/vs_tf_multi_worker.py           # 2x1, 4x1; about 4 minutes
    .venv/bin/python benchmarks/vs_tf_multi_worker.py --quick   # a smoke run, about 1 minute
    .venv/bin/python benchmarks/vs_tf_multi_worker.py --layouts 2x1 --models small --rounds 4
"""

from __future__ import annotations

import os

from _platform import simulated_cpu_devices  # noqa: E402  (before JAX)

_FLAG = simulated_cpu_devices(1)  # this process's JAX: one worker's devices, for the first line
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse, gc, importlib.metadata, itertools, json  # noqa: E401,E402
import shlex, signal, socket, statistics, subprocess, sys, tempfile, time  # noqa: E401,E402

import numpy as np  # noqa: E402

MODELS = {  # name: (layer sizes, global batch), as in multi_worker.py
    "small": ((32, 64, 10), 256),
    "wide": ((256, 1024, 1024, 10), 512),
}
LR = 0.1
NUM_BATCHES = 8  # distinct host global batches, cycled through
GOAL = 3.0  # the ratio TF / jaxmirror per step the project aims at (issue 32)
RTOL = 1e-5  # TF vs jaxmirror, first --check losses (TF's oneDNN vs XLA: other sum orders)
MARK = "@@vs_tf_multi_worker result@@ "  # a TF worker's result line on its stdout
TF, JM, FLOOR = "TF", "jaxmirror", "floor"


def host_data(sizes, batch, seed: int = 0):
    """The initial params (NumPy, float32) and the host global batches of one model."""
    rng = np.random.default_rng(seed)
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"w{i}"] = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        params[f"b{i}"] = np.zeros((b,), np.float32)
    batches = [(rng.standard_normal((batch, sizes[0])).astype(np.float32),
                rng.integers(0, sizes[-1], batch).astype(np.int32))
               for _ in range(NUM_BATCHES)]
    return params, batches


def measure(loop, counts, steps: int, warmup: int, check: int) -> dict:
    """One model in one worker: the first ``check`` steps one by one, ``warmup`` more, then
    ``steps`` timed; seconds per step and every step's loss. ``counts()``: the trace counts,
    which must not change while timed."""
    losses = [x for _ in range(check) for x in loop(1)]
    losses += loop(warmup)
    before = counts()
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        timed = loop(steps)
        seconds = (time.perf_counter() - t0) / steps
    finally:
        gc.enable()
    assert counts() == before, f"the step traced again while timed: {before} -> {counts()}"
    return {"seconds": seconds, "losses": losses + timed}


def tf_worker(names, steps: int, warmup: int, check: int) -> dict:
    """One TF worker (``TF_CONFIG`` set by the parent): each model's ``measure`` result."""
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # first: before any other TF op
    out = {}
    for name in names:
        sizes, batch = MODELS[name]
        params, batches = host_data(sizes, batch)
        with strategy.scope():
            variables = {k: tf.Variable(v, name=k) for k, v in params.items()}
        keys = list(variables)
        x_all = np.concatenate([x for x, _ in batches])
        y_all = np.concatenate([y for _, y in batches])
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA)
        dataset = (tf.data.Dataset.from_tensor_slices((x_all, y_all)).batch(batch).repeat()
                   .with_options(options))
        it = iter(strategy.experimental_distribute_dataset(dataset))

        def step_fn(inputs, variables=variables, keys=keys, batch=batch):
            x, y = inputs
            with tf.GradientTape() as tape:
                h = x
                for i in range(len(keys) // 2):
                    h = tf.matmul(h, variables[f"w{i}"]) + variables[f"b{i}"]
                    if i < len(keys) // 2 - 1:
                        h = tf.nn.relu(h)
                per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=batch)
            grads = tape.gradient(loss, [variables[k] for k in keys])
            grads = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, grads)
            for k, g in zip(keys, grads):
                variables[k].assign_sub(LR * g)
            return loss

        def make_step(step_fn=step_fn):
            @tf.function
            def train_step(dist_inputs):
                per_replica_losses = strategy.run(step_fn, args=(dist_inputs,))
                return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses,
                                       axis=None)
            return train_step

        train_step = make_step()

        def loop(k, it=it, train_step=train_step):
            return [float(train_step(next(it))) for _ in range(k)]

        out[name] = measure(loop, lambda s=train_step: s.experimental_get_tracing_count(),
                            steps, warmup, check)
    return out


def jaxmirror_step(strategy, params, batch):
    """TF's tutorial step on jaxmirror: the MLP's params as ``jaxmirror.Variable``s, the loss
    through ``compute_average_loss``, the gradients all-reduced, SGD by ``assign``; returns
    ``strategy.function`` of it (``train_step(x, y)`` gives the per-replica loss)."""
    import jax
    import optax

    import jaxmirror as jm

    with strategy.scope():
        variables = {k: jm.Variable(v, name=k) for k, v in params.items()}

    def replica_loss(p, x, y):
        n = len(p) // 2
        for i in range(n):
            x = x @ p[f"w{i}"] + p[f"b{i}"]
            if i < n - 1:
                x = jax.nn.relu(x)
        per_example = optax.softmax_cross_entropy_with_integer_labels(x, y)
        return jm.compute_average_loss(per_example, global_batch_size=batch)

    def step_fn(x, y):
        values = {k: v.read_value() for k, v in variables.items()}
        loss, grads = jax.value_and_grad(replica_loss)(values, x, y)
        grads = jm.get_replica_context().all_reduce("SUM", grads)
        for k, v in variables.items():
            v.assign(values[k] - LR * grads[k])
        return loss

    return strategy.function(step_fn)


def jm_worker(names, steps: int, warmup: int, check: int) -> dict:
    """One jaxmirror worker (started by ``jaxmirror.launch.run``): each model's result."""
    import jaxmirror as jm

    options = jm.experimental.CommunicationOptions(timeout_seconds=120)
    strategy = jm.MultiWorkerMirroredStrategy(communication_options=options)
    out = {}
    for name in names:
        sizes, batch = MODELS[name]
        params, batches = host_data(sizes, batch)
        train_step = jaxmirror_step(strategy, params, batch)
        iterator = iter(strategy.experimental_distribute_dataset(
            lambda batches=batches: itertools.cycle(batches)))

        def loop(k, iterator=iterator, train_step=train_step):
            losses = []
            for _ in range(k):
                x, y = next(iterator)
                loss = train_step(x, y)
                losses.append(float(strategy.reduce("SUM", loss, axis=None)))
            return losses

        out[name] = measure(loop, lambda s=train_step: (s.trace_count, s.compile_count),
                            steps, warmup, check)
    return out


def breakdown_worker(steps: int, rounds: int) -> dict:
    """Where jaxmirror's small-model step goes on one worker of W x 1 (``--breakdown``): the
    loop as written and parts of it, in rotating order, seconds per step (median over rounds).

    ``as written`` (the table's loop); ``batches made in next``: the same with
    ``InputOptions(prefetch_thread=False)``; ``no next``: step, reduce and ``float`` on one batch
    kept from ``next``; ``next alone``; ``bare psum``: a hand-written ``jax.jit(jax.shard_map(
    lax.psum))`` over all workers' devices of the gradients' float count (the step packs its
    leaves into one buffer), waited for: gloo's round trip alone."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import jaxmirror as jm

    strategy = jm.MultiWorkerMirroredStrategy()
    sizes, batch = MODELS["small"]
    params, batches = host_data(sizes, batch)
    train_step = jaxmirror_step(strategy, params, batch)
    iterators = {thread: iter(strategy.experimental_distribute_dataset(
        lambda: itertools.cycle(batches), jm.InputOptions(prefetch_thread=thread)))
        for thread in (None, False)}
    kept = next(iterators[None])
    mesh = Mesh(np.array(jax.devices()), ("workers",))
    size = sum(v.size for v in params.values())
    grads = jax.make_array_from_process_local_data(
        NamedSharding(mesh, PartitionSpec("workers")),
        np.ones((jax.local_device_count(), size), np.float32))
    psum = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "workers"), mesh=mesh,
                                 in_specs=PartitionSpec("workers"),
                                 out_specs=PartitionSpec("workers")))

    def loop(iterator=None, step=True, k=steps):
        for _ in range(k):
            x, y = kept if iterator is None else next(iterator)
            if step:
                float(strategy.reduce("SUM", train_step(x, y), axis=None))

    def bare_psum(k=steps):
        for _ in range(k):
            jax.block_until_ready(psum(grads))

    parts = {"as written": lambda: loop(iterators[None]),
             "batches made in next": lambda: loop(iterators[False]),
             "no next": lambda: loop(), "next alone": lambda: loop(iterators[None], False),
             "bare psum": bare_psum}
    for part in parts.values():  # trace, compile, warm up
        part()
    times = {name: [] for name in parts}
    names = list(parts)
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                t0 = time.perf_counter()
                parts[name]()
                times[name].append((time.perf_counter() - t0) / steps)
    finally:
        gc.enable()
    return {name: statistics.median(t) for name, t in times.items()}


def floor_loop(name: str, steps: int, warmup: int) -> float:
    """Seconds per step of the compute alone, in this process: the same SGD step on the whole
    global batch as one ``jax.jit`` on 1 CPU device (no workers, no collectives), with the
    same ``float(loss)`` per step. W workers share this machine's cores, so no layout can do
    the step's arithmetic faster: TF's time over this bounds the reachable ratio."""
    import jax
    import optax

    sizes, batch = MODELS[name]
    params, batches = host_data(sizes, batch)
    batches = [jax.device_put(b) for b in batches]

    def loss_fn(p, x, y):
        n = len(p) // 2
        for i in range(n):
            x = x @ p[f"w{i}"] + p[f"b{i}"]
            if i < n - 1:
                x = jax.nn.relu(x)
        return optax.softmax_cross_entropy_with_integer_labels(x, y).mean()

    @jax.jit
    def step(p, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        return jax.tree.map(lambda a, g: a - LR * g, p, grads), loss

    params = jax.device_put(params)
    data = itertools.cycle(batches)

    def loop(k):
        nonlocal params
        for _ in range(k):
            params, loss = step(params, *next(data))
            float(loss)

    loop(warmup + 1)
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        loop(steps)
        return (time.perf_counter() - t0) / steps
    finally:
        gc.enable()


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (all bound at once, then released)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _result(path: str):
    with open(path) as f:
        found = [line[len(MARK):] for line in f if line.startswith(MARK)]
    return json.loads(found[-1]) if found else None


def _failure(what: str, err_path: str) -> str:
    with open(err_path) as f:
        tail = f.read().splitlines()[-20:]
    return f"vs_tf_multi_worker.py: {what}; its stderr ends:\n" + "\n".join(tail)


def launch_tf(workers: int, names, args) -> list[dict]:
    """Start ``workers`` TF workers (this script, ``--tf-worker``) on a loopback cluster and
    return their results in task order. Each runs in a session of its own; whatever is still
    running at the end (a failure, the timeout, a worker that hangs on exit) gets SIGKILL
    to its process group: exactly the processes started here."""
    ports = free_ports(workers)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    cmd = [sys.executable, os.path.abspath(__file__), "--tf-worker", ",".join(names)]
    for name in ("steps", "warmup", "check"):
        cmd += [f"--{name}", str(getattr(args, name))]
    procs, results = [], [None] * workers
    with tempfile.TemporaryDirectory(prefix="vs_tf_multi_worker-") as folder:
        outs = [os.path.join(folder, f"out{i}") for i in range(workers)]
        errs = [os.path.join(folder, f"err{i}") for i in range(workers)]
        try:
            for i in range(workers):
                env = dict(os.environ, TF_CONFIG=json.dumps(
                    {"cluster": cluster, "task": {"type": "worker", "index": i}}))
                with open(outs[i], "w") as out, open(errs[i], "w") as err:
                    procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=err,
                                                  stdin=subprocess.DEVNULL,
                                                  start_new_session=True))
            deadline = time.monotonic() + args.timeout
            done_at = None  # when every worker had printed its result
            while any(p.poll() is None for p in procs):
                failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed:
                    raise RuntimeError(_failure(f"TF worker {failed[0]} exited with "
                                                f"{procs[failed[0]].returncode}", errs[failed[0]]))
                if time.monotonic() > deadline:
                    raise TimeoutError(_failure(f"TF workers still running after "
                                                f"{args.timeout:g} s (--timeout)", errs[0]))
                if done_at is None and all(_result(o) is not None for o in outs):
                    done_at = time.monotonic()
                if done_at is not None and time.monotonic() - done_at > 15:
                    break  # results are in; a worker that hangs on exit is killed below
                time.sleep(0.2)
            for i, p in enumerate(procs):
                if p.poll() not in (None, 0):
                    raise RuntimeError(_failure(f"TF worker {i} exited with {p.returncode}",
                                                errs[i]))
                results[i] = _result(outs[i])
                if results[i] is None:
                    raise RuntimeError(_failure(f"TF worker {i} printed no result", errs[i]))
        finally:
            for p in procs:
                if p.poll() is None:  # not reaped yet: its group id is still its own
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    return results


def launch_jm(workers: int, names, args) -> list[dict]:
    """``jaxmirror.launch.run``: ``workers`` local workers with 1 simulated CPU device each."""
    import jaxmirror

    return jaxmirror.launch.run(jm_worker, workers=workers, devices_per_worker=1,
                                args=(names, args.steps, args.warmup, args.check),
                                timeout=args.timeout)


def one_launch(framework: str, workers: int, names, args) -> dict:
    """One launch: per model, the slowest worker's seconds per step and worker 0's losses
    (every worker's must equal them bit for bit)."""
    from _timing import check_close

    results = (launch_tf if framework == TF else launch_jm)(workers, names, args)
    out = {}
    for name in names:
        losses = results[0][name]["losses"]
        for i, r in enumerate(results[1:], 1):
            check_close(f"{framework} {name}: worker {i}'s losses vs worker 0's",
                        np.float64(r[name]["losses"]), np.float64(losses), gpu_rtol=0.0,
                        platform="cpu")
        out[name] = (max(r[name]["seconds"] for r in results), losses)
    return out


def installed_tensorflow() -> str | None:
    """The installed TensorFlow's version, without importing it (only the workers run TF)."""
    for dist in ("tensorflow-cpu", "tensorflow", "tensorflow-intel", "tensorflow-macos"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def max_rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.abs(b)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="2x1,4x1",
                    help="workers x devices per worker, comma-separated (default 2x1,4x1); "
                         "TF's MultiWorkerMirroredStrategy takes 1 CPU device per worker")
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma-separated, from {', '.join(MODELS)} (default: both)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="launches of each framework per layout; even, so both orders come "
                         "equally often (default 4; --quick 1)")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per model per launch (default 40; --quick 5)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps after the check (default 5; --quick 2)")
    ap.add_argument("--check", type=int, default=None,
                    help=f"first steps whose losses must agree, rtol {RTOL:g} (they also "
                         "trace and compile; default 3)")
    ap.add_argument("--breakdown-rounds", type=int, default=None,
                    help="rounds of the split of jaxmirror's small-model step on 2 x 1 (100 "
                         "steps each; default 5; --quick 1; 0 skips it)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds one launch may take before its workers are killed")
    ap.add_argument("--quick", action="store_true", help="a smoke run, about 1 minute; noisy")
    ap.add_argument("--tf-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    defaults = {"rounds": (4, 1), "steps": (40, 5), "warmup": (5, 2), "check": (3, 3),
                "breakdown_rounds": (5, 1)}
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.tf_worker is not None:
        result = tf_worker(args.tf_worker.split(","), args.steps, args.warmup, args.check)
        print(MARK + json.dumps(result), flush=True)
        return 0

    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown or not names:
        ap.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    try:
        layouts = [tuple(int(n) for n in s.lower().split("x")) for s in args.layouts.split(",")]
        assert all(len(lo) == 2 for lo in layouts)
    except (ValueError, AssertionError):
        ap.error(f"--layouts: WxD pairs, e.g. 2x1,4x1; got {args.layouts!r}")
    for w, d in layouts:
        if d != 1:
            ap.error(f"--layouts: {w}x{d}: TF's MultiWorkerMirroredStrategy uses one CPU device "
                     f"per worker (2 x 2 is not possible on CPU); use Wx1")
        if w < 2:
            ap.error(f"--layouts: {w}x{d}: at least 2 workers")
    if min(args.rounds, args.steps, args.check) < 1 or args.warmup < 0:
        ap.error("--rounds, --steps and --check must be at least 1, --warmup at least 0")
    if os.environ["JAX_PLATFORMS"].split(",")[0] not in ("", "cpu"):
        print("vs_tf_multi_worker.py: runs on CPU only (TF here is tensorflow-cpu); unset "
              "JAX_PLATFORMS", file=sys.stderr)
        return 2
    tf_version = installed_tensorflow()
    if tf_version is None:
        print("vs_tf_multi_worker.py: TensorFlow is not installed; pip install -e '.[bench]' "
              "(tensorflow-cpu)", file=sys.stderr)
        return 2

    from _timing import check_close, checkout, devices_line, machine, spread

    t_start = time.perf_counter()
    print(f"# vs_tf_multi_worker.py: a worker's devices: {devices_line()}; {machine()}; "
          f"tensorflow {tf_version}; jaxmirror {checkout()}")
    print(f"# command: {shlex.join([os.path.relpath(sys.executable)] + sys.argv)}")
    print(f"# {args.rounds} rounds per layout (TF, jm in even rounds, jm, TF in odd), "
          f"{args.steps} timed steps per model per launch, warmup {args.warmup}, check "
          f"{args.check}; SGD lr {LR}, {NUM_BATCHES} host batches cycled, float32"
          + (" (--quick: noisy)" if args.quick else ""), flush=True)
    rows = []
    for w, d in layouts:
        times = {(f, m): [] for f in (TF, JM, FLOOR) for m in names}
        losses = {}
        for r in range(args.rounds):
            for m in names:  # between launches, no worker running
                times[FLOOR, m].append(floor_loop(m, args.steps, args.warmup))
            for f in ((TF, JM) if r % 2 == 0 else (JM, TF)):
                t0 = time.perf_counter()
                for m, (seconds, loss) in one_launch(f, w, names, args).items():
                    times[f, m].append(seconds)
                    losses[f, m] = loss  # every launch computes the same losses
                print(f"  {w}x{d} round {r} {f}: launch {time.perf_counter() - t0:.0f} s",
                      file=sys.stderr, flush=True)
        for m in names:
            how = check_close(f"{w}x{d} {m}: jaxmirror's first losses vs TF's",
                              np.float64(losses[JM, m][:args.check]),
                              np.float64(losses[TF, m][:args.check]), gpu_rtol=RTOL,
                              cpu_rtol=RTOL, platform="cpu")
            ratios = [a / b for a, b in zip(times[TF, m], times[JM, m])]
            rows.append((f"{w} x {d}", m, times[TF, m], times[JM, m], times[FLOOR, m], ratios, how,
                         max_rel(losses[JM, m][:args.check], losses[TF, m][:args.check]),
                         max_rel(losses[JM, m], losses[TF, m]), len(losses[TF, m])))

    print(f"\nms per step: median over {args.rounds} launches (min-max) of the slowest worker's "
          f"whole loop (next, step, reduce, float); ratio TF / jaxmirror within each round, "
          f"median [min–max]. Losses: the first {args.check} steps (asserted) and all steps "
          "(reported), max rel diff jaxmirror vs TF. Compute floor: the same step on the whole "
          "global batch as one plain jax.jit in one process on 1 CPU device, no workers (the "
          "cores the workers share); TF / floor bounds the ratio any layout can reach.\n")
    print("| layout | model | TF ms/step | jaxmirror ms/step | ratio TF / jaxmirror "
          "| compute floor ms/step | TF / floor | first losses | all losses |")
    print("|---|---|---|---|---|---|---|---|---|")
    for layout, m, t_tf, t_jm, t_floor, ratios, how, first, every, n in rows:
        sizes, batch = MODELS[m]
        cell = [f"{statistics.median(t) * 1e3:.2f} ({min(t) * 1e3:.2f}-{max(t) * 1e3:.2f})"
                for t in (t_tf, t_jm, t_floor)]
        print(f"| {layout} | {m} {list(sizes)} batch {batch} | {cell[0]} | {cell[1]} "
              f"| {spread(ratios)} | {cell[2]} "
              f"| {statistics.median(t_tf) / statistics.median(t_floor):.1f} "
              f"| {first:.1e} ({how}) | {every:.1e} ({n} steps) |")
    medians = {(layout, m): statistics.median(ratios) for layout, m, _, _, _, ratios, *_ in rows}
    met = all(v >= GOAL for v in medians.values())
    print(f"\nGoal, jaxmirror ≥ {GOAL:g}× faster per step than TF's MultiWorkerMirroredStrategy "
          f"(median ratio, every layout and model): {'met' if met else 'NOT met'} ("
          + ", ".join(f"{lo} {m}: {v:.2f}×" for (lo, m), v in medians.items()) + ").")
    if args.breakdown_rounds:
        breakdown(args)
    print(f"\n# total {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    return 0


def breakdown(args, workers: int = 2, steps: int = 100) -> None:
    """Print ``breakdown_worker``'s split, each worker's column."""
    import jaxmirror

    results = jaxmirror.launch.run(breakdown_worker, workers=workers, devices_per_worker=1,
                                   args=(steps, args.breakdown_rounds), timeout=args.timeout)
    print(f"\n# where jaxmirror's step goes: small model, {workers} x 1, median over "
          f"{args.breakdown_rounds} rounds of {steps} steps, parts in rotating order")
    print("| part | " + " | ".join(f"worker {i} ms/step" for i in range(workers)) + " |")
    print("|---|" + "---|" * workers)
    for name in results[0]:
        print(f"| {name} | " + " | ".join(f"{r[name] * 1e3:.3f}" for r in results) + " |")


if __name__ == "__main__":
    sys.exit(main())
