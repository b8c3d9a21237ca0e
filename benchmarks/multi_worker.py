"""Multi-worker loop: jaxmirror against the same program hand-written for several processes.

Each layout (``--layouts``; default 2 workers x 2 devices, 4 workers x 1 device, and 1
process x 4 devices as information) is one group of workers started by ``jaxmirror.launch.run``
on loopback. In the same workers, in rotating order within each round, run:

  (jaxmirror) TF's custom loop under ``MultiWorkerMirroredStrategy``: per step
      ``next(iterator)`` of ``experimental_distribute_dataset``, the ``@strategy.run`` step
      (gradients all-reduced with ``get_replica_context().all_reduce("SUM", ...)``, SGD), and
      ``float(strategy.reduce("SUM", loss, axis=None))``.
  (hand-written) the same program written for several processes in plain JAX: the runtime
      ``jax.distributed.initialize`` on loopback from ``TF_CONFIG`` (in these workers the
      strategy has already started it: the same coordination service, reused), a global mesh
      of every process's devices, ``jax.jit(jax.shard_map(...))`` with ``jax.lax.psum`` of the
      gradients and of the loss, params a plain pytree, each process feeding its own rows of
      the global batch (``jax.make_array_from_process_local_data``), ``float(loss)``. Two
      forms: ``packed`` sums the gradients flattened into one buffer (``ravel_pytree``; gloo
      pays per operand, and jaxmirror packs across processes too), ``pytree`` psums the
      gradient pytree as it is (one operand per leaf).
  (packed') a second copy of the packed loop: the A/A control.

Same model, data (8 global batches, cycled), SGD (lr 0.1) and number of steps. Every worker's
losses of jaxmirror and packed' must equal the packed loop's (``_timing.check_close``: bit for
bit on CPU, rtol 1e-5 on a GPU); the pytree loop's agree within rtol 1e-4 (gloo adds each leaf
in another order than a packed buffer). Times are the slowest worker's per round (``--rounds``
rounds of ``--steps`` steps per loop, GC off); ratios are taken within a round (median
[min-max]). ``--devices D`` sets the layouts' total devices (default 4: 2xD/2, Dx1, 1xD); on
GPUs (``JAX_PLATFORMS=cuda``) only 1 x D runs (``--devices 1``: one GPU).

    .venv/bin/python benchmarks/multi_worker.py [--models small,wide,compute] [--quick]

``--alone``: also the packed loop in workers of its own (no strategy; JAX's own coordination
service), to show that sharing the workers does not slow it. ``--variant off`` (or ``off,
inline``): jaxmirror's loop without the per-step data agreement and the failure watch. ``--hlo``:
where a step's host time goes in each loop, and the collectives in each compiled program
(``XLA_FLAGS=--xla_dump_to``). Then (``--overhead-rounds``, ``--overhead-steps``) what issue 27's
per-step agreement on the data and failure watch cost: the small model's loop as users write it,
against the same loop with both switched off (``off``: batches still made on a thread; ``off,
inline``: made in ``next``, as before the agreement made the thread the default), one launch
per loop and round.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np

from _platform import simulated_cpu_devices
from _multi_worker_baseline import (LR, hand_join, hand_loop, host_batches, init_params,
                                    per_example_loss)

# The workers inherit JAX_PLATFORMS (cpu unless set); launch.run sets their CPU device counts.
_FLAG = simulated_cpu_devices(4)
ON_CPU = os.environ["JAX_PLATFORMS"].split(",")[0] in ("", "cpu")

MODELS = {  # name: (layer sizes, global batch, steps per round)
    "small": ([32, 64, 10], 256, 40),  # latency-bound: the collectives are the step
    "wide": ([256, 1024, 1024, 10], 512, 6),  # 1.3 M params: a 5 MB all-reduce per step
    "compute": ([256, 256, 256, 10], 4096, 6),  # compute-bound: 0.2 M params, big batch
}
JM, BASE, PACKED, PACKED2 = "jaxmirror", "hand-written", "packed", "packed'"


class _SameEverywhere:
    """A stand-in for the per-step exchange (``runtime.exchange.StepExchange``) that asks no
    other worker: valid here only because every worker reads the same batches."""

    def __init__(self, what, cancelled=None):
        import jax

        self._workers = jax.process_count()

    def share(self, value):
        return [value] * self._workers


def _switch_off(agreement=True, failure_watch=True):
    """The ``off`` variants: no per-step agreement on the data, no failure watch (its thread
    stopped, the step's records of its calls skipped)."""
    from jaxmirror.data import datasets
    from jaxmirror.runtime import watch

    if agreement:
        datasets.StepExchange = _SameEverywhere
    if failure_watch:
        watch.stop()
        for name in ("entering", "left", "dispatched"):
            setattr(watch, name, lambda *args: None)


def jaxmirror_loop(strategy, sizes, batch, variant="as written"):
    """TF's custom loop on ``strategy``: ``loop(k)`` runs k steps; ``loop.losses`` lists the
    reduced losses. ``variant`` ``off, inline`` makes the batches in ``next`` (no thread)."""
    import jax

    import jaxmirror as jm

    data = host_batches(sizes, batch)

    def forever():
        while True:
            yield from data

    input_options = jm.InputOptions(prefetch_thread=False) if variant == "off, inline" else None
    iterator = iter(strategy.experimental_distribute_dataset(forever, input_options))
    params = strategy.experimental_replicate(init_params(sizes))

    def loss_fn(p, x, y):
        return jm.compute_average_loss(per_example_loss(p, x, y), global_batch_size=batch)

    @strategy.run
    def step(p, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        grads = jm.get_replica_context().all_reduce("SUM", grads)
        return jax.tree.map(lambda a, g: a - LR * g, p, grads), loss

    def loop(k):
        nonlocal params
        for _ in range(k):
            x, y = next(iterator)
            params, loss = step(params, x, y)
            loop.losses.append(float(strategy.reduce("SUM", loss, axis=None)))

    def split(k, phases):  # loop(k), each part's seconds added to ``phases``
        nonlocal params
        for _ in range(k):
            t = [time.perf_counter()]
            x, y = next(iterator)
            t.append(time.perf_counter())
            params, loss = step(params, x, y)
            t.append(time.perf_counter())
            total = strategy.reduce("SUM", loss, axis=None)
            t.append(time.perf_counter())
            loop.losses.append(float(total))
            t.append(time.perf_counter())
            for part, a, b in zip(("next", "step call", "reduce call", "float"), t, t[1:]):
                phases[part] = phases.get(part, 0.0) + b - a

    loop.losses, loop.split = [], split
    return loop


def _rounds(loops, steps, rounds):
    """Seconds per step of each loop per round, GC off; the order rotates every round (each
    loop takes each place in a round equally often when ``rounds`` is a multiple of 4)."""
    import gc

    names = list(loops)
    times = {k: [] for k in names}
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                t0 = time.perf_counter()
                loops[name](steps)
                times[name].append((time.perf_counter() - t0) / steps)
    finally:
        gc.enable()
    return times


def paired(specs, rounds, warmup, variant="as written"):
    """One worker of a layout: for each model, jaxmirror's loop (``variant``: see ``worker``),
    the hand-written ones (packed, and psum of the pytree) and an A/A copy of the packed one,
    in the same process; returns (its devices, {model: (times per loop, losses per loop)})."""
    import jaxmirror as jm

    options = jm.experimental.CommunicationOptions(timeout_seconds=120)
    strategy = jm.MultiWorkerMirroredStrategy(communication_options=options)
    hand_join()  # the strategy started jax.distributed: this reuses it
    if variant != "as written":
        _switch_off()
    out = {}
    for name, sizes, batch, steps in specs:
        loops = {JM: jaxmirror_loop(strategy, sizes, batch, variant),
                 PACKED: hand_loop(sizes, batch, True),
                 BASE: hand_loop(sizes, batch), PACKED2: hand_loop(sizes, batch, True)}
        for loop in loops.values():
            loop(warmup)
        times = _rounds(loops, steps, rounds)
        out[name] = (times, {k: loop.losses for k, loop in loops.items()})
    return describe(), out


def alone(specs, rounds, warmup, variant=None):
    """The hand-written loop in workers of its own: plain JAX, no jaxmirror imported."""
    hand_join()
    out = {}
    for name, sizes, batch, steps in specs:
        loops = {PACKED: hand_loop(sizes, batch, True)}
        loops[PACKED](warmup)
        out[name] = (_rounds(loops, steps, rounds), {PACKED: loops[PACKED].losses})
    return None, out  # describe() would import jaxmirror (through _timing)


def worker(sizes, batch, steps, warmup, variant="as written"):
    """One worker's timed jaxmirror loop; returns (seconds per step, losses). ``variant``:
    ``as written`` (what users get), ``off`` (without the data agreement and the failure watch,
    the batches still made on a thread), ``off, inline`` (also made in ``next``: before issue
    27)."""
    import jaxmirror as jm

    options = jm.experimental.CommunicationOptions(timeout_seconds=120)
    strategy = jm.MultiWorkerMirroredStrategy(communication_options=options)
    if variant != "as written":
        _switch_off(agreement=variant != "watch off", failure_watch=variant != "agreement off")
    loop = jaxmirror_loop(strategy, sizes, batch, variant)
    loop(warmup)
    t0 = time.perf_counter()
    loop(steps)
    return (time.perf_counter() - t0) / steps, loop.losses


def describe():
    """A worker's devices, in the words of ``_timing.devices_line``."""
    from _timing import devices_line

    return devices_line()


def launch(fn, workers, devices, args=(), env=None):
    """``jaxmirror.launch.run``: on CPU each worker gets ``devices`` simulated CPU devices; on a
    GPU one worker sees the first ``devices`` GPUs (``CUDA_VISIBLE_DEVICES``, unless set)."""
    import jaxmirror as jm

    env = dict(env or {})
    if not ON_CPU and "CUDA_VISIBLE_DEVICES" not in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(devices)))
    return jm.launch.run(fn, workers=workers, devices_per_worker=devices if ON_CPU else None,
                         args=args, timeout=600, env=env or None)


