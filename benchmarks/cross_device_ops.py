#!/usr/bin/env python
"""Time per all-reduce of a many-leaf gradient pytree, per cross-device ops and pack size.

A gradient-like pytree of ``--leaves`` float32 leaves of ``--leaf-size`` floats each (default
200 x 50 000 = 10 M floats, 40 MB per replica) is summed over 8 simulated CPU devices:

  * by jaxmirror: a step ``strategy.function(fn)`` on a ``MirroredStrategy`` whose
    ``cross_device_ops`` is the setting's (``NcclAllReduce``, ``HierarchicalCopyAllReduce``,
    ``ReductionToOneDevice``), with ``num_packs`` or ``CommunicationOptions(bytes_per_pack=...,
    wire_dtype=...)`` passed to ``get_replica_context().all_reduce("sum", tree, options=...)``;
  * by the baseline: ``jax.jit(jax.shard_map(body, mesh=Mesh(devices, ("replica",)), ...,
    check_vma=False))`` whose body is ``jax.tree.map(lambda x: jax.lax.psum(x, "replica"),
    tree)``, and an identical second copy of it (an A/A control: its ratio to the first shows
    what this machine's noise alone does);
  * with ``--hand-packed`` (on by default), by that baseline with the packing written by hand:
    the leaves concatenated into one buffer, one ``psum``, sliced back (what packing costs
    here without jaxmirror).

Every replica holds its own values: the input is a nest of ``PerReplica`` values made with
``strategy.experimental_distribute_values_from_function`` (uniform in [0.5, 1.5), one random
stream per replica); the baseline gets their replica-stacked global arrays, the very same device
buffers. Both return the whole reduced tree (so XLA cannot drop the all-reduce), replicated.

Measured: in each round every setting runs a few all-reduces back to back
(``block_until_ready`` on the last), the settings in a fresh random order each round; the table
gives the median over rounds of the time per all-reduce and of the ratio to the baseline timed
in the same round. The number of calls a round is sized from two untimed calls so that a round
of a setting lasts about ``--round-ms`` (1 to 8 calls; never more than jaxmirror's in-flight
bound, so neither loop waits mid-round); settings less than 2x slower than the baseline run as
many calls as it does, and ``--calls`` fixes one number for all. The table also gives the
collectives in each setting's compiled HLO (instructions ``all-reduce``, ``reduce-scatter``,
``all-gather``, ``all-to-all``, ``collective-permute``, ``-start`` forms included), the time to
lower and compile it, and this process's minor page faults and kernel CPU time per all-reduce
(``getrusage``; on CPU devices every fresh buffer costs page faults). Before timing it asserts
that every setting's sums equal the baseline's (``_timing.check_close``: bit for bit on CPU,
rtol 1e-5 on a GPU; with a bfloat16 wire it reports the largest relative error and asserts it
is below 1e-2) and that the baseline's equal NumPy's (rtol 1e-5). With ``JAX_PLATFORMS=cuda``
it runs on the GPUs instead (``--devices 1`` on one GPU: each all-reduce is over one device).

Run from the repository root (``make bench`` runs the first line):
    .venv/bin/python benchmarks/cross_device_ops.py                 # ~2 min on 2 cores
    .venv/bin/python benchmarks/cross_device_ops.py --leaves 1000 --leaf-size 10000 --rounds 7
                                                   # 1000 smaller leaves, ~2.5 min
    .venv/bin/python benchmarks/cross_device_ops.py --quick         # a smoke run, ~5 s
"""

from __future__ import annotations

import os

from _platform import simulated_cpu_devices  # noqa: E402  (before JAX; CPU unless JAX_PLATFORMS)

_FLAG = simulated_cpu_devices(8)

import argparse  # noqa: E402
import gc  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxmirror  # noqa: E402
from jaxmirror.core import inflight as _inflight  # noqa: E402  (drained after timing)
from _timing import check_close, checkout, devices_line, platform_of, spread  # noqa: E402
from _timing import too_few_devices  # noqa: E402  (shared)

