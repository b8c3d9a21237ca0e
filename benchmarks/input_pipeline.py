#!/usr/bin/env python
"""Cost of jaxmirror's distributed dataset against a bare ``jax.device_put`` loop.

On N simulated CPU devices (N = 1, 2, 8 by default) and for global batches of about 3 MB and
12 MB (float32 images ``(G, 784)`` and int32 labels ``(G,)``), two things are measured:

  1. Throughput. One epoch of ``for b in ds: jax.block_until_ready(b)`` over
     ``ds = strategy.experimental_distribute_dataset(batches, options=jaxmirror.InputOptions(
     experimental_per_replica_buffer_size=k))``, the epoch's ``iter(ds)`` (which starts the
     prefetch thread) included, against the bare loop over the same host batches::

         for x, y in batches:
             jax.block_until_ready(jax.device_put((x.reshape(N, G // N, 784),
                                                   y.reshape(N, G // N)),
                                                  NamedSharding(mesh, P("replica"))))

     (at N = 1 the bare loop puts ``(x, y)`` on the one device). G is divisible by N. Reported:
     batches/s, GB/s of host data, and the ratio of throughputs jaxmirror / baseline (goal
     >= 0.9). A row with a global batch that N does not divide (jaxmirror pads each replica
     with copies of a real row, and its leaves carry row counts) is given for information,
     against a bare loop that pads the batch at its end with ``np.take`` before the same
     ``device_put``.
  2. Train step. An MLP SGD step (``@strategy.run``, ``jaxmirror.compute_average_loss``,
     gradients and loss all-reduced with SUM, ``p - lr * g``) fed by the iterator,
     ``for b in ds: params, loss = step(params, *b)``, against the same step over the same
     batches placed on the devices beforehand (``list(ds)``, made once), the same number of
     steps per epoch and ``block_until_ready`` at the end of each epoch. Reported: ms/step and
     the ratio iterator / pre-placed (goal <= 1.05: the copy hidden behind compute). Beside
     them, for information, runs the same loop placing each batch itself in the training
     thread (the dataset's reshape and one ``device_put`` of the leaves, sharing row counts
     placed once, as the dataset does; no thread): its gap to pre-placed is the copy, its gap to
     the iterator the thread and the dataset's own work. With ``--ablation`` a fifth loop
     makes those same device_puts on jaxmirror's prefetch thread: the thread alone.

With ``--ablation`` (on by default) the throughput rounds also time, for information, the
dataset's own per-epoch work run in the timing thread (the same dataset made with
``InputOptions(prefetch_thread=False)``: its checks, the split and one ``device_put`` of the
leaves in ``next``; no prefetch thread) and the baseline's ``device_put`` calls made on
jaxmirror's prefetch thread (``jaxmirror.data.prefetch.Prefetcher``, same depth): the first
shows what the dataset's per-batch work costs, the second what the thread alone costs. Every
throughput variant also reports the process's minor page faults per batch (``getrusage``).

Every variant runs in rounds, the variants in a fresh random order each round
(``_timing.shuffled_rounds``), at least ``--rounds`` rounds and more (up to 10x) while a case
has taken less than ``--case-seconds``. Ratios are taken within each round; the tables give their
median and quartiles. A second copy of each baseline (base') is an A/A control: its ratio to the
baseline shows how much this machine's noise alone moves a ratio.

Host buffers: on CPU, PJRT does not copy a NumPy array whose data start on a 64-byte boundary
(``device_put`` aliases it: ~0.1 ms for 12 MB); others it copies. NumPy's own large allocations
land on either, at random. So that every ``device_put`` here copies, in every variant alike, the
script places every host leaf 16 bytes past a 64-byte boundary and checks that no placed array
aliases its host batch. (The padded rows' gathered host arrays are fresh NumPy allocations in
both variants, aliased or not at random.)

The script asserts that the dataset gives the same arrays as the bare loop (bit for bit on any
platform: copies), that the trained params of the iterator, pre-placed and inline loops agree
(``_timing.check_close``: the same compiled step on the same batches, bit for bit on CPU, rtol
1e-5, atol 1e-6 on a GPU), and that the step traced and compiled once per N. It runs on
simulated CPU devices unless ``JAX_PLATFORMS`` names another platform.

Run from the repository root:
    .venv/bin/python benchmarks/input_pipeline.py                  # N = 1, 2, 8; ~4 min
    .venv/bin/python benchmarks/input_pipeline.py --quick          # a sanity run, ~20 s, noisy
    .venv/bin/python benchmarks/input_pipeline.py --buffer-size 2 --no-train
    JAX_PLATFORMS=cuda python3 benchmarks/input_pipeline.py --devices 1 --hidden 65536  # 1 GPU
"""

