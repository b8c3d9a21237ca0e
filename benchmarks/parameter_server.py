#!/usr/bin/env python
"""Parameter-server closure overhead and time to a target loss, against ``MirroredStrategy``.

``ParameterServerStrategy`` on Ray (``RayClusterResolver(W, --ps)``, ``--ps`` parameter servers,
the variable split over them by ``FixedShardsPartitioner(--ps)``), for each W in ``--workers``,
with a ``ClusterCoordinator`` (defaults: ``max_in_flight`` 2, ``max_closures_per_call`` 8),
once with ``fresh_reads=True`` (the default, TF's: each closure starts from the servers' values
and sends its changes at its end) and once with ``fresh_reads=False`` (a call's closures send
their changes together); and once more with ``fresh_reads=True`` and the workers' fast paths off
(``JAXMIRROR_PS_FAST_PATHS=0``: one ``assign`` per loaded variable instead of a compiled
load), unless ``--no-slow-path``:

  (trivial) ``noop()``: a function that touches no variable and returns ``None``;
  (step)    TF's PS step on a noise-free linear regression (16 features, batch 64, lr 0.1):
            ``strategy.run(replica_fn, args=(x, y))`` with ``replica_fn`` taking
            ``jax.value_and_grad`` of ``mean((x @ w - y) ** 2)`` at ``w.read_value()`` and doing
            ``w.assign_sub(lr * g)``; ``w`` (16 float32) is sharded over the parameter servers,
            so every closure pulls from and pushes to each of them. The rates use noisy
            targets (batches cycled), so ``w`` keeps changing and every closure pushes.
  (nnx)     the same regression as TF's NNX habit: an ``nnx.Linear(16, 1)`` and its
            ``nnx.Optimizer`` (adam) built by ``strategy.init`` (their 8 state arrays on the
            parameter servers), ``strategy.run(train_step, args=(model, opt, x, y))``.

Method, per W: one ``RayClusterResolver`` and strategy (fresh actors); warm-up (not timed in the
table's rates, reported apart): 4 trivial closures per worker (actor start, JAX import), then 4
step closures per worker (the step's compile on each worker). Then ``--rounds`` rounds, the order
of the two kinds alternating, each timing ``--closures`` closures of one kind scheduled then
``join()``ed: per-closure overhead = wall / n, closures/s = n / wall (medians over rounds). The
issue's goal: a step closure in <= 1 ms (>= 1000 closures/s) with 2 workers.

Time to target: from ``w = 0``, train until the full-data loss (1024 rows, read on the
coordinator with ``w.numpy()``) is below ``--target``; checked every ``--chunk`` steps, so steps
are multiples of it. PS (async): ``w.assign(0)`` on the coordinator, then 2 read-only closures
per worker (not timed: a worker's first closure after that assign reads the value its previous
closure's push brought back, from before the assign; the table counts such stale reads), then
schedule ``--chunk`` step closures (batches of 64 rows, cycling over the 16 batches),
``join()``, read ``w``. Mirrored (sync, this process, ``--devices`` (2) simulated CPU devices, or
GPUs with ``JAX_PLATFORMS=cuda``; the Ray workers stay on one CPU device each): the same model and global batch (32 rows a replica, batches placed beforehand with
``experimental_distribute_values_from_function``), ``strategy.run(replica_fn, ...)`` with the
gradient all-reduced (MEAN) and ``w.assign_sub(lr * g)`` on a ``jaxmirror.Variable``. Both warm
(compiled) before the clock starts; ``--rounds`` tries each, medians.

Run from the repository root:
    .venv/bin/python benchmarks/parameter_server.py                     # W = 1, 2; ~30 s
    .venv/bin/python benchmarks/parameter_server.py --quick             # a smoke run, noisy
    .venv/bin/python benchmarks/parameter_server.py --closures 1000 --workers 2
"""

from __future__ import annotations

import os

from _platform import simulated_cpu_devices  # noqa: E402  (before JAX; CPU unless JAX_PLATFORMS)

_FLAG = simulated_cpu_devices(2)  # the MirroredStrategy baseline; workers drop it