CommunicationOptions = jaxmirror.experimental.CommunicationOptions
MB = 1 << 20
BASELINE, CONTROL, HAND = "psum", "psum (A/A copy)", "psum of 1 buffer packed by hand"

# name -> (cross_device_ops factory, CommunicationOptions or None)
SETTINGS = {
    "default (no ops given)": (lambda: None, None),
    "nccl packs=0": (lambda: jaxmirror.NcclAllReduce(num_packs=0), None),
    "nccl packs=1": (lambda: jaxmirror.NcclAllReduce(num_packs=1), None),
    "nccl packs=4": (lambda: jaxmirror.NcclAllReduce(num_packs=4), None),
    "nccl packs=16": (lambda: jaxmirror.NcclAllReduce(num_packs=16), None),
    "nccl 1MB packs": (lambda: jaxmirror.NcclAllReduce(),
                       CommunicationOptions(bytes_per_pack=1 * MB)),
    "nccl 4MB packs": (lambda: jaxmirror.NcclAllReduce(),
                       CommunicationOptions(bytes_per_pack=4 * MB)),
    "hierarchical packs=0": (lambda: jaxmirror.HierarchicalCopyAllReduce(num_packs=0), None),
    "hierarchical packs=1": (lambda: jaxmirror.HierarchicalCopyAllReduce(num_packs=1), None),
    "to-one-device": (lambda: jaxmirror.ReductionToOneDevice(), None),
    "nccl packs=1 bf16 wire": (lambda: jaxmirror.NcclAllReduce(num_packs=1),
                               CommunicationOptions(wire_dtype="bfloat16")),
}
BF16 = {"nccl packs=1 bf16 wire"}  # compared with a tolerance, not rtol 1e-5

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_SHORT = {"all-reduce": "AR", "reduce-scatter": "RS", "all-gather": "AG", "all-to-all": "A2A",
          "collective-permute": "CP"}
_COLLECTIVE_RE = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def count_collectives(hlo: str) -> dict:
    """Collective instructions in compiled HLO text, by kind (``-start`` forms counted once)."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    for m in _COLLECTIVE_RE.finditer(hlo):
        counts[m.group(1)] += 1
    return counts


def entry_computation(hlo: str) -> str:
    """The ENTRY computation of compiled HLO text with metadata and names blanked out."""
    entry = hlo[hlo.index("ENTRY"):] if "ENTRY" in hlo else hlo
    entry = re.sub(r", metadata=\{[^}]*\}", "", entry)
    return re.sub(r"%[\w.\-]+", "%x", entry)


def compiled(v, fn, arg) -> None:
    """Lower and compile ``fn`` for ``arg``: record the time, the collectives, the program."""
    t0 = time.perf_counter()
    hlo = fn.lower(arg).compile().as_text()
    v.compile_s = time.perf_counter() - t0
    v.counts = count_collectives(hlo)
    v.hlo = entry_computation(hlo)


def describe(counts: dict) -> str:
    total = sum(counts.values())
    parts = [f"{v} {_SHORT[k]}" for k, v in counts.items() if v]
    return f"{total} ({', '.join(parts)})" if parts else "0"


# ----------------------------------------------------------------------------------------------
class Variant:
    """One way of summing the tree: a compiled callable, its input, its sums and its timings."""

    def __init__(self, name, call, arg, calls: int):
        self.name, self.call, self.arg, self.calls = name, call, arg, calls
        self.counts: dict = {}
        self.compile_s = 0.0
        self.times: list = []
        self.faults: list = []  # minor page faults per all-reduce, one entry per round
        self.kernel: list = []  # seconds of system (kernel) CPU time per all-reduce
        self.hlo = ""  # the compiled program's entry computation, names and metadata stripped
        self.error = 0.0  # largest relative error vs the baseline
        self.exact = True

    def __call__(self) -> float:
        """Seconds per all-reduce over ``calls`` back-to-back calls, waiting at the end.

        Also records this process's minor page faults and kernel CPU time per all-reduce.
        """
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        out = None
        for _ in range(self.calls):
            out = self.call(self.arg)
        jax.block_until_ready(out)
        t = (time.perf_counter() - t0) / self.calls
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        self.faults.append((r1.ru_minflt - r0.ru_minflt) / self.calls)
        self.kernel.append((r1.ru_stime - r0.ru_stime) / self.calls)
        return t


def make_values(leaves: int, size: int, n: int, seed: int = 0) -> list:
    """``leaves`` host arrays of shape ``(n, size)``: row r is replica r's leaf."""
    rngs = [np.random.default_rng([seed, r]) for r in range(n)]
    return [np.stack([rng.uniform(0.5, 1.5, size).astype(np.float32) for rng in rngs])
            for _ in range(leaves)]