from __future__ import annotations

import os

from _platform import simulated_cpu_devices  # noqa: E402  (before JAX; CPU unless JAX_PLATFORMS)

_FLAG = simulated_cpu_devices(8)

import argparse  # noqa: E402
import functools  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxmirror  # noqa: E402
from jaxmirror.data.prefetch import Prefetcher  # noqa: E402  (the ablation's thread-only loop)
from _timing import check_close, devices_line, init_params, mlp, platform_of  # noqa: E402
from _timing import too_few_devices  # noqa: E402  (shared)
from _timing import shuffled_rounds as _shuffled_rounds  # noqa: E402

FEATURES, CLASSES = 784, 10
HIDDEN = 256  # the train step's MLP: 784 -> HIDDEN -> 10 (--hidden)
LR = 0.01
# name -> global batch (rows): 960 * 784 * 4 B = 3.0 MB, 3840 rows = 12.0 MB (+ the labels)
BATCHES = {"3MB": 960, "12MB": 3840}
PAD_ROWS = {"3MB": 963, "12MB": 3843}  # not divisible by 2 or 8: the padding path
DISTINCT = 16  # distinct host batches per case, cycled through an epoch

OURS, BASE, BASE2 = "jaxmirror", "baseline", "baseline'"
GEN = "dataset generator, no thread"
THREAD = "bare device_put on jaxmirror's Prefetcher thread"
ITER, PRE, PRE2, INLINE = "iterator", "pre-placed", "pre-placed'", "inline device_put"
INLINE_THREAD = "inline on the Prefetcher"


# ----------------------------------------------------------------------------------------------
# Host data
# ----------------------------------------------------------------------------------------------
def _host_array(values: np.ndarray) -> np.ndarray:
    """A copy of ``values`` whose data start 16 bytes past a 64-byte boundary (see above)."""
    nbytes = values.nbytes
    buf = np.empty(nbytes + 128, np.uint8)
    off = (16 - buf.ctypes.data) % 64
    out = buf[off:off + nbytes].view(values.dtype).reshape(values.shape)
    out[...] = values
    assert out.ctypes.data % 64 == 16
    return out