def run_layout(workers, devices, sizes, batch, steps, warmup, variant="as written"):
    """jaxmirror's loop alone on ``workers`` x ``devices``: (slowest worker's seconds per step,
    losses), the workers' losses checked equal."""
    from _timing import check_close

    results = launch(worker, workers, devices, (sizes, batch, steps, warmup, variant))
    times = [t for t, _ in results]
    losses = results[0][1]
    for i, (_, other) in enumerate(results[1:], 1):
        # The reduced loss is the same all-reduce's result on every worker: equal bits on CPU;
        # on a GPU rtol 1e-6 only admits a reduction order that differs between processes.
        check_close(f"worker {i}'s losses vs worker 0's", other, losses, gpu_rtol=1e-6,
                    platform="cpu" if ON_CPU else "gpu")
    return max(times), losses  # a step ends when the slowest worker's does


def layouts_for(devices):
    """The default layouts for ``devices`` devices in all: ``[(workers, devices each)]``."""
    if not ON_CPU:  # one GPU per worker is not set up here
        return [(1, devices)]
    out = [(2, devices // 2)] if devices >= 2 and devices % 2 == 0 else []
    out += [(devices, 1)] if devices > 2 else []
    return out + [(1, devices)]


def _check_losses(where, outs):
    """Every worker's losses of every loop against worker 0's packed hand-written loop; what
    was checked, for the table."""
    from _timing import check_close

    how = {}
    for name in outs[0]:
        ref = outs[0][name][1][PACKED]
        for i, out in enumerate(outs):
            for loop, losses in out[name][1].items():
                label = f"{where} {name}: worker {i}'s {loop} losses vs the packed loop's"
                if loop == BASE:
                    # psum of the pytree: gloo sums each leaf as its own operand, so its
                    # elements are added in another order than in one packed buffer's ring
                    # (the last bits differ from the first steps on); SGD keeps it small.
                    how[BASE] = check_close(label, losses, ref, gpu_rtol=1e-4, cpu_rtol=1e-4)
                else:  # the same sums of the same packed buffer: equal bits on CPU
                    how[JM] = check_close(label, losses, ref, gpu_rtol=1e-5,
                                          platform="cpu" if ON_CPU else "gpu")
    return how


def _cell(xs):
    return f"{statistics.median(xs) * 1e3:.2f} ({min(xs) * 1e3:.2f}-{max(xs) * 1e3:.2f})"


def measure(layouts, specs, args):
    """Every layout's workers ``args.launches`` times (order reversed every launch): per
    (layout, model, loop) the slowest worker's seconds per step, one entry per round."""
    times, alone_times, how, devices = {}, {}, {}, None
    for n in range(args.launches):
        for w, d in layouts if n % 2 == 0 else layouts[::-1]:
            runs = [("paired", paired)] + ([("alone", alone)] if args.alone and w > 1 else [])
            for kind, fn in runs if n % 2 == 0 else runs[::-1]:
                results = launch(fn, w, d, (specs, args.rounds, args.warmup, args.variant))
                devices = devices or results[0][0]
                outs = [out for _, out in results]
                how.update(_check_losses(f"{w}x{d} {kind}", outs))
                sink = times if kind == "paired" else alone_times
                for name in outs[0]:
                    for loop, rounds in outs[0][name][0].items():
                        worst = [max(out[name][0][loop][r] for out in outs)
                                 for r in range(len(rounds))]
                        sink.setdefault((w, d, name, loop), []).extend(worst)
    return times, alone_times, how, devices


def table(layouts, specs, times, alone_times, how):
    """The markdown table: per model and layout, each loop's ms per step and the ratios."""
    from _timing import spread

    one = next(((w, d) for w, d in layouts if w == 1), None)
    head = ["model", "layout", "hand-written, packed ms/step",
            "hand-written, psum of the pytree ms/step", "jaxmirror ms/step",
            "jaxmirror / packed", "jaxmirror / pytree", "A/A packed' / packed"]
    head += ["packed alone ms/step"] if alone_times else []
    head += ["losses agree"] + ([f"jaxmirror / jaxmirror 1x{one[1]}"] if one else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    agree = f"jaxmirror, packed': {how.get(JM)}; pytree: {how.get(BASE)}"
    for name, sizes, batch, steps in specs:
        for w, d in layouts:
            t = {loop: times[(w, d, name, loop)] for loop in (JM, PACKED, BASE, PACKED2)}
            within = lambda a, b: spread([x / y for x, y in zip(t[a], t[b])])  # noqa: E731
            cells = [f"{name} {sizes} batch {batch}", f"{w} x {d}", _cell(t[PACKED]),
                     _cell(t[BASE]), _cell(t[JM]), within(JM, PACKED), within(JM, BASE),
                     within(PACKED2, PACKED)]
            if alone_times:
                got = alone_times.get((w, d, name, PACKED))
                cells.append(_cell(got) if got else "(1 process)")
            cells.append(agree)
            if one:
                ref = statistics.median(times[(*one, name, JM)])
                cells.append(f"{statistics.median(t[JM]) / ref:.2f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12, help="rounds per layout (rotating order)")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per loop per round (default per model: small 40, wide 6)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--models", default="small,wide", help=f"from {','.join(MODELS)}")
    ap.add_argument("--devices", type=int, default=4,
                    help="devices per layout: 2 x D/2, D x 1 and 1 x D (default 4); on GPUs "
                         "(JAX_PLATFORMS=cuda) only 1 x D, e.g. --devices 1")
    ap.add_argument("--layouts", default=None,
                    help="workers x devices each, e.g. 2x2,4x1,1x4 (default from --devices)")
    ap.add_argument("--launches", type=int, default=1,
                    help="times each layout's workers are started (rounds add up)")
    ap.add_argument("--alone", action="store_true",
                    help="also time the packed hand-written loop in workers of its own")
    ap.add_argument("--variant", default="as written", choices=["as written", "off", "off, inline"],
                    help="jaxmirror's loop as written, or without the per-step data agreement "
                         "and the failure watch (off; off, inline: batches made in next)")
    ap.add_argument("--hlo", action="store_true",
                    help="count each program's collectives and split jaxmirror's host time")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: small model, 2 x D/2 and 1 x D, 4 rounds of 10 steps")
    ap.add_argument("--overhead-rounds", type=int, default=2,
                    help="rounds of the agreement-and-watch comparison (0: skip it)")
    ap.add_argument("--overhead-steps", type=int, default=100)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.models = 4, "small"
        args.steps = args.steps or 10
        args.overhead_rounds, args.overhead_steps = min(args.overhead_rounds, 1), 20
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {unknown}; choose from {sorted(MODELS)}")
    d = args.devices
    layouts = layouts_for(d)
    if args.quick:
        layouts = [layouts[0], layouts[-1]] if len(layouts) > 1 else layouts
    if args.layouts:
        try:
            layouts = [tuple(int(n) for n in x.split("x")) for x in args.layouts.split(",")]
            assert all(len(x) == 2 and min(x) >= 1 for x in layouts)
        except (ValueError, AssertionError):
            ap.error(f"--layouts: expected e.g. 2x2,4x1,1x4; got {args.layouts!r}")
    specs = [(m, MODELS[m][0], MODELS[m][1], args.steps or MODELS[m][2]) for m in names]
    t0 = time.perf_counter()
    times, alone_times, how, devices = measure(layouts, specs, args)
    print(f"# multi_worker.py on {platform.node()} ({os.cpu_count()} cores), a worker's devices: "
          f"{devices} (global); {args.rounds} rounds x {args.launches} launch(es), steps "
          f"per loop per round: {', '.join(f'{m} {s}' for m, _, _, s in specs)}; jaxmirror "
          f"{args.variant}; median "
          f"(min-max) of the slowest worker's ms per step; ratios within rounds: median "
          f"[min-max]; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
          flush=True)
    print(table(layouts, specs, times, alone_times, how), flush=True)
    print(f"({time.perf_counter() - t0:.0f} s)", flush=True)
    multi = next(((w, dd) for w, dd in layouts if w > 1), None)
    if args.hlo and multi:
        hlo_report(multi, specs)
    if args.overhead_rounds and multi and multi[0] == 2:
        overhead(args.overhead_rounds, args.overhead_steps, args.warmup, multi[1])
    elif args.overhead_rounds:
        print(f"\n# agreement and failure watch: skipped (needs a 2-worker layout; --devices {d})")
    return 0


def anatomy(specs, steps, dump):
    """A worker of ``--hlo``: XLA dumps this worker's compiled programs under ``dump``; each
    loop runs ``steps`` steps with the host time of each part of a step measured. Returns
    {model: {loop: {part: seconds per step}}} and the dump folder."""
    index = os.environ.get("JAXMIRROR_LAUNCH_WORKER_INDEX", "0")
    folder = os.path.join(dump, f"worker{index}")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_dump_to={folder} --xla_dump_hlo_as_text")
    import jaxmirror as jm  # after XLA_FLAGS: the backend reads them when it starts

    options = jm.experimental.CommunicationOptions(timeout_seconds=120)
    strategy = jm.MultiWorkerMirroredStrategy(communication_options=options)
    out = {}
    for name, sizes, batch, _ in specs:
        loops = {JM: jaxmirror_loop(strategy, sizes, batch), PACKED: hand_loop(sizes, batch, True),
                 BASE: hand_loop(sizes, batch)}
        phases = {k: {"cpu": 0.0} for k in loops}
        for loop in loops.values():
            loop(3)
        names = list(loops)
        for r in range(6):  # rotating order, as the timed rounds
            for k in names[r % 3:] + names[:r % 3]:
                cpu = time.process_time()
                loops[k].split(steps // 6, phases[k])
                phases[k]["cpu"] += time.process_time() - cpu  # every thread of this process
        out[name] = {k: {part: v / (steps // 6 * 6) for part, v in phases[k].items()}
                     for k in loops}
    return out, folder


COLLECTIVES = ("all-reduce", "all-reduce-start", "all-gather", "all-gather-start",
               "reduce-scatter", "collective-permute", "collective-permute-start", "all-to-all")


def collectives_in(folder):
    """{module name: [(op, result shape), ...]} from the optimized HLO text XLA dumped."""
    import glob
    import re

    found = {}
    for path in sorted(glob.glob(os.path.join(folder, "*after_optimizations.txt"))):
        module = re.sub(r"\.(cpu_|gpu_)?after_optimizations\.txt$", "", os.path.basename(path))
        with open(path) as f:
            for line in f:
                m = re.search(r"= (\(.*?\)|\S+) (" + "|".join(COLLECTIVES) + r")\(", line)
                if m:
                    found.setdefault(module, []).append((m.group(2), m.group(1)))
    return found


def hlo_report(layout, specs, steps=120):
    """``--hlo``: the collectives each loop's programs hold, and where a step's host time
    goes, on ``layout`` (worker 0's programs; the slowest worker's parts)."""
    import tempfile

    w, d = layout
    with tempfile.TemporaryDirectory(prefix="multi_worker_hlo_") as dump:
        results = launch(anatomy, w, d, (specs, steps, dump))
        programs = collectives_in(results[0][1])
    print(f"\n# --hlo: {w} workers x {d} devices, {steps} steps per loop (6 rounds) after 3: host ms per "
          f"step by part, and CPU ms per step of the whole process (all its threads), each the "
          f"slowest worker's; then the collectives in worker 0's compiled programs")
    print("| model | loop | " + " | ".join(["next / make arrays", "step call", "reduce call",
                                            "float (waits)", "sum", "process CPU"]) + " |")
    print("|---|---|---|---|---|---|---|---|")
    for name, *_ in specs:
        for loop in (JM, PACKED, BASE):
            parts = {k: max(out[name][loop][k] for out, _ in results)
                     for k in results[0][0][name][loop]}
            cpu = parts.pop("cpu")
            cells = [parts.get(k) for k in ("next", "step call", "reduce call", "float")]
            cells = ["-" if c is None else f"{c * 1e3:.3f}" for c in cells]
            print(f"| {name} | {loop} | " + " | ".join(cells)
                  + f" | {sum(parts.values()) * 1e3:.3f} | {cpu * 1e3:.3f} |")
    print("\n| program (HLO module) | collectives (op: result shape) |\n|---|---|")
    for module, ops in sorted(programs.items()):
        print(f"| {module} | {len(ops)}: " + ", ".join(f"{op}: {shape}" for op, shape in ops)
              + " |")


def overhead(rounds, steps, warmup, devices=2):
    """What the per-step data agreement and the failure watch cost (issue 27): the small model
    on 2 workers x ``devices`` devices, as written against the same loop with both switched off,
    runs in rotating order; medians of the slowest worker's seconds per step."""
    sizes, batch, _ = MODELS["small"]
    variants = ["as written", "off", "off, inline"]
    times = {v: [] for v in variants}
    losses = {}
    for r in range(rounds):
        for variant in variants[r % 3:] + variants[:r % 3]:
            t, loss = run_layout(2, devices, sizes, batch, steps, warmup, variant)
            times[variant].append(t)
            losses[variant] = loss
    med = {v: statistics.median(t) for v, t in times.items()}
    agree = all(np.array_equal(losses[v], losses["as written"]) for v in variants)
    print(f"\n# agreement and failure watch: small model, 2 workers x {devices} devices, {rounds} "
          f"rounds x {steps} steps (median, min-max)")
    print("| loop | ms per step | ratio to `off` | ratio to `off, inline` |")
    print("|---|---|---|---|")
    for v in variants:
        print(f"| {v} | {med[v] * 1e3:.3f} ({min(times[v]) * 1e3:.3f}-{max(times[v]) * 1e3:.3f})"
              f" | {med[v] / med['off']:.3f} | {med[v] / med['off, inline']:.3f} |", flush=True)
    print(f"losses equal bit for bit across the variants: {agree}")


if __name__ == "__main__":
    sys.exit(main())