def distribute(strategy, keys: list, host: list) -> dict:
    """The nest ``{key: PerReplica}`` whose replica r holds row r of each host array."""
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: {k: a[ctx.replica_id_in_sync_group] for k, a in zip(keys, host)})


def jaxmirror_variant(name, devices, tree, calls):
    make_ops, options = SETTINGS[name]
    strategy = jaxmirror.MirroredStrategy(devices, cross_device_ops=make_ops())

    def grads_sum(t):
        return jaxmirror.get_replica_context().all_reduce("sum", t, options=options)

    step = strategy.function(grads_sum)
    v = Variant(name, step, tree, calls)
    compiled(v, step, tree)
    return v


def baseline_variant(name, devices, stacked, calls):
    mesh = Mesh(np.array(devices), ("replica",))

    def body(t):  # each replica's (1, size) block of every leaf
        return jax.tree.map(lambda x: jax.lax.psum(x.reshape(x.shape[1:]), "replica"), t)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("replica"), out_specs=P(),
                               check_vma=False))
    v = Variant(name, fn, stacked, calls)
    compiled(v, fn, stacked)
    return v


def hand_packed_variant(name, devices, stacked, calls):
    """The baseline with the packing written by hand: concatenate, one psum, slice back."""
    mesh = Mesh(np.array(devices), ("replica",))

    def body(t):
        leaves, tree = jax.tree.flatten(t)
        flat = jax.lax.psum(jnp.concatenate([x.reshape(-1) for x in leaves]), "replica")
        out, start = [], 0
        for x in leaves:
            out.append(flat[start:start + x.size].reshape(x.shape[1:]))
            start += x.size
        return jax.tree.unflatten(tree, out)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("replica"), out_specs=P(),
                               check_vma=False))
    v = Variant(name, fn, stacked, calls)
    compiled(v, fn, stacked)
    return v


def time_once(v: Variant) -> float:
    """The faster of two untimed calls of ``v``, waited for, in seconds."""
    once = []
    for _ in range(2):
        t0 = time.perf_counter()
        jax.block_until_ready(v.call(v.arg))
        once.append(time.perf_counter() - t0)
    return min(once)


def calls_for(seconds: float, target_s: float) -> int:
    """All-reduces per round so that a round lasts about ``target_s`` (1 to 8)."""
    return max(1, min(_inflight.MAX_IN_FLIGHT, round(target_s / seconds)))