def host_batches(rows: int, count: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [(_host_array(rng.standard_normal((rows, FEATURES), np.float32)),
             _host_array(rng.integers(0, CLASSES, rows).astype(np.int32)))
            for _ in range(count)]


def _nbytes(batch) -> int:
    return sum(a.nbytes for a in batch)


def _arrays(batch, n: int) -> list:
    """The global arrays of a placed batch: plain arrays at N = 1, else the PerReplica's."""
    return list(batch) if n == 1 or not isinstance(batch[0], jaxmirror.PerReplica) else [
        v.stacked for v in batch]


def _check_copied(arrays, host) -> None:
    """Assert no shard of the placed arrays aliases the host batch's memory."""
    for arr, h in zip(arrays, host, strict=True):
        lo, hi = h.ctypes.data, h.ctypes.data + h.nbytes
        for shard in arr.addressable_shards:
            ptr = shard.data.unsafe_buffer_pointer()
            assert not lo <= ptr < hi, "device_put aliased a host buffer instead of copying it"


# ----------------------------------------------------------------------------------------------
# One N: the strategy, its mesh, and the bare placement
# ----------------------------------------------------------------------------------------------
THREAD_CHOICE = {"auto": None, "on": True, "off": False}


class Replicas:
    def __init__(self, n: int):
        self.n = n
        devices = jax.devices()[:n]
        self.strategy = jaxmirror.MirroredStrategy(devices)
        self.mesh = Mesh(np.array(devices), ("replica",))
        self.sharding = NamedSharding(self.mesh, P("replica"))
        self.device = devices[0]

    def dataset(self, batches, k: int, thread=None):
        options = jaxmirror.InputOptions(experimental_per_replica_buffer_size=k,
                                         prefetch_thread=thread)
        return self.strategy.experimental_distribute_dataset(batches, options=options)

    def bare_put(self, x, y):
        """The baseline's placement of one divisible host batch."""
        n = self.n
        if n == 1:
            return jax.device_put((x, y), self.device)
        return jax.device_put((x.reshape((n, -1) + x.shape[1:]), y.reshape(n, -1)), self.sharding)

    def bare_put_padded(self, x, y, index):
        """The baseline's placement of a batch N does not divide: pad at the end, then put."""
        n = self.n
        x, y = np.take(x, index, axis=0), np.take(y, index, axis=0)
        return jax.device_put((x.reshape((n, -1) + x.shape[1:]), y.reshape(n, -1)), self.sharding)


# ----------------------------------------------------------------------------------------------
# 1. Throughput
# ----------------------------------------------------------------------------------------------
def _epoch(source, count: int) -> float:
    """Seconds per batch of one pass over ``source()``, waiting for each batch's arrays."""
    t0 = time.perf_counter()
    for b in source():
        jax.block_until_ready(b)
    return (time.perf_counter() - t0) / count


def _with_faults(timer, faults: list, count: int):
    """``timer``, also appending the process's minor page faults per batch to ``faults``."""
    def run() -> float:
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = timer()
        faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / count)
        return t
    return run


def _ratio(num, den) -> tuple[float, float, float]:
    r = [a / b for a, b in zip(num, den)]
    return statistics.median(r), float(np.percentile(r, 25)), float(np.percentile(r, 75))


def _check_same(ds_batch, bare_batch, n: int) -> None:
    """The dataset's arrays equal the bare loop's (padded: the real rows of each replica)."""
    if n == 1:
        got = [np.asarray(a) for a in ds_batch]
        want = [np.asarray(a) for a in bare_batch]
    else:
        got = [np.concatenate(v.values) for v in ds_batch]  # each replica's real rows, in order
        want = [np.asarray(a).reshape((-1,) + a.shape[2:]) for a in bare_batch]
        want = [w[:g.shape[0]] for w, g in zip(want, got)]  # the bare loop pads at its end
    for g, w in zip(got, want):  # copies of the same host arrays: equal bits on any platform
        assert g.dtype == w.dtype, f"the dataset's batch is {g.dtype}, the bare loop's {w.dtype}"
        check_close("the dataset's batch vs the bare loop's", g, w, gpu_rtol=0.0)


