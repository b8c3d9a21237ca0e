#!/usr/bin/env python
"""TensorFlow's MirroredStrategy training loop against the same loop on jaxmirror.

The same data-parallel training runs in one process through each framework's own loop, as users
write it. Both loops start from the same params, read the same batches in the same order, and
take turns while they are timed.

  (TF) TF's "Custom training with tf.distribute.Strategy" tutorial. Before TF starts, 4 logical CPU
       devices are made with ``tf.config.set_logical_device_configuration`` (max(--devices) if
       that is larger). Then ``strategy = tf.distribute.MirroredStrategy(["/cpu:0", ...][:N])``
       and ``tf.Variable``s in ``strategy.scope()``. The data is
       ``dist_ds = strategy.experimental_distribute_dataset(
       tf.data.Dataset.from_tensor_slices((X, Y)).batch(256).repeat())`` and
       ``it = iter(dist_ds)``. The step is ``@tf.function def train_step(dist_inputs)``, which
       runs ``strategy.run(step_fn, args=(dist_inputs,))`` and returns
       ``strategy.reduce(SUM, per_replica_loss, axis=None)``. ``step_fn`` takes the gradient of
       ``tf.nn.compute_average_loss(per_example_loss, global_batch_size=256)`` with a
       ``GradientTape``, all-reduces it with
       ``tf.distribute.get_replica_context().all_reduce(SUM, grads)`` and applies SGD with
       ``v.assign_sub(lr * g)``. Per step: ``total += float(train_step(next(it)))``.
  (jm) jaxmirror's public API, the loop of ``tf_loop.py``. ``strategy =
       jaxmirror.MirroredStrategy(jax.devices()[:N])`` and ``jaxmirror.Variable``s in
       ``strategy.scope()``. The step is ``train_step = strategy.function(step_fn)``: it reads
       the variables, takes ``jax.value_and_grad`` of the replica's loss, all-reduces the grads
       with ``jaxmirror.get_replica_context().all_reduce("SUM", grads)``, calls
       ``v.assign(w - lr * g)`` and returns the loss. The data is ``iterator =
       iter(strategy.experimental_distribute_dataset(lambda: itertools.cycle(batches)))``. Per
       step: ``x, y = next(iterator); loss = train_step(x, y); total +=
       float(strategy.reduce("SUM", loss, axis=None))``.

Workload, as in ``tf_loop.py``'s "tiny": an MLP 32 -> 64 -> 10 with global batch 256, softmax
cross-entropy with integer labels, and each replica's loss = the sum over its rows / the global
batch (so the SUM over replicas is the batch mean). SGD with lr 0.1 is written by hand. The
data is 16 host NumPy global batches, cycled (TF sees their concatenation, batched by 256:
the same batches in the same order). Everything is float32 in both loops.

Method, per N (replicas on the first N devices; JAX gets 8 simulated CPU devices through
``XLA_FLAGS``, which the script sets before importing JAX, unless ``JAX_PLATFORMS`` names
another platform: ``JAX_PLATFORMS=cuda ... --devices 1`` puts jaxmirror on one GPU, TF stays on
the CPU). Each N runs in a process of its own
(this script again, with a hidden ``--worker N``) in which both loops are built and alternate: in
TF a second MirroredStrategy over a different number of CPU devices in the same process fails
(its default ``CollectiveAllReduce`` numbers its groups from 1 in every strategy, and the
collective executor refuses a group key reused with another size). The first
``--check`` steps of each run one at a time (they trace and compile). Their losses must agree
(``assert_allclose``, rtol 1e-4). Then come ``--warmup`` untimed steps each, and ``--rounds``
rounds. Each round times ``--steps`` steps of each loop (``perf_counter`` around them, GC off)
in the order TF, jm in even rounds and jm, TF in odd ones. Neither step may trace again while
timed. The table gives the per-step medians over rounds, and the ratio TF / jaxmirror taken
within each round as median [min-max].

Both loops always run the same number of steps on the same batches, but over thousands of steps
float32 rounding differences between the two (TF's oneDNN kernels sum in another order than
XLA's) grow along the training trajectory: the params differ by about 1e-7 after 100 steps,
3e-5 after 500 and 6e-3 after 2000. So the rounds' summed losses and the params at the end are
reported, not asserted. What is asserted after timing: jaxmirror's variables are set to TF's
params (``Variable.assign`` outside a step), then ``--check`` more steps of each run one at a
time, and their losses must agree again (rtol 1e-4): both loops still take the same step on the
same batch.

Threads: TF's and XLA's defaults (TF's inter- and intra-op pools use all host cores, as does
JAX's CPU client). This is the fair choice: each framework runs as a user gets it. Only TF's C++
info logging is turned down (``TF_CPP_MIN_LOG_LEVEL=2`` unless set; TF 2.21 still prints its
oneDNN notice at import); oneDNN stays at its default.

Not measured: TF's faster variant from the same tutorial, ``next(iterator)`` inside the
``tf.function`` (the iterator passed in); it saves TF about a fifth of a step here at N = 2.

TensorFlow is an optional extra: ``pip install -e '.[bench]'`` (``tensorflow-cpu``).

Run from the repository root:
    .venv/bin/python benchmarks/vs_tensorflow.py                  # N = 2, 4 (about 40 s)
    .venv/bin/python benchmarks/vs_tensorflow.py --quick          # a smoke run, noisy
    .venv/bin/python benchmarks/vs_tensorflow.py --append         # also add to RESULTS.md
"""