import argparse, functools, io, pathlib, statistics, sys, time  # noqa: E401,E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxmirror as jm  # noqa: E402
from jaxmirror.experimental.coordinator import ClusterCoordinator  # noqa: E402
from _timing import append_section, checkout, machine, too_few_devices  # noqa: E402  (shared)

RESULTS = pathlib.Path(__file__).with_name("RESULTS.md")
FEATURES, BATCH, NUM_BATCHES, LR = 16, 64, 16, 0.1
WARMUP_PER_WORKER = 4  # 2 x max_in_flight: every worker gets some
GOAL_MS = 1.0


def regression_data():
    """16 batches of 64 rows x 16 features, noise-free targets ``x @ w_true`` (time to target)
    and the same with noise (the rates: a step keeps changing ``w``, so it always pushes)."""
    rng = np.random.default_rng(0)
    w_true = rng.normal(size=(FEATURES,)).astype(np.float32)
    xs = rng.normal(size=(NUM_BATCHES, BATCH, FEATURES)).astype(np.float32)
    noise = rng.normal(size=(NUM_BATCHES, BATCH)).astype(np.float32)
    return xs, xs @ w_true, xs @ w_true + noise


def full_loss(w, xs, ys) -> float:
    w = np.asarray(w, np.float64).reshape(-1)
    return float(np.mean((xs.astype(np.float64) @ w - ys) ** 2))


def noop():
    return None


def timed_closures(coordinator, fn, args_of, n: int) -> float:
    """Seconds for ``n`` closures ``fn(*args_of(i))`` scheduled, then ``join()``ed."""
    t0 = time.perf_counter()
    for i in range(n):
        coordinator.schedule(fn, args=args_of(i))
    coordinator.join()
    return time.perf_counter() - t0


def train_to_target(run_chunk, read_w, xs, ys, args) -> tuple:
    """From ``w = 0`` (set by the caller): ``(seconds, steps, loss)`` until the full loss <
    ``args.target`` (``steps`` is ``None`` if ``args.max_steps`` came first)."""
    t0, steps, loss = time.perf_counter(), 0, float("inf")
    while steps < args.max_steps:
        run_chunk(steps, args.chunk)
        steps += args.chunk
        loss = full_loss(read_w(), xs, ys)
        if loss < args.target:
            return time.perf_counter() - t0, steps, loss
    return time.perf_counter() - t0, None, loss


