#!/usr/bin/env python
"""Fused steps (``strategy.function(fn, steps_per_execution=K)``) against one dispatch per step.

Both loops are TF's custom-training loop on jaxmirror (``tf_loop.py``'s tiny model: MLP
32 -> 64 -> 10, global batch 256, SGD written by hand on ``jaxmirror.Variable``s captured by
closure, gradients all-reduced in the step), over ``experimental_distribute_dataset`` of 16
host batches cycled:

  (single) per step ``loss = train_step(next(iterator))``,
           ``total += float(strategy.reduce("SUM", loss, axis=None))``;
  (fused)  per K steps ``losses = train_steps(iterator)`` (``steps_per_execution=K``: the K
           batches stacked on the host, moved in one transfer, the K steps in one program),
           ``total += float(strategy.reduce("SUM", losses, axis=None).sum())``;
  (hand)   the same K steps hand-written: the K host batches stacked and placed with one
           ``device_put``, ``jit(shard_map(lax.scan(step)))`` with a per-leaf ``psum`` of the
           gradients, params as the donated carry: the limit for a fused call.

Method, per N (replicas on the first N of 8 simulated CPU devices, or of the GPUs with
``JAX_PLATFORMS=cuda``) and K: both loops start from the same params; the first 2K steps'
losses and the variables after them must agree (the hand-written loop's too); then rounds
(``--rounds``) that time ``--steps`` steps of each loop (a multiple of K), rotating which goes
first, GC off. The table gives the per-step medians over rounds and the ratios single/fused and
fused/hand within a round: median [min-max]. After timing no step may have compiled again; the fused loop's variables are set to
the single loop's and K more steps of each must agree again. On CPU every check is bit for bit,
and the variables at the end of the timed rounds must be equal too (same batches, same order).
On a GPU the fused program (a scan) may fuse and reduce in another order than the single step:
the checks allow rtol 1e-4, atol 1e-6 (float32 drift over at most 2K = 100 SGD steps, from the
same params); the end of the timed rounds (hundreds of steps) is not compared there.

Run from the repository root:
    .venv/bin/python benchmarks/fused_steps.py                  # N = 1, 2, 4, 8; K = 10, 50
    .venv/bin/python benchmarks/fused_steps.py --quick          # a smoke run, noisy
    .venv/bin/python benchmarks/fused_steps.py --num-packs 1    # gradients in one all-reduce
"""

from __future__ import annotations

import os

from _platform import simulated_cpu_devices  # noqa: E402  (before JAX; CPU unless JAX_PLATFORMS)

_FLAG = simulated_cpu_devices(8)

import argparse, gc, itertools, platform, statistics, sys, time  # noqa: E401,E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxmirror  # noqa: E402
from _timing import check_close, checkout, devices_line, platform_of, spread  # noqa: E402
from _timing import too_few_devices  # noqa: E402  (shared)
from tf_loop import LR, MODELS, host_data, replica_loss  # noqa: E402

GLOBAL_BATCH = MODELS["tiny"][0]