from __future__ import annotations

import os

from _platform import simulated_cpu_devices  # noqa: E402  (before JAX; CPU unless JAX_PLATFORMS)

_FLAG = simulated_cpu_devices(8)  # JAX's side; TF always on CPU (logical devices, below)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse, datetime, gc, importlib.metadata, importlib.util, itertools  # noqa: E401,E402
import json, platform, shlex, statistics, subprocess, sys, time  # noqa: E401,E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxmirror  # noqa: E402
from _timing import checkout, mlp, spread  # noqa: E402  (shared with the other scripts)
from _timing import check_close, devices_line, too_few_devices  # noqa: E402

GLOBAL_BATCH = 256
SIZES = (32, 64, 10)
LR = 0.1
NUM_BATCHES = 16  # distinct host global batches, cycled through
GOAL = 3.0  # the ratio TF / jaxmirror per step the project aims at
TF, JM = "TF", "jaxmirror"
HERE = os.path.dirname(os.path.abspath(__file__))
MARK = "@@vs_tensorflow result@@ "  # a worker's result line on its stdout


def host_data(seed: int = 0):
    """The initial params (NumPy, float32) and the 16 host global batches, as in tf_loop.py."""
    rng = np.random.default_rng(seed)
    params = {name: value for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])) for name, value
              in ((f"w{i}", (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)),
                  (f"b{i}", np.zeros((b,), np.float32)))}
    batches = [(rng.standard_normal((GLOBAL_BATCH, SIZES[0])).astype(np.float32),
                rng.integers(0, SIZES[-1], GLOBAL_BATCH).astype(np.int32))
               for _ in range(NUM_BATCHES)]
    return params, batches


def import_tensorflow(num_logical: int):
    """Import TF and split its CPU into ``num_logical`` logical devices (before TF starts)."""
    try:
        import tensorflow as tf
    except ImportError:
        print("TensorFlow is not installed: pip install -e '.[bench]' (tensorflow-cpu)",
              file=sys.stderr)
        raise SystemExit(2)
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(num_logical)])
    return tf


