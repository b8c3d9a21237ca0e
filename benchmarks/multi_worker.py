"""Multi-worker step time: 2 workers x 2 devices against 1 process x 4 devices, same model.

``--devices D``: 1 process x D against 2 workers x D/2 (D = 4 by default). The workers get
simulated CPU devices unless ``JAX_PLATFORMS`` names another platform; on GPUs only the one
process layout runs (``JAX_PLATFORMS=cuda ... --devices 1``: one GPU). The workers' losses
must agree (``_timing.check_close``: bit for bit on CPU, rtol 1e-6 on a GPU).

Both layouts run the TF custom-training loop users write (``next(iterator)`` of an
``experimental_distribute_dataset``, the ``@strategy.run`` step with all-reduced gradients,
``float(strategy.reduce(...))``) under ``MultiWorkerMirroredStrategy``, started by
``jaxmirror.launch.run`` on loopback. One process x 4 devices is the same strategy with one
worker (no TF_CONFIG cluster), so the ratio is the cost of crossing processes (gloo over
loopback TCP on CPU). Runs alternate between the layouts; the table gives medians and the
ratio 2x2 / 1x4 per model, and checks that both layouts computed the same losses.

    .venv/bin/python benchmarks/multi_worker.py [--rounds 3] [--steps 20] [--models small,wide,compute]

Then (``--overhead-rounds``, ``--overhead-steps``) what issue 27's per-step agreement on the
data and failure watch cost: the small model's loop as users write it, against the same loop
with both switched off (``off``: batches still made on a thread; ``off, inline``: made in
``next``, as before the agreement made the thread the default across workers).
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

# The workers inherit JAX_PLATFORMS (cpu unless set); launch.run sets their CPU device counts.
_FLAG = simulated_cpu_devices(4)
ON_CPU = os.environ["JAX_PLATFORMS"].split(",")[0] in ("", "cpu")

MODELS = {  # name: (layer sizes, global batch)
    "small": ([32, 64, 10], 256),  # latency-bound: the collectives are the step
    "wide": ([256, 1024, 1024, 10], 512),  # 1.3 M params: a 5 MB all-reduce per step
    "compute": ([256, 256, 256, 10], 4096),  # compute-bound: 0.2 M params, big batch
}


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


def worker(sizes, batch, steps, warmup, variant="as written"):
    """One worker's timed loop; returns (seconds per step, losses). ``variant``: ``as written``
    (what users get), ``off`` (without the data agreement and the failure watch, the batches
    still made on a thread), ``off, inline`` (also made in ``next``: before issue 27)."""
    import jax
    import jax.numpy as jnp
    import optax

    import jaxmirror as jm

    options = jm.experimental.CommunicationOptions(timeout_seconds=120)
    strategy = jm.MultiWorkerMirroredStrategy(communication_options=options)
    if variant != "as written":
        _switch_off(agreement=variant != "watch off", failure_watch=variant != "agreement off")
    rng = np.random.default_rng(0)
    data = [(rng.normal(size=(batch, sizes[0])).astype(np.float32),
             rng.integers(0, sizes[-1], size=batch).astype(np.int32))
            for _ in range(8)]

    def forever():
        while True:
            yield from data

    input_options = jm.InputOptions(prefetch_thread=False) if variant == "off, inline" else None
    iterator = iter(strategy.experimental_distribute_dataset(forever, input_options))
    key = jax.random.PRNGKey(0)
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        key, k = jax.random.split(key)
        params[f"w{i}"] = jax.random.normal(k, (a, b)) / np.sqrt(a)
        params[f"b{i}"] = jnp.zeros(b)
    params = strategy.experimental_replicate(params)

    def loss_fn(p, x, y):
        n = len(p) // 2
        for i in range(n):
            x = x @ p[f"w{i}"] + p[f"b{i}"]
            if i < n - 1:
                x = jax.nn.relu(x)
        per_example = optax.softmax_cross_entropy_with_integer_labels(x, y)
        return jm.compute_average_loss(per_example, global_batch_size=batch)

    @strategy.run
    def step(p, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        grads = jm.get_replica_context().all_reduce("SUM", grads)
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), loss

    losses = []

    def loop(k):
        nonlocal params
        for _ in range(k):
            x, y = next(iterator)
            params, loss = step(params, x, y)
            losses.append(float(strategy.reduce("SUM", loss, axis=None)))

    loop(warmup)
    t0 = time.perf_counter()
    loop(steps)
    seconds = (time.perf_counter() - t0) / steps
    return seconds, losses


def describe():
    """A worker's devices, in the words of ``_timing.devices_line``."""
    from _timing import devices_line

    return devices_line()