def make_loop(devices, params, batches, k: int | None, num_packs: int | None = None,
              global_batch: int = GLOBAL_BATCH):
    """The loop on a fresh strategy: ``loop(steps)`` runs them, returns the steps' losses."""
    ops = None if num_packs is None else jaxmirror.NcclAllReduce(num_packs=num_packs)
    strategy = jaxmirror.MirroredStrategy(devices, cross_device_ops=ops)
    with strategy.scope():
        variables = {name: jaxmirror.Variable(v, name=name) for name, v in params.items()}

    def step_fn(batch):
        x, y = batch
        values = {name: v.read_value() for name, v in variables.items()}
        loss, grads = jax.value_and_grad(replica_loss)(values, x, y, global_batch)
        grads = jaxmirror.get_replica_context().all_reduce("SUM", grads)
        for name, v in variables.items():
            v.assign(values[name] - LR * grads[name])
        return loss

    iterator = iter(strategy.experimental_distribute_dataset(lambda: itertools.cycle(batches)))
    if k is None:
        step = strategy.function(step_fn)

        def loop(steps: int) -> list:
            return [float(strategy.reduce("SUM", step(next(iterator)), axis=None))
                    for _ in range(steps)]
    else:
        step = strategy.function(step_fn, steps_per_execution=k)

        def loop(steps: int) -> list:
            assert steps % k == 0
            out = []
            for _ in range(steps // k):
                out += np.asarray(strategy.reduce("SUM", step(iterator), axis=None)).tolist()
            return out

    loop.params = lambda: {name: np.asarray(v.numpy()) for name, v in variables.items()}
    loop.set_params = lambda values: [v.assign(values[name]) for name, v in variables.items()]
    loop.counts = lambda: (step.trace_count, step.compile_count)
    return loop


def handwritten_fused_loop(devices, params, batches, k: int):
    """What a JAX user writes for K steps per call: the K host batches stacked and placed with
    one ``device_put``, ``jit(shard_map(lax.scan(step)))`` with a per-leaf ``psum`` of the
    gradients and the loss, params as the carry (donated); the K losses summed on the host."""
    mesh = Mesh(np.array(devices), ("replica",))
    stacked, replicated = NamedSharding(mesh, P(None, "replica")), NamedSharding(mesh, P())

    def one(params, batch):
        loss, grads = jax.value_and_grad(replica_loss)(params, *batch, GLOBAL_BATCH)
        grads = jax.lax.psum(grads, "replica")
        return (jax.tree.map(lambda p, g: p - LR * g, params, grads),
                jax.lax.psum(loss, "replica"))

    steps = jax.jit(jax.shard_map(lambda p, x, y: jax.lax.scan(one, p, (x, y)), mesh=mesh,
                                  in_specs=(P(), P(None, "replica"), P(None, "replica")),
                                  out_specs=(P(), P()), check_vma=False), donate_argnums=0)
    state = {"params": jax.device_put(params, replicated)}
    it = itertools.cycle(batches)

    def loop(count: int) -> list:
        assert count % k == 0
        out = []
        for _ in range(count // k):
            chunk = [next(it) for _ in range(k)]
            x, y = jax.device_put((np.stack([b[0] for b in chunk]),
                                   np.stack([b[1] for b in chunk])), stacked)
            state["params"], losses = steps(state["params"], x, y)
            out += np.asarray(losses).tolist()
        return out

    loop.params = lambda: {name: np.asarray(v) for name, v in state["params"].items()}
    loop.set_params = lambda values: state.update(params=jax.device_put(values, replicated))
    return loop


def bench(n: int, k: int, args) -> dict:
    params, batches = host_data("tiny")
    devices = jax.devices()[:n]
    single = make_loop(devices, params, batches, None, args.num_packs)
    fused = make_loop(devices, params, batches, k, args.num_packs)
    hand = handwritten_fused_loop(devices, params, batches, k)
    # GPU tolerance: float32 rounding of two programs, over at most 2K = 100 SGD steps from the
    # same params (a real bug, e.g. a lost update or all-reduce, moves the loss by percents).
    tol = {"gpu_rtol": 1e-4, "gpu_atol": 1e-6}
    first = single(2 * k), fused(2 * k), hand(2 * k)
    how = check_close(f"N={n} K={k}: the first {2 * k} losses, fused vs single", first[1],
                      first[0], platform=platform_of(devices), **tol)
    check_close(f"N={n} K={k}: variables after {2 * k} steps, fused vs single", fused.params(),
                single.params(), platform=platform_of(devices), **tol)
    # The hand-written scan: another program (its loss psum, no variables), same arithmetic.
    hand_how = check_close(f"N={n} K={k}: the first {2 * k} losses, hand-written scan vs "
                           f"single", first[2], first[0], platform=platform_of(devices), **tol)
    counts = single.counts(), fused.counts()
    steps = max(k, args.steps // k * k)
    loops = {"single": single, "fused": fused, "hand": hand}
    times = {name: [] for name in loops}
    order = list(loops)
    gc.collect()
    gc.disable()
    try:
        for r in range(args.rounds):
            for name in order[r % 3:] + order[:r % 3]:  # each loop first as often
                loop = loops[name]
                t0 = time.perf_counter()
                loop(steps)
                times[name].append((time.perf_counter() - t0) / steps)
    finally:
        gc.enable()
    assert (single.counts(), fused.counts()) == counts, f"N={n} K={k}: compiled again"
    if platform_of(devices) == "cpu":  # same batches, same order: equal bits after every step
        check_close(f"N={n} K={k}: variables after timing, fused vs single", fused.params(),
                    single.params(), gpu_rtol=0.0, platform="cpu")
        check_close(f"N={n} K={k}: params after timing, hand-written scan vs single",
                    hand.params(), single.params(), gpu_rtol=0.0, platform="cpu")
    fused.set_params(single.params())  # from the same params again: K more steps each
    check_close(f"N={n} K={k}: {k} losses after timing, from the same variables", fused(k),
                single(k), platform=platform_of(devices), **tol)
    check_close(f"N={n} K={k}: variables {k} steps after that", fused.params(), single.params(),
                platform=platform_of(devices), **tol)
    return {"n": n, "k": k, "steps": steps, "times": times,
            "ratio": [s / f for s, f in zip(times["single"], times["fused"])],
            "vs_hand": [f / h for f, h in zip(times["fused"], times["hand"])],
            "counts": counts, "checked": how, "hand_checked": hand_how}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="1,2,4,8", help="replica counts, comma-separated")
    ap.add_argument("--k", default="10,50", help="steps per execution, comma-separated")
    ap.add_argument("--rounds", type=int, default=6, help="timed rounds (a multiple of 3)")
    ap.add_argument("--steps", type=int, default=200, help="steps per round per loop")
    ap.add_argument("--quick", action="store_true", help="3 rounds of 100 steps; noisy")
    ap.add_argument("--num-packs", type=int, default=None,
                    help="both loops with NcclAllReduce(num_packs=...) (default: the "
                         "strategy's own ops)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 3, 100
    ns = [int(s) for s in args.devices.split(",")]
    ks = [int(s) for s in args.k.split(",")]
    problem = too_few_devices(max(ns), _FLAG)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    command = " ".join([os.path.basename(sys.executable)] + sys.argv)
    print(f"# fused steps vs one dispatch per step: {devices_line()}, {os.cpu_count()} host "
          f"cores, jax {jax.__version__}, Python {platform.python_version()}")
    print(f"# command: {command}")
    print(f"# jaxmirror: {jaxmirror.__file__} ({checkout()})")
    print(f"# tiny MLP {' -> '.join(map(str, MODELS['tiny'][1]))}, global batch {GLOBAL_BATCH}; "
          f"{args.rounds} rounds, order rotating; cross-device ops: "
          + ("the default" if args.num_packs is None else f"NcclAllReduce({args.num_packs})"))
    print()
    results, t_start = [], time.perf_counter()
    for n in ns:
        for k in ks:
            t0 = time.perf_counter()
            results.append(bench(n, k, args))
            print(f"  done N={n} K={k} in {time.perf_counter() - t0:.1f}s", file=sys.stderr,
                  flush=True)
    print("| N | K | steps × rounds | one dispatch per step µs/step | fused µs/step "
          "| speed-up single/fused | hand-written scan µs/step | fused / hand-written "
          "| losses and params |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        med = {name: statistics.median(v) * 1e6 for name, v in r["times"].items()}
        print(f"| {r['n']} | {r['k']} | {r['steps']} × {args.rounds} | {med['single']:.1f} "
              f"| {med['fused']:.1f} | {spread(r['ratio'])} | {med['hand']:.1f} "
              f"| {spread(r['vs_hand'])} | agree: {r['checked']} "
              f"(hand-written: {r['hand_checked']}) |")
    print()
    print(f"# total {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