def tf_loop(tf, n: int, params, batches):
    """The tutorial's loop on TF's MirroredStrategy: ``loop(k)`` runs k steps, the summed loss."""
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    with strategy.scope():
        variables = {k: tf.Variable(v, name=k) for k, v in params.items()}
    names = list(variables)

    x_all = np.concatenate([x for x, _ in batches])
    y_all = np.concatenate([y for _, y in batches])
    dataset = tf.data.Dataset.from_tensor_slices((x_all, y_all)).batch(GLOBAL_BATCH).repeat()
    it = iter(strategy.experimental_distribute_dataset(dataset))

    def model(x):
        h = x
        for i in range(len(names) // 2):
            h = tf.matmul(h, variables[f"w{i}"]) + variables[f"b{i}"]
            if i < len(names) // 2 - 1:
                h = tf.nn.relu(h)
        return h

    def step_fn(inputs):
        x, y = inputs
        with tf.GradientTape() as tape:
            per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=model(x))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, [variables[k] for k in names])
        grads = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, grads)
        for k, g in zip(names, grads):
            variables[k].assign_sub(LR * g)
        return loss

    @tf.function
    def train_step(dist_inputs):
        per_replica_loss = strategy.run(step_fn, args=(dist_inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_loss, axis=None)

    def loop(k: int) -> float:
        total = 0.0
        for _ in range(k):
            total += float(train_step(next(it)))
        return total

    def read_params():
        out = {}
        for k, v in variables.items():
            copies = [np.asarray(c) for c in strategy.experimental_local_results(v)]
            for c in copies[1:]:  # the mirrors must stay equal
                np.testing.assert_array_equal(c, copies[0], err_msg=f"TF N={n}: {k}'s mirrors")
            out[k] = copies[0]
        return out

    loop.params = read_params
    loop.counts = lambda: (train_step.experimental_get_tracing_count(),)
    loop.cross_device_ops = type(getattr(strategy.extended, "_cross_device_ops", None)).__name__
    return loop


def replica_loss(params, x, y):
    """This replica's rows' summed loss / the global batch: summed over replicas, the mean."""
    return optax.softmax_cross_entropy_with_integer_labels(mlp(params, x), y).sum() / GLOBAL_BATCH


def jaxmirror_loop(n: int, params, batches):
    """The same loop on jaxmirror (public API, as tf_loop.py): ``loop(k)``, the summed loss."""
    strategy = jaxmirror.MirroredStrategy(jax.devices()[:n])
    with strategy.scope():
        variables = {k: jaxmirror.Variable(v, name=k) for k, v in params.items()}

    def step_fn(x, y):
        values = {k: v.read_value() for k, v in variables.items()}
        loss, grads = jax.value_and_grad(replica_loss)(values, x, y)
        grads = jaxmirror.get_replica_context().all_reduce("SUM", grads)
        for k, v in variables.items():
            v.assign(values[k] - LR * grads[k])
        return loss

    train_step = strategy.function(step_fn)
    iterator = iter(strategy.experimental_distribute_dataset(lambda: itertools.cycle(batches)))

    def loop(k: int) -> float:
        total = 0.0
        for _ in range(k):
            x, y = next(iterator)
            loss = train_step(x, y)
            total += float(strategy.reduce("SUM", loss, axis=None))
        return total

    def set_params(values):
        for k, v in variables.items():
            v.assign(values[k])

    loop.params = lambda: {k: np.asarray(v.read_value()) for k, v in variables.items()}
    loop.set_params = set_params
    loop.counts = lambda: (getattr(train_step, "trace_count", None),
                           getattr(train_step, "compile_count", None))
    return loop


def max_rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.abs(b)))


def bench(tf, n: int, args) -> dict:
    params, batches = host_data()
    t0 = time.perf_counter()
    loops = {TF: tf_loop(tf, n, params, batches), JM: jaxmirror_loop(n, params, batches)}

    # The first steps one at a time: they trace and compile; their losses must agree.
    losses = {}
    for name, loop in loops.items():
        t1 = time.perf_counter()
        losses[name] = [loop(1) for _ in range(args.check)]
        loop.first_steps_s = time.perf_counter() - t1
    # TF's oneDNN kernels and XLA sum in other orders, on any platform: rtol 1e-4 on CPU too.
    check_close(f"N={n}: jaxmirror's first losses vs TF's", losses[JM], losses[TF],
                gpu_rtol=1e-4, cpu_rtol=1e-4)
    for loop in loops.values():
        loop(args.warmup)
    warm_counts = {name: loop.counts() for name, loop in loops.items()}
    setup_s = time.perf_counter() - t0

    times = {name: [] for name in loops}
    totals = {name: [] for name in loops}

    def one(name):
        t = time.perf_counter()
        totals[name].append(loops[name](args.steps))
        times[name].append((time.perf_counter() - t) / args.steps)

    gc.collect()
    gc.disable()
    try:
        for r in range(args.rounds):
            for name in ((TF, JM) if r % 2 == 0 else (JM, TF)):
                one(name)
    finally:
        gc.enable()

    for name, loop in loops.items():
        assert loop.counts() == warm_counts[name], (
            f"N={n}: {name}'s step traced or compiled again while timed: "
            f"{warm_counts[name]} -> {loop.counts()}")
    p_tf, p_jm = loops[TF].params(), loops[JM].params()
    params_diff = max(float(np.max(np.abs(p_jm[k] - p_tf[k]))) for k in p_tf)
    # Re-synced, the next steps (same batches) must agree again.
    loops[JM].set_params(p_tf)
    synced = {name: [loop(1) for _ in range(args.check)] for name, loop in loops.items()}
    check_close(f"N={n}: losses after re-syncing the params, jm vs TF", synced[JM], synced[TF],
                gpu_rtol=1e-4, cpu_rtol=1e-4)
    return {"n": n, "seconds_per_step": times, "tensorflow": tf.__version__,
            "ratio": [a / b for a, b in zip(times[TF], times[JM])],
            "losses_max_rel_diff": max_rel(losses[JM], losses[TF]),
            "synced_losses_max_rel_diff": max_rel(synced[JM], synced[TF]),
            "totals_max_rel_diff": max_rel(totals[JM], totals[TF]),
            "params_max_abs_diff": params_diff, "setup_s": setup_s,
            "first_steps_s": {name: loop.first_steps_s for name, loop in loops.items()},
            "cross_device_ops": loops[TF].cross_device_ops}