def bench_throughput(reps: Replicas, name: str, rows: int, args) -> dict:
    n = reps.n
    host = host_batches(rows, DISTINCT)
    epoch = [host[i % DISTINCT] for i in range(args.batches)]
    count = len(epoch)
    ds = reps.dataset(epoch, args.buffer_size, THREAD_CHOICE[args.prefetch_thread])
    padded = rows % n != 0
    if padded:
        size = -(-rows // n)
        index = np.minimum(np.arange(n * size), rows - 1)
        put = functools.partial(reps.bare_put_padded, index=index)
    else:
        put = reps.bare_put
    # Warm-up (and checks): the dataset gives the bare loop's arrays, and both copied.
    first = next(iter(ds))
    bare = put(*host[0])
    jax.block_until_ready((first, bare))
    _check_same(first, bare, n)
    if not padded:
        _check_copied(_arrays(first, n), host[0])
        _check_copied(_arrays(bare, n), host[0])
    del first, bare

    def bare_loop():
        return (put(x, y) for x, y in epoch)

    sources = {OURS: lambda: ds, BASE: bare_loop, BASE2: bare_loop}
    if args.ablation:
        # The dataset's own per-batch work (checks, split, one device_put of the leaves) run
        # in this thread: the same dataset without its prefetch thread (InputOptions).
        inline = reps.dataset(epoch, args.buffer_size, False)
        sources[GEN] = lambda: inline
        # The bare loop's device_puts made on jaxmirror's prefetch thread: the thread alone.
        sources[THREAD] = lambda: Prefetcher(bare_loop(), args.buffer_size)
    for _ in range(2):
        for source in sources.values():
            _epoch(source, count)
    faults = {k: [] for k in sources}
    timers = {k: _with_faults(functools.partial(_epoch, src, count), faults[k], count)
              for k, src in sources.items()}
    t0 = time.perf_counter()
    t = _shuffled_rounds(timers, args.rounds, args.case_seconds)
    wall = time.perf_counter() - t0
    med = {k: statistics.median(v) for k, v in t.items()}
    nbytes = _nbytes(host[0])
    return dict(
        name=name, rows=rows, n=n, padded=padded, mb=nbytes / 1e6, rounds=len(t[OURS]),
        wall=wall, per_batch=med, gbs={k: nbytes / v / 1e9 for k, v in med.items()},
        # throughput ratio X / baseline = time ratio baseline / X, within a round
        ratios={k: _ratio(t[BASE], v) for k, v in t.items()},
        ratio=_ratio(t[BASE], t[OURS]), control=_ratio(t[BASE], t[BASE2]),
        faults={k: statistics.median(v) for k, v in faults.items()},
    )


# ----------------------------------------------------------------------------------------------
# 2. Train step
# ----------------------------------------------------------------------------------------------
def make_step(strategy):
    @strategy.run
    def train_step(params, x, y):
        def loss_fn(p):
            per_example = optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y)
            return jaxmirror.compute_average_loss(per_example)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        ctx = jaxmirror.get_replica_context()
        grads = ctx.all_reduce("sum", grads)
        params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
        return params, ctx.all_reduce("sum", loss)

    return train_step


class TrainLoop:
    """One variant: a source of batches per epoch, its own params, the shared step."""

    def __init__(self, step, source, params):
        self.step, self.source, self.params = step, source, params

    def __call__(self, count: int) -> float:
        """One epoch; seconds per step, waiting for the last step's params at the end."""
        step, params = self.step, self.params
        t0 = time.perf_counter()
        for b in self.source():
            params, _ = step(params, *b)
        jax.block_until_ready(params)
        t = (time.perf_counter() - t0) / count
        self.params = params
        return t