def check(v: Variant, ref: dict, names: list, numpy: bool = False) -> None:
    """Run ``v`` once and compare its sums with ``ref`` (host arrays); record the error.

    Against the psum baseline: bit for bit on CPU, rtol 1e-5 on a GPU (a sum of N <= 8 values
    in [0.5, 1.5] in another order: at most 7 float32 roundings, ~1e-6) and for the
    hierarchical and one-device settings everywhere (they add in another order). Against NumPy's sums
    (``numpy``): rtol 1e-5 everywhere (NumPy adds in its own order). The bfloat16 wire: a
    relative error below 1e-2 everywhere (8 bits of mantissa, ~4e-3 a rounding).
    """
    out = v.call(v.arg)
    jax.block_until_ready(out)
    where = platform_of(out)
    worst, exact, got = 0.0, True, {}
    for k in names:
        got[k] = np.asarray(out[k], dtype=np.float32)
        want = ref[k]
        assert got[k].shape == want.shape, (v.name, k, got[k].shape, want.shape)
        worst = max(worst, float(np.max(np.abs(got[k] - want) / np.abs(want))))
        exact &= bool(np.array_equal(got[k], want))
    if v.name in BF16:
        assert worst < 1e-2, f"{v.name}: max relative error {worst:.2e} >= 1e-2"
    else:
        # Two-level and one-device sums add the replicas' values in another order than psum.
        other_order = numpy or v.name.startswith(("hierarchical", "to-one-device"))
        v.checked = check_close(f"{v.name} vs the " + ("NumPy sums" if numpy else "psum baseline"),
                                got, {k: ref[k] for k in names}, gpu_rtol=1e-5,
                                cpu_rtol=1e-5 if other_order else 0.0, platform=where)
    v.error, v.exact = worst, exact