def table(results, args) -> list[str]:
    lines = [
        f"µs/step: median over {args.rounds} rounds of {args.steps} steps of the whole loop "
        "(next, step, reduce, float); ratio TF / jaxmirror taken within each round: "
        "median [min–max]. "
        f"Losses, max rel diff jm vs TF: of the first {args.check} steps, one by one, and of "
        f"{args.check} steps after timing with jaxmirror's params set to TF's (both asserted, "
        "rtol 1e-4); of the rounds' sums while timed, and the params' largest abs diff at the end "
        "(float32 drift along thousands of steps; reported only).",
        "",
        "| N | steps × rounds | TF µs/step | jaxmirror µs/step | ratio TF/jaxmirror "
        "| losses: first steps; re-synced | round sums | params at the end |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        med = {k: statistics.median(v) * 1e6 for k, v in r["seconds_per_step"].items()}
        lines.append(
            f"| {r['n']} | {args.steps} × {args.rounds} | {med[TF]:.1f} | {med[JM]:.1f} "
            f"| {spread(r['ratio'])} | {r['losses_max_rel_diff']:.1e}; "
            f"{r['synced_losses_max_rel_diff']:.1e} | {r['totals_max_rel_diff']:.1e} "
            f"| {r['params_max_abs_diff']:.1e} |")
    medians = [statistics.median(r["ratio"]) for r in results]
    met = all(m >= GOAL for m in medians)
    lines += ["", f"Goal, jaxmirror ≥ {GOAL:g}× faster per step at every N (median ratio): "
              + ("met" if met else "NOT met") + " ("
              + ", ".join(f"N={r['n']}: {m:.2f}×" for r, m in zip(results, medians)) + ")."]
    return lines


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def tf_version() -> str | None:
    """The installed TensorFlow's version, without importing it; None if it is not installed."""
    if importlib.util.find_spec("tensorflow") is None:
        return None
    for dist in ("tensorflow-cpu", "tensorflow", "tensorflow-intel", "tensorflow-macos"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return "unknown"


def worker(n: int, args) -> int:
    """One N in this process: both loops, alternating; the result as one JSON line on stdout."""
    tf = import_tensorflow(max(4, n))
    result = bench(tf, n, args)
    result["tf_threads"] = (tf.config.threading.get_inter_op_parallelism_threads(),
                            tf.config.threading.get_intra_op_parallelism_threads())
    print(MARK + json.dumps(result), flush=True)
    return 0


def run_worker(n: int, args) -> dict | None:
    """Run ``--worker n`` in a fresh process (stderr passes through); its result, or None."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(n)]
    for name in ("rounds", "steps", "warmup", "check"):
        cmd += [f"--{name}", str(getattr(args, name))]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    found = [line[len(MARK):] for line in proc.stdout.splitlines() if line.startswith(MARK)]
    other = "".join(line + "\n" for line in proc.stdout.splitlines() if not line.startswith(MARK))
    sys.stdout.write(other)
    if proc.returncode != 0 or not found:
        print(f"the worker for N={n} failed (exit {proc.returncode})", file=sys.stderr)
        return None
    return json.loads(found[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", nargs="+", default=["2", "4"],
                    help="replica counts, space- or comma-separated, at most 8 (default: 2 4)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="timed rounds; even, so both orders come equally often (default 20; "
                         "--quick 4)")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per round per loop (default 100; --quick 10)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps per loop after the check (default 20; --quick 3)")
    ap.add_argument("--check", type=int, default=None,
                    help="first steps whose losses must agree (they also trace and compile; "
                         "default 8; --quick 3)")
    ap.add_argument("--quick", action="store_true", help="a smoke run of a few seconds; noisy")
    ap.add_argument("--append", action="store_true",
                    help="append a section with the date, machine, command and table to "
                         "--results")
    ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"),
                    help="the file --append writes to (default: benchmarks/RESULTS.md)")
    ap.add_argument("--json", metavar="PATH", help="write the raw numbers here")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    defaults = {"rounds": (20, 4), "steps": (100, 10), "warmup": (20, 3), "check": (8, 3)}
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    try:
        ns = [int(s) for d in args.devices for s in d.split(",") if s]
    except ValueError:
        ap.error(f"--devices takes integers, got {args.devices}")
    if not ns or min(ns) < 1 or max(ns) > 8:
        ap.error("--devices: replica counts from 1 to 8")
    if min(args.rounds, args.steps, args.check) < 1 or args.warmup < 0:
        ap.error("--rounds, --steps and --check must be at least 1, --warmup at least 0")
    problem = too_few_devices(max(ns + [args.worker or 0]), _FLAG)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if args.worker is not None:
        return worker(args.worker, args)

    t_start = time.perf_counter()
    tf_ver = tf_version()
    if tf_ver is None:
        print("TensorFlow is not installed: pip install -e '.[bench]' (tensorflow-cpu)",
              file=sys.stderr)
        return 2
    exe = os.path.relpath(sys.executable)
    command = shlex.join([exe if not exe.startswith("..") else sys.executable] + sys.argv)
    commit = checkout()
    machine = (f"{os.cpu_count()} host cores ({cpu_model()}), jax {jax.__version__} "
               f"({devices_line()}), tensorflow "
               f"{tf_ver} (max(4, N) logical CPU devices), numpy {np.__version__}, Python "
               f"{platform.python_version()}")
    print(f"# TF MirroredStrategy vs jaxmirror, the tutorial's training loop: {machine}")
    print(f"# command: {command}")
    print(f"# jaxmirror: {jaxmirror.__file__} ({commit})")
    print(f"# tiny: global batch {GLOBAL_BATCH}, MLP {' -> '.join(map(str, SIZES))}, SGD lr {LR}, "
          f"{NUM_BATCHES} host batches cycled, float32")
    print(f"# one process per N, both loops in it; rounds alternate TF, jm / jm, TF; "
          f"{args.rounds} rounds of {args.steps} steps, warmup {args.warmup}, losses checked over "
          f"the first {args.check} steps" + (" (--quick: noisy)" if args.quick else ""))
    print(flush=True)

    results = []
    for n in ns:
        t0 = time.perf_counter()
        r = run_worker(n, args)
        if r is None:
            return 1
        results.append(r)
        print(f"  done N={n} in {time.perf_counter() - t0:.1f}s (build, trace and first "
              f"{args.check} steps: {r['setup_s']:.1f}s; TF's cross-device ops "
              f"{r['cross_device_ops']}, TF threads inter/intra {r['tf_threads']}, 0 = default): "
              f"TF/jm {statistics.median(r['ratio']):.2f}", file=sys.stderr, flush=True)

    lines = table(results, args)
    print("\n".join(lines))
    total_s = time.perf_counter() - t_start
    print(f"\n# total {total_s:.0f} s", file=sys.stderr)

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "jaxmirror_file": jaxmirror.__file__,
                       "jaxmirror_checkout": commit, "machine": machine, "args": vars(args),
                       "results": results}, f, indent=1)
    if args.append:
        today = datetime.date.today().isoformat()
        section = [
            "", f"# Results: TensorFlow MirroredStrategy vs jaxmirror ({today})", "",
            f"Measured on {today} with `benchmarks/vs_tensorflow.py` (its docstring describes the "
            f"two loops), jaxmirror {commit}. Machine: {os.cpu_count()} host cores "
            f"({cpu_model()}), {platform.system()} {platform.machine()}; jax/jaxlib "
            f"{jax.__version__}, tensorflow {results[0]['tensorflow']}, numpy {np.__version__}, "
            f"Python {platform.python_version()}. TF's cross-device ops: "
            f"{results[0]['cross_device_ops']}; threads: both frameworks' defaults. The run took "
            f"{total_s:.0f} s.", "", "```", command, "```", "",
            *lines, ""]
        with open(args.results, "a") as f:
            f.write("\n".join(section))
        print(f"# appended to {args.results}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