def bench_train(reps: Replicas, name: str, rows: int, args) -> dict:
    n, strategy = reps.n, reps.strategy
    ext = strategy.extended
    host = host_batches(rows, DISTINCT, seed=1)
    epoch = [host[i % DISTINCT] for i in range(args.steps)]
    ds = reps.dataset(epoch, args.buffer_size, THREAD_CHOICE[args.prefetch_thread])
    placed = list(ds)  # on the devices before timing; the same PerReplica nests the iterator gives
    # The row counts of a full batch, placed once and shared by every batch's leaves, as the
    # dataset places them (once per pattern of counts).
    counts = None if n == 1 else jax.device_put(np.full(n, rows // n, np.int32),
                                                ext.replicated_sharding)

    def inline():
        """What the dataset's prefetch thread does per batch, done in the training thread."""
        for x, y in epoch:
            if n == 1:
                yield jax.device_put((x, y), reps.device)
            else:
                xs, ys = jax.device_put([x.reshape((n, -1) + x.shape[1:]), y.reshape(n, -1)],
                                        [ext.replica_sharding] * 2)
                yield jaxmirror.PerReplica(xs, counts), jaxmirror.PerReplica(ys, counts)

    step = make_step(strategy)
    params = init_params(jax.random.key(0), (FEATURES, args.hidden, CLASSES))
    loops = {ITER: TrainLoop(step, lambda: ds, None),
             PRE: TrainLoop(step, lambda: placed, None),
             PRE2: TrainLoop(step, lambda: placed, None),
             INLINE: TrainLoop(step, inline, None)}
    if args.ablation:  # the same device_puts made on jaxmirror's prefetch thread
        loops[INLINE_THREAD] = TrainLoop(
            step, lambda: Prefetcher(inline(), args.buffer_size), None)
    for loop in loops.values():  # independent copies of the same initial params
        loop.params = jax.device_put(params, ext.replicated_sharding)
    for loop in loops.values():  # warm-up: compile, one epoch each
        loop(len(epoch))
    counts_warm = (step.trace_count, step.compile_count)
    t0 = time.perf_counter()
    t = _shuffled_rounds({k: functools.partial(loop, len(epoch)) for k, loop in loops.items()},
                         args.train_rounds, args.case_seconds)
    wall = time.perf_counter() - t0
    assert (step.trace_count, step.compile_count) == counts_warm == (1, 1), (
        f"the step traced/compiled again: {counts_warm} -> "
        f"{(step.trace_count, step.compile_count)}")

    # Every loop ran the same number of epochs over the same batches: the params must agree.
    # The same compiled step on the same batches: bit for bit on CPU; on a GPU rtol 1e-5, atol
    # 1e-6, room only for a reduction order the GPU does not fix from one call to the next.
    ref = jax.tree.map(np.asarray, loops[PRE].params)
    exact, worst = True, 0.0
    where = platform_of(loops[PRE].params)
    for k in loops:
        got = jax.tree.map(np.asarray, loops[k].params)
        checked = check_close(f"N={n}: {k}'s params vs {PRE}'s", got, ref, gpu_rtol=1e-5,
                              gpu_atol=1e-6, platform=where)
        for key in sorted(ref):
            worst = max(worst, float(np.max(np.abs(got[key] - ref[key]))))
            exact &= bool(np.array_equal(got[key], ref[key]))
    med = {k: statistics.median(v) for k, v in t.items()}
    return dict(
        name=name, rows=rows, n=n, rounds=len(t[ITER]), wall=wall, per_step=med,
        ratio=_ratio(t[ITER], t[PRE]), control=_ratio(t[PRE2], t[PRE]),
        ratios={k: _ratio(v, t[PRE]) for k, v in t.items()},
        exact=exact, diff=worst, checked=checked, mb=_nbytes(host[0]) / 1e6,
    )


# ----------------------------------------------------------------------------------------------
def _q(r) -> str:
    return f"{r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="1,2,8", help="replica counts, comma-separated")
    ap.add_argument("--sizes", default="3MB,12MB", help=f"global batches, from {list(BATCHES)}")
    ap.add_argument("--train-sizes", default="3MB,12MB",
                    help="global batches for the train-step table (empty: none)")
    ap.add_argument("--buffer-size", type=int, default=1,
                    help="InputOptions.experimental_per_replica_buffer_size (default 1, as "
                         "jaxmirror's)")
    ap.add_argument("--hidden", type=int, default=HIDDEN,
                    help="hidden width of the train step's MLP (784 -> hidden -> 10)")
    ap.add_argument("--batches", type=int, default=32, help="batches per throughput epoch")
    ap.add_argument("--steps", type=int, default=16, help="train steps per epoch")
    ap.add_argument("--rounds", type=int, default=15,
                    help="throughput rounds per case, at least (one epoch per variant a round)")
    ap.add_argument("--train-rounds", type=int, default=12,
                    help="train-step rounds per case, at least")
    ap.add_argument("--case-seconds", type=float, default=8.0,
                    help="after the minimum, go on with more rounds (up to 10x) until a case's "
                         "timed rounds took this long")
    ap.add_argument("--train", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the train step")
    ap.add_argument("--padding", action=argparse.BooleanOptionalAction, default=True,
                    help="also time a global batch N does not divide (N > 1)")
    ap.add_argument("--ablation", action=argparse.BooleanOptionalAction, default=True,
                    help="also time, beside the throughput loops, the dataset's generator without "
                         "its thread and the bare device_puts on jaxmirror's prefetch thread")
    ap.add_argument("--prefetch-thread", choices=sorted(THREAD_CHOICE), default="auto",
                    help="InputOptions.prefetch_thread: auto (the default: a thread unless every "
                         "device is a CPU), on or off")
    ap.add_argument("--quick", action="store_true", help="a fast sanity run (numbers are noisy)")
    args = ap.parse_args(argv)

    if args.quick:
        args.batches, args.steps, args.rounds, args.train_rounds = 8, 6, 3, 3
        args.case_seconds, args.train_sizes = 0.0, "3MB"
    ns = [int(s) for s in args.devices.split(",")]
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    train_sizes = [s.strip() for s in args.train_sizes.split(",") if s.strip()]
    for s in sizes + train_sizes:
        if s not in BATCHES:
            ap.error(f"unknown size {s!r}; choose from {list(BATCHES)}")
    if args.buffer_size < 1:
        ap.error("--buffer-size must be >= 1")
    problem = too_few_devices(max(ns), _FLAG)
    if problem:
        print(problem, file=sys.stderr)
        return 2

    t_start = time.perf_counter()
    print(f"# jaxmirror input pipeline: {devices_line()}, {os.cpu_count()} host cores, jax {jax.__version__}, "
          f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.2f} at start")
    print(f"# command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    print(f"# jaxmirror from {os.path.dirname(jaxmirror.__file__)}")
    print(f"# prefetch_thread={args.prefetch_thread}; "
          f"experimental_per_replica_buffer_size={args.buffer_size}; throughput: "
          f"{args.batches} batches/epoch ({DISTINCT} distinct), rounds >= {args.rounds}; "
          f"train: {args.steps} steps/epoch, rounds >= {args.train_rounds}; more rounds (up to "
          f"10x) while a case has taken < {args.case_seconds:g} s; variants in random order "
          f"each round")
    print(f"# batches: float32 (G, {FEATURES}) + int32 (G,); "
          + ", ".join(f"{k}: G={g}" for k, g in BATCHES.items())
          + "; host leaves 16 B past a 64-B boundary (so device_put copies)")
    print(f"# train step: MLP {FEATURES} -> {args.hidden} -> {CLASSES}, softmax cross-entropy "
          f"through compute_average_loss, SUM all-reduce, SGD lr {LR}")
    print()

    reps = {n: Replicas(n) for n in ns}
    thr = []
    for name in sizes:
        cases = [(n, BATCHES[name]) for n in ns]
        if args.padding:
            cases += [(n, PAD_ROWS[name]) for n in ns if PAD_ROWS[name] % n]
        for n, rows in cases:
            r = bench_throughput(reps[n], name, rows, args)
            thr.append(r)
            print(f"  throughput {name} G={rows} N={n}: ratio {r['ratio'][0]:.3f} "
                  f"({r['rounds']} rounds, {r['wall']:.1f} s)", file=sys.stderr, flush=True)
    train = []
    if args.train:
        for name in train_sizes:
            for n in ns:
                r = bench_train(reps[n], name, BATCHES[name], args)
                train.append(r)
                print(f"  train {name} N={n}: ratio {r['ratio'][0]:.3f} ({r['rounds']} rounds, "
                      f"{r['wall']:.1f} s)", file=sys.stderr, flush=True)

    print("Throughput: one epoch a round per variant, `block_until_ready` on every batch; "
          "medians over rounds. Ratio = jaxmirror / baseline throughput within a round, median "
          "[IQR]; goal >= 0.9.")
    print()
    print("| batch | G | MB | N | rounds | jaxmirror batches/s | jaxmirror GB/s "
          "| baseline batches/s | baseline GB/s | ratio jm/base | A/A base'/base "
          "| minor faults/batch jm, base |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in thr:
        pb, gbs, fl = r["per_batch"], r["gbs"], r["faults"]
        g = f"{r['rows']} (padded)" if r["padded"] else str(r["rows"])
        print(f"| {r['name']} | {g} | {r['mb']:.2f} | {r['n']} | {r['rounds']} "
              f"| {1 / pb[OURS]:.0f} | {gbs[OURS]:.2f} | {1 / pb[BASE]:.0f} | {gbs[BASE]:.2f} "
              f"| {_q(r['ratio'])} | {r['control'][0]:.3f} | {fl[OURS]:.0f}, {fl[BASE]:.0f} |")
    print()
    even = [r for r in thr if not r["padded"]]
    if even:
        worst = min(even, key=lambda r: r["ratio"][0])
        verdict = "met" if worst["ratio"][0] >= 0.9 else "NOT met"
        print(f"throughput (divisible batches): worst median ratio {worst['ratio'][0]:.3f} "
              f"({worst['name']}, N={worst['n']}); goal >= 0.9 {verdict}.")
    if args.ablation and thr:
        print()
        print("Throughput ablation, the same rounds: ms/batch (median), in brackets the "
              "throughput ratio to the baseline within a round (median), and minor page faults "
              "per batch (the whole process, median). 'generator' is the dataset's own per-epoch "
              "generator (the dataset made with InputOptions(prefetch_thread=False): checks, "
              "split, one device_put of the leaves in `next`) run in the timing thread; "
              "'Prefetcher' is the baseline's device_puts made on jaxmirror's prefetch thread "
              "(`jaxmirror.data.prefetch.Prefetcher`, the same depth).")
        print()
        print("| batch | G | N | baseline | jaxmirror | generator, no thread "
              "| bare device_put on the Prefetcher |")
        print("|---|---|---|---|---|---|---|")
        for r in thr:
            pb, rr, fl = r["per_batch"], r["ratios"], r["faults"]
            cells = [f"{pb[k] * 1e3:.3f} ({rr[k][0]:.3f}; {fl[k]:.0f})" if k in pb else "n/a"
                     for k in (BASE, OURS, GEN, THREAD)]
            g = f"{r['rows']} (padded)" if r["padded"] else str(r["rows"])
            print(f"| {r['name']} | {g} | {r['n']} | " + " | ".join(cells) + " |")

    if train:
        print()
        print(f"Train step: {args.steps} steps an epoch, one epoch a round per variant, "
              f"`block_until_ready` at the end of the epoch; ms/step, medians over rounds. "
              f"Ratios within a round, median [IQR]; goal iterator/pre-placed <= 1.05. "
              f"'{INLINE}': the training thread places each batch itself (the dataset's reshape "
              f"and one device_put of the leaves, row counts placed once), no thread"
              + (f"; '{INLINE_THREAD}': those same device_puts made on jaxmirror's prefetch "
                 f"thread (`Prefetcher`, the same depth)." if args.ablation else "."))
        print()
        extra = [INLINE] + ([INLINE_THREAD] if args.ablation else [])
        print(f"| batch | N | rounds | {ITER} | {PRE} | "
              + " | ".join(extra) + f" | {ITER}/{PRE} | "
              + " | ".join(f"{k}/{PRE}" for k in extra) + f" | A/A {PRE2}/{PRE} "
              f"| params agree |")
        print("|---|---|---|---|---|" + "---|" * (2 * len(extra) + 3))
        for r in train:
            ps, rr = r["per_step"], r["ratios"]
            agree = ("bitwise" if r["exact"] else f"max abs diff {r['diff']:.1e}") + (
                "" if r["checked"].endswith("(cpu)") else f"; checked {r['checked']}")
            print(f"| {r['name']} | {r['n']} | {r['rounds']} | {ps[ITER] * 1e3:.2f} "
                  f"| {ps[PRE] * 1e3:.2f} | "
                  + " | ".join(f"{ps[k] * 1e3:.2f}" for k in extra) + f" | {_q(r['ratio'])} | "
                  + " | ".join(_q(rr[k]) for k in extra) + f" | {r['control'][0]:.3f} "
                  f"| {agree} |")
        print()
        worst = max(train, key=lambda r: r["ratio"][0])
        verdict = "met" if worst["ratio"][0] <= 1.05 else "NOT met"
        print(f"train step: worst median iterator/pre-placed {worst['ratio'][0]:.3f} "
              f"({worst['name']}, N={worst['n']}); goal <= 1.05 {verdict}.")
    print()
    print(f"# load average {os.getloadavg()[0]:.2f} at the end; total "
          f"{time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