def bench_ps(num_workers: int, fresh_reads: bool, args, xs, ys, noisy, fast=True) -> dict:
    """Closure rates and time to target on ``num_workers`` workers and ``args.ps`` servers
    (``fast``: the workers' fast paths, read from ``JAXMIRROR_PS_FAST_PATHS`` when the
    coordinator is made)."""
    out = {"workers": num_workers, "fresh_reads": fresh_reads, "fast": fast}
    os.environ["JAXMIRROR_PS_FAST_PATHS"] = "1" if fast else "0"
    t0 = time.perf_counter()
    resolver = jm.cluster_resolver.RayClusterResolver(num_workers, args.ps)
    try:
        strategy = jm.experimental.ParameterServerStrategy(
            resolver, variable_partitioner=jm.experimental.partitioners.FixedShardsPartitioner(
                args.ps))
        with strategy.scope():
            w = jm.Variable(np.zeros((FEATURES,), np.float32), name="w")
        assert len(getattr(w, "variables", [w])) == args.ps, f"w is not in {args.ps} shards: {w}"
        coordinator = ClusterCoordinator(strategy, fresh_reads=fresh_reads)

        def step(x, y):
            def replica_fn(x, y):
                loss, g = jax.value_and_grad(lambda w_: jnp.mean((x @ w_ - y) ** 2))(
                    w.read_value())
                w.assign_sub(LR * g)
                return loss
            return strategy.run(replica_fn, args=(x, y))

        model, opt = strategy.init(lambda: (m := nnx.Linear(FEATURES, 1, rngs=nnx.Rngs(0)),
                                            nnx.Optimizer(m, optax.adam(1e-3), wrt=nnx.Param)))

        def nnx_step(x, y):
            def train_step(model, opt, x, y):
                loss, grads = nnx.value_and_grad(
                    lambda m: jnp.mean((m(x)[:, 0] - y) ** 2))(model)
                opt.update(model, grads)
                return loss
            return strategy.run(train_step, args=(model, opt, x, y))

        def batch(i):
            return xs[i % NUM_BATCHES], noisy[i % NUM_BATCHES]

        warm = WARMUP_PER_WORKER * num_workers
        out["start_s"] = (timed_closures(coordinator, noop, lambda i: (), warm)
                          + (time.perf_counter() - t0))
        out["compile_s"] = timed_closures(coordinator, step, batch, warm)
        timed_closures(coordinator, nnx_step, batch, warm)
        kinds = {"trivial": (noop, lambda i: ()), "step": (step, batch),
                 "nnx": (nnx_step, batch)}
        times = {kind: [] for kind in kinds}
        for r in range(args.rounds):
            for kind in (list(kinds) if r % 2 == 0 else list(kinds)[::-1]):
                fn, fn_args = kinds[kind]
                times[kind].append(timed_closures(coordinator, fn, fn_args, args.closures))
        expected = warm + args.rounds * args.closures  # each NNX step counted exactly once
        assert int(opt.step[...]) == expected, f"opt.step {int(opt.step[...])} != {expected}"
        out["ms"] = {k: statistics.median(v) / args.closures * 1e3 for k, v in times.items()}
        out["ms_min"] = {k: min(v) / args.closures * 1e3 for k, v in times.items()}
        last = coordinator.schedule(step, args=batch(0)).fetch()
        assert np.isfinite(np.asarray(last)).all(), f"step loss {last!r}"

        def run_chunk(start, k):
            for i in range(start, start + k):
                coordinator.schedule(step, args=(xs[i % NUM_BATCHES], ys[i % NUM_BATCHES]))
            coordinator.join()

        def read():
            return w.read_value()

        out["to_target"], out["stale_reads"] = [], 0
        for _ in range(args.rounds):
            w.assign(np.zeros((FEATURES,), np.float32))
            assert full_loss(w.numpy(), xs, ys) > args.target
            # A worker's first closure after the coordinator's assign reads the value its last
            # push brought back (from before the assign): read-only closures, 2 per worker
            # (each worker gets some), use up those stale values before the clock starts.
            reads = [coordinator.schedule(read) for _ in range(2 * num_workers)]
            coordinator.join()
            out["stale_reads"] += sum(bool(np.any(np.asarray(rv.fetch()) != 0)) for rv in reads)
            out["to_target"].append(train_to_target(run_chunk, w.numpy, xs, ys, args))
    finally:
        resolver.shutdown()
    return out


def bench_mirrored(args, xs, ys) -> dict:
    """Time to target with ``MirroredStrategy`` on ``--devices`` (2) devices, same global batch."""
    strategy = jm.MirroredStrategy(jax.devices()[:args.devices])
    n = strategy.num_replicas_in_sync
    per = BATCH // n
    with strategy.scope():
        w = jm.Variable(np.zeros((FEATURES,), np.float32), name="w")
    batches = [strategy.experimental_distribute_values_from_function(
        lambda ctx, x=x, y=y: (x[ctx.replica_id_in_sync_group * per:][:per],
                               y[ctx.replica_id_in_sync_group * per:][:per]))
        for x, y in zip(xs, ys)]

    def replica_fn(x, y):
        loss, g = jax.value_and_grad(lambda w_: jnp.mean((x @ w_ - y) ** 2))(w.read_value())
        g = jm.get_replica_context().all_reduce("MEAN", g)
        w.assign_sub(LR * g)
        return loss

    def run_chunk(start, k):
        for i in range(start, start + k):
            strategy.run(replica_fn, args=batches[i % NUM_BATCHES])

    t0 = time.perf_counter()
    run_chunk(0, 2)
    w.numpy()
    out = {"compile_s": time.perf_counter() - t0, "to_target": []}
    for _ in range(args.rounds):
        w.assign(np.zeros((FEATURES,), np.float32))
        out["to_target"].append(train_to_target(run_chunk, w.numpy, xs, ys, args))
    return out