def launch(fn, workers, devices, args=()):
    """``jaxmirror.launch.run``: on CPU each worker gets ``devices`` simulated CPU devices; on a
    GPU one worker sees the first ``devices`` GPUs (``CUDA_VISIBLE_DEVICES``, unless set)."""
    import jaxmirror as jm

    env = None
    if not ON_CPU and "CUDA_VISIBLE_DEVICES" not in os.environ:
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(devices)))}
    return jm.launch.run(fn, workers=workers, devices_per_worker=devices if ON_CPU else None,
                         args=args, timeout=600, env=env)


def run_layout(workers, devices, sizes, batch, steps, warmup, variant="as written"):
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--devices", type=int, default=4,
                    help="devices per layout: 1 process x D against 2 workers x D/2 (D even); "
                         "on GPUs (JAX_PLATFORMS=cuda) only 1 process x D, e.g. --devices 1")
    ap.add_argument("--overhead-rounds", type=int, default=4,
                    help="rounds of the agreement-and-watch comparison (0: skip it)")
    ap.add_argument("--overhead-steps", type=int, default=100)
    args = ap.parse_args(argv)
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {unknown}; choose from {sorted(MODELS)}")
    d = args.devices
    layouts = {f"1x{d}": (1, d)}
    if ON_CPU and d >= 2 and d % 2 == 0:  # one GPU per worker is not set up here
        layouts[f"2x{d // 2}"] = (2, d // 2)
    one, two = list(layouts) + [None] * (2 - len(layouts))
    print(f"# multi_worker.py on {platform.node()} ({os.cpu_count()} cores), "
          f"{args.rounds} rounds x {args.steps} steps; a worker's devices: "
          f"{launch(describe, 1, d)[0]}", flush=True)
    names_of = {k: f"{w} {'process' if w == 1 else 'workers'} x {n} devices"
                for k, (w, n) in layouts.items()}
    print(f"| model | {' | '.join(names_of.values())} |"
          + (f" ratio {two} / {one} | losses agree |" if two else "")
          + ("\n|---|---|---|---|---|" if two else "\n|---|---|"))
    for name in names:
        sizes, batch = MODELS[name]
        times = {k: [] for k in layouts}
        losses = {}
        for r in range(args.rounds):
            order = list(layouts) if r % 2 == 0 else list(reversed(layouts))
            for layout in order:
                t, loss = run_layout(*layouts[layout], sizes, batch, args.steps, args.warmup)
                times[layout].append(t)
                losses[layout] = loss
        med = {k: statistics.median(v) for k, v in times.items()}
        cells = [f"{med[k] * 1e3:.2f} ms ({min(times[k]) * 1e3:.2f}-{max(times[k]) * 1e3:.2f})"
                 for k in layouts]
        if two:  # reported, not asserted: gloo across processes adds in another order
            agree = np.allclose(losses[one], losses[two], rtol=1e-5, atol=1e-6)
            cells += [f"{med[two] / med[one]:.2f}", str(agree)]
        print(f"| {name} {sizes} batch {batch} | " + " | ".join(cells) + " |", flush=True)
    if args.overhead_rounds and two:
        overhead(args.overhead_rounds, args.overhead_steps, args.warmup, d // 2)
    elif args.overhead_rounds:
        print(f"\n# agreement and failure watch: skipped (needs 2 workers; --devices {d})")
    return 0


def overhead(rounds, steps, warmup, devices=2):
    """What the per-step data agreement and the failure watch cost (issue 27): the small model
    on 2 workers x ``devices`` devices, as written against the same loop with both switched off,
    runs in rotating order; medians of the slowest worker's seconds per step."""
    sizes, batch = MODELS["small"]
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