def timed_rounds(variants: list, rounds: int, seed: int = 0) -> None:
    """Each variant once a round, in a fresh random order each round, GC off."""
    rng = random.Random(seed)
    order = list(variants)
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            rng.shuffle(order)
            for v in order:
                v.times.append(v())
            print(f"  round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    finally:
        gc.enable()
        _inflight.drain()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--leaves", type=int, default=200, help="leaves in the gradient pytree")
    ap.add_argument("--leaf-size", type=int, default=50_000, help="float32s per leaf")
    ap.add_argument("--devices", type=int, default=8,
                    help="replicas (simulated CPU devices; GPUs with JAX_PLATFORMS=cuda)")
    ap.add_argument("--rounds", type=int, default=13, help="timed rounds")
    ap.add_argument("--round-ms", type=float, default=400.0,
                    help="each setting runs about this long a round: as many back-to-back "
                         "all-reduces (1 to 8) as fit, judged from two untimed calls")
    ap.add_argument("--calls", type=int, default=None,
                    help="all-reduces per setting per round, the same for all (overrides "
                         "--round-ms)")
    ap.add_argument("--hand-packed", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the psum baseline with the leaves packed by hand into one "
                         "buffer (what packing itself costs, without jaxmirror)")
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help=f"comma-separated, from: {', '.join(SETTINGS)}")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 20 leaves x 5000 floats, 2 rounds")
    args = ap.parse_args(argv)
    if args.quick:
        args.leaves, args.leaf_size, args.rounds, args.round_ms = 20, 5_000, 2, 50.0
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    for s in names:
        if s not in SETTINGS:
            ap.error(f"unknown setting {s!r}; choose from {list(SETTINGS)}")
    problem = too_few_devices(args.devices, _FLAG)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if args.calls is not None and not 1 <= args.calls <= _inflight.MAX_IN_FLIGHT:
        ap.error(f"--calls must be 1 to {_inflight.MAX_IN_FLIGHT} (jaxmirror's in-flight "
                 f"bound on CPU; the baseline keeps no such queue)")

    n, total = args.devices, args.leaves * args.leaf_size
    devices = jax.devices()[:n]
    print(f"# jaxmirror cross-device ops: N = {n} of {devices_line()}, "
          f"{os.cpu_count()} host cores, jax {jax.__version__}, "
          f"Python {platform.python_version()}, {checkout()}")
    print(f"# command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    print(f"# tree: {args.leaves} float32 leaves x {args.leaf_size} = {total / 1e6:g} M floats "
          f"({total * 4 / MB:.1f} MiB) per replica, different on every replica")
    per_round = (f"{args.calls} all-reduces" if args.calls is not None
                 else f"about {args.round_ms:g} ms of back-to-back all-reduces")
    print(f"# rounds={args.rounds}, each setting {per_round} a round (block_until_ready on the "
          f"last), settings in a fresh random order each round", flush=True)
    print(flush=True)

    t_start = time.perf_counter()
    host = make_values(args.leaves, args.leaf_size, n)
    keys = [f"g{i:04d}" for i in range(args.leaves)]
    tree = distribute(jaxmirror.MirroredStrategy(devices), keys, host)
    # PerReplica's (N, size) global arrays; at N = 1 the values are plain arrays: add the axis.
    stacked = {k: v.stacked if hasattr(v, "stacked") else v[None] for k, v in tree.items()}
    expected = {k: a.sum(0, dtype=np.float32) for k, a in zip(keys, host)}
    del host

    base = baseline_variant(BASELINE, devices, stacked, args.calls)
    control = baseline_variant(CONTROL, devices, stacked, args.calls)
    extra = [hand_packed_variant(HAND, devices, stacked, args.calls)] if args.hand_packed else []
    check(base, expected, keys, numpy=True)  # the baseline against NumPy's sums
    out = base.call(stacked)
    ref = {k: np.asarray(out[k]) for k in keys}
    del out
    variants = [base, control, *extra]
    for name in names:
        t0 = time.perf_counter()
        v = jaxmirror_variant(name, devices, tree, args.calls)
        check(v, ref, keys)
        variants.append(v)
        print(f"  {name}: compiled and checked in {time.perf_counter() - t0:.1f}s",
              file=sys.stderr, flush=True)
    for v in (control, *extra):
        check(v, ref, keys)
    # Two more untimed calls each, which also size the rounds. Settings less than 2x slower
    # than psum run as many calls as psum does (the same overlap of dispatch with execution).
    once = {v.name: time_once(v) for v in variants}
    base_calls = calls_for(once[BASELINE], args.round_ms / 1e3)
    for v in variants:
        fast = once[v.name] < 2 * once[BASELINE]
        v.calls = args.calls or (base_calls if fast else calls_for(once[v.name],
                                                                   args.round_ms / 1e3))

    timed_rounds(variants, args.rounds)
    med = statistics.median
    ratios = {v.name: [a / b for a, b in zip(v.times, base.times)] for v in variants}

    print("| setting | collectives in HLO | compile s | calls / round | ms / all-reduce "
          "| ratio to psum, median [min–max] | page faults / all-reduce | kernel ms "
          "/ all-reduce | max rel. error vs psum |")
    print("|---|---|---|---|---|---|---|---|---|")
    for v in variants:
        ratio = "1 (reference)" if v is base else spread(ratios[v.name])
        err = "bitwise equal" if v.exact else f"{v.error:.1e}"
        print(f"| {v.name} | {describe(v.counts)} | {v.compile_s:.2f} | {v.calls} "
              f"| {med(v.times) * 1e3:.1f} | {ratio} | {med(v.faults) / 1e3:.1f} k "
              f"| {med(v.kernel) * 1e3:.1f} | {err} |")
    rules = sorted({v.checked for v in variants if v is not base and hasattr(v, "checked")})
    print(f"\nSums checked against psum's: {', '.join(rules)}; psum's against NumPy's: "
          f"{base.checked}.")
    same = [v.name for v in variants if v is not base and v.hlo == base.hlo]
    print(f"Same compiled entry computation as psum (names aside): {', '.join(same) or 'none'}.")
    aa = ratios[CONTROL]
    aa_q3 = float(np.percentile(aa, 75))
    jm = [v for v in variants if v.name in SETTINGS]
    if jm:
        best = min(jm, key=lambda v: med(ratios[v.name]))
        r = med(ratios[best.name])
        verdict = ("met" if r <= 1.0 else
                   "met within noise (<= max(1.05, the A/A control's upper quartile))"
                   if r <= max(1.05, aa_q3) else "NOT met")
        print(f"Best setting: {best.name}, {med(best.times) * 1e3:.1f} ms per all-reduce, "
              f"median ratio to psum {r:.3f} (A/A control: median {med(aa):.3f}, upper "
              f"quartile {aa_q3:.3f}); goal 'not slower than psum' {verdict}."
              + (" It compiles to the same program as psum: what differs is the host's work "
                 "per call, or noise." if best.name in same else ""))
    print(f"total {time.perf_counter() - t_start:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