def target_cell(tries) -> tuple:
    """``(median seconds or None, steps text)`` over tries; a try that missed the target makes
    both ``None``/``not reached``."""
    if any(steps is None for _, steps, _ in tries):
        return None, "not reached (" + ", ".join(
            f"loss {loss:.2g}" for _, steps, loss in tries if steps is None) + ")"
    steps = [s for _, s, _ in tries]
    text = f"{statistics.median(steps):.0f}" + (
        f" [{min(steps)}–{max(steps)}]" if min(steps) != max(steps) else "")
    return statistics.median(t for t, _, _ in tries), text


def print_tables(results, mirrored, args, file=sys.stdout) -> None:
    p = functools.partial(print, file=file)
    p("| workers | fresh_reads | fast paths | trivial closures/s | trivial ms/closure "
      "| step closures/s | step ms/closure | ≤ 1 ms/step closure | NNX step ms/closure "
      "| actor start s | step compile s (warm-up) |")
    p("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ms = r["ms"]
        p(f"| {r['workers']} | {r['fresh_reads']} | {'on' if r['fast'] else 'off'} "
          f"| {1e3 / ms['trivial']:.0f} | {ms['trivial']:.2f} "
          f"(min {r['ms_min']['trivial']:.2f}) | {1e3 / ms['step']:.0f} | {ms['step']:.2f} "
          f"(min {r['ms_min']['step']:.2f}) | {'yes' if ms['step'] <= GOAL_MS else 'no'} "
          f"| {ms['nnx']:.2f} | {r['start_s']:.1f} | {r['compile_s']:.1f} |")
    p()
    p(f"Time to full-data loss < {args.target:g} from w = 0 (checked every {args.chunk} steps; "
      f"median of {args.rounds} tries; steps median [min–max]):")
    p()
    base, base_steps = target_cell(mirrored["to_target"])
    p("| training | seconds | steps | ms/step | seconds / Mirrored's |")
    p("|---|---|---|---|---|")
    rows = [(f"MirroredStrategy, {args.devices} replicas (sync; compile {mirrored['compile_s']:.1f} s)",
             mirrored["to_target"])]
    rows += [(f"ParameterServerStrategy, {r['workers']} worker(s), {args.ps} PS (async, "
              f"fresh_reads={r['fresh_reads']}" + ("" if r["fast"] else ", fast paths off")
              + ")", r["to_target"]) for r in results]
    for name, tries in rows:
        secs, steps = target_cell(tries)
        if secs is None:
            p(f"| {name} | n/a | {steps} | n/a | n/a |")
            continue
        per_step = statistics.median(t / s for t, s, _ in tries) * 1e3
        ratio = "n/a" if base is None else f"{secs / base:.1f}"
        p(f"| {name} | {secs:.3f} | {steps} | {per_step:.2f} | {ratio} |")
    p()
    stale = sum(r["stale_reads"] for r in results)
    if stale:
        p(f"Stale reads: {stale} closure(s) scheduled after the coordinator's `w.assign(0)` read "
          f"the value from before it (a worker's prefetched value; flushed before timing).")
        p()
    for r in results:
        slow = [q for q in results if q["workers"] == r["workers"] and q["fresh_reads"]
                and not q["fast"]]
        if r["fast"] and r["fresh_reads"] and slow:
            p(f"Fast paths, {r['workers']} worker(s), fresh reads: step closure "
              f"{r['ms']['step']:.2f} ms against {slow[0]['ms']['step']:.2f} ms with them off "
              f"({slow[0]['ms']['step'] / r['ms']['step']:.1f}x); NNX step "
              f"{r['ms']['nnx']:.2f} against {slow[0]['ms']['nnx']:.2f} ms.")
    two = [r for r in results if r["workers"] == 2 and r["fast"]]
    for r in two:
        ms = r["ms"]["step"]
        p(f"Goal (≤ {GOAL_MS:g} ms per step closure, ≥ {1e3 / GOAL_MS:.0f} closures/s, 2 "
          f"workers), fresh_reads={r['fresh_reads']}: {'met' if ms <= GOAL_MS else 'not met'} "
          f"({ms:.2f} ms, {1e3 / ms:.0f} closures/s).")
    if not two:
        p("Goal (2 workers): not measured (--workers has no 2).")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="1,2", help="worker counts, comma-separated")
    ap.add_argument("--ps", type=int, default=2, help="parameter servers (= shards of w)")
    ap.add_argument("--devices", type=int, default=2,
                    help="replicas of the MirroredStrategy baseline (simulated CPU devices; "
                         "GPUs with JAX_PLATFORMS=cuda); the Ray workers use one CPU device each")
    ap.add_argument("--closures", type=int, default=None,
                    help="closures per timed round, each kind (default 500; --quick 50)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="timed rounds per kind, and tries of the time to target (default 3; "
                         "--quick 1)")
    ap.add_argument("--target", type=float, default=1e-4, help="full-data loss to reach")
    ap.add_argument("--chunk", type=int, default=5, help="steps between loss checks")
    ap.add_argument("--max-steps", type=int, default=3000, help="give up after this many steps")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 50 closures, 1 round")
    ap.add_argument("--no-slow-path", action="store_true",
                    help="skip the run with the workers' fast paths off (JAXMIRROR_PS_FAST_PATHS=0)")
    ap.add_argument("--append", action="store_true", help="append the tables to --results")
    ap.add_argument("--results", type=pathlib.Path, default=RESULTS,
                    help="the file --append appends to")
    args = ap.parse_args(argv)
    if args.closures is None:
        args.closures = 50 if args.quick else 500
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    workers = [int(s) for s in args.workers.split(",")]
    if min(workers) < 1 or args.ps < 1 or args.closures < 1 or args.rounds < 1 or args.chunk < 1:
        ap.error("--workers, --ps, --closures, --rounds and --chunk must be >= 1")
    xs, ys, noisy = regression_data()
    t_start = time.perf_counter()
    # One Ray runtime for all configurations, started before JAX makes its threads (Ray forks):
    # this resolver starts it (it makes no actors); each configuration's own resolver connects
    # to it and kills only its own actors; this one stops Ray before the Mirrored baseline.
    ray_owner = jm.cluster_resolver.RayClusterResolver(1, 1)
    try:
        problem = too_few_devices(args.devices, _FLAG)
        if problem:
            print(problem, file=sys.stderr)
            return 2
        command = " ".join([os.path.basename(sys.executable)] + sys.argv)
        header = io.StringIO()
        h = functools.partial(print, file=header)
        h(f"# parameter-server closures and time to target: {machine()}")
        h(f"# command: {command}")
        h(f"# jaxmirror: {jm.__file__} ({checkout()})")
        h(f"# workers {workers}, {args.ps} PS, w ({FEATURES},) float32 in {args.ps} shards; "
          f"{args.closures} closures x {args.rounds} rounds per kind; batch {BATCH}, lr {LR}, "
          f"target {args.target:g}" + (" (--quick: noisy)" if args.quick else ""))
        print(header.getvalue(), flush=True)
        results = []
        configs = [(True, True), (False, True)] + ([] if args.no_slow_path else [(True, False)])
        for num_workers in workers:
            for fresh_reads, fast in configs:
                t0 = time.perf_counter()
                results.append(bench_ps(num_workers, fresh_reads, args, xs, ys, noisy, fast))
                print(f"  done PS W={num_workers} fresh_reads={fresh_reads} fast={fast} in "
                      f"{time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    finally:
        ray_owner.shutdown()
    t0 = time.perf_counter()
    mirrored = bench_mirrored(args, xs, ys)
    print(f"  done Mirrored in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    total = time.perf_counter() - t_start
    tables = io.StringIO()
    print_tables(results, mirrored, args, file=tables)
    print(tables.getvalue())
    print(f"# total {total:.0f} s", file=sys.stderr)
    if args.append:
        append_section(args.results, "parameter-server closures and time to target", command,
                       header.getvalue(), tables.getvalue(), total)
    return 0


if __name__ == "__main__":
    sys.exit(main())
