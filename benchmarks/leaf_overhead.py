#!/usr/bin/env python
"""Host overhead of one jaxmirror step call as a function of the number of parameter leaves.

The same SGD-like update runs on a params pytree of L leaves (L = 10, 100, 1000 by default),
each a small float32 array of shape ``(8,)``, on a ``MirroredStrategy`` over the first N of 8
simulated CPU devices (N = 1, 2, 8 by default). The body, per replica (``--body``):

  * ``scale`` (the default): ``p <- p - lr * p`` for every leaf, and a scalar "loss"
    (``0.5 * sum(p0^2) / N`` of the first leaf) all-reduced (SUM) and returned: one small
    collective, so the device time stays small next to the host's and the programs compile in
    seconds;
  * ``grad``: ``g = all_reduce("SUM", p / N)`` (the gradient of ``0.5 * sum(p^2) / N``; one
    all-reduce per leaf, which XLA combines), ``p <- p - lr * g``, and the same scalar. On
    simulated CPU devices 1000 tiny all-reduces cost about 0.1 s a step on 8 devices and
    seconds to compile, so this is slow and its dispatch times include device work competing
    for the 2 cores.

Four loops:

  (a) pytree: ``step = strategy.function(fn)``; ``params, loss = step(params)``, the params
      placed once with ``strategy.experimental_replicate``, the new params coming back
      replicated;
  (b) variables by closure (TF style): the L leaves are ``jaxmirror.Variable``s made in
      ``strategy.scope()``; the step reads each (``v.read_value()``), computes the same update
      (collectives through ``get_replica_context().all_reduce``), assigns each (``v.assign``)
      and returns the scalar: ``loss = step()``;
  (base) the same body as ``jax.jit(jax.shard_map(body, mesh=Mesh(devices[:N], ("replica",)),
      in_specs=P(), out_specs=(P(), P()), check_vma=False))`` with ``jax.lax.psum``, on the
      same leaves placed with ``NamedSharding(mesh, P())``: ``params, loss = base(params)``;
  (base') a second, independent copy of (base): the A/A control.

Fairness: with N >= 2 CPU devices jaxmirror keeps at most ``MAX_IN_FLIGHT`` (8) steps in flight
(it waits on the oldest past that); the baseline loops then keep the same queue by hand, as
``step_overhead.py`` does (one array per step: the loss). With N = 1 nobody bounds anything.

Measured per (L, N), after a warm-up that compiles everything (and asserts that (a), (b) and
(base) computed the same params and that each jaxmirror step traced once and built one program),
in rounds; each round times every loop twice, all 8 timers in a fresh random order
(``_timing.shuffled_rounds``, GC off):
  * dispatch: the time to *return* from ``MAX_IN_FLIGHT`` calls (``--dispatch-calls``) started
    on an idle machine (``_timing.dispatch``: all loops synced, every queue drained and the
    variables' open steps closed first), per call: the host's work to launch one step; this is
    what the goal is about. On 2 cores the later calls of the 8 compete with the device threads
    of the earlier ones, so at N = 8 this is noisy;
  * loop: K steps, ``block_until_ready`` at the end, per step (device time included).
Differences jm - base are taken within a round; the tables give the median over rounds, and the
A/A row base' - base shows what noise alone makes. At the end the params must still agree, and
no step may have traced or compiled again. Agree: bit for bit on CPU; on a GPU (with
``JAX_PLATFORMS=cuda``, e.g. ``--devices 1``) rtol 1e-5 after the warm-up and 1e-4 after timing
(atol 1e-7), since each step may round once differently in each program.

The goal (the issue): the host overhead of a ``run`` call is within 20 µs of the plain jitted
call at 10, 100 and 1000 leaves, i.e. flat in the leaf count. The last table gives, per style,
N and L, the median dispatch difference and a verdict that takes the A/A noise into account.
The loops' own JAX cost grows with L·N (jit's C++ dispatch handles one buffer per leaf and
device: about 2 µs per leaf at N = 1 here), so "Δ per leaf" is the column to read for
flatness.

Run from the repository root:
    .venv/bin/python benchmarks/leaf_overhead.py            # L = 10,100,1000; N = 1,2,8; ~40 s
    .venv/bin/python benchmarks/leaf_overhead.py --quick    # a smoke run, noisy
    .venv/bin/python benchmarks/leaf_overhead.py --append   # also append to RESULTS.md
"""

from __future__ import annotations

import os

from _platform import simulated_cpu_devices  # noqa: E402  (before JAX; CPU unless JAX_PLATFORMS)

_FLAG = simulated_cpu_devices(8)

import argparse  # noqa: E402
import collections  # noqa: E402
import functools  # noqa: E402
import io  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxmirror  # noqa: E402
from jaxmirror.core import inflight as _inflight  # noqa: E402  (the bound; drained before timing)
from _timing import check_close, platform_of, too_few_devices  # noqa: E402  (shared)
from _timing import (append_section, checkout, dispatch, machine,  # noqa: E402  (shared)
                     shuffled_rounds, timed, us)

MAX_IN_FLIGHT = _inflight.MAX_IN_FLIGHT
LR = 1e-3  # small: over thousands of steps the params shrink by e^-few, never to denormals
LEAF_SHAPE = (8,)
PYTREE, VARIABLES, BASE, BASE2 = "pytree (a)", "variables (b)", "base", "base'"
GOAL_US = 20.0  # the issue's goal: Δ dispatch per call, µs
RESULTS = pathlib.Path(__file__).resolve().parent / "RESULTS.md"


def host_params(leaves: int) -> dict:
    rng = np.random.default_rng(leaves)
    return {f"p{i:04d}": rng.standard_normal(LEAF_SHAPE).astype(np.float32)
            for i in range(leaves)}


def update(params, n: int, all_reduce, body: str):
    """The new params and a scalar all-reduced over the replicas; ``body``: "scale" or "grad".

    The scalar (the step's "loss": ``0.5 * sum(p0^2) / n`` of the first leaf, summed over the
    replicas) gives every variant one small collective and one small result to wait on. A loss
    summed over all the leaves would cost XLA 3-10 s to compile at 1000 leaves, for nothing this
    benchmark measures.
    """
    if body == "scale":
        grads = params  # the SUM over replicas of p / n, without a collective
    else:  # the gradient of 0.5 * sum(p^2) / n on each replica, all-reduced leaf by leaf
        grads = all_reduce(jax.tree.map(lambda p: p / n, params))
    new = jax.tree.map(lambda p, g: p - LR * g, params, grads)
    first = jax.tree.leaves(params)[0]
    return new, all_reduce(0.5 * jnp.sum(first * first) / n)


class Loop:
    """A loop of one variant: ``loop(k)`` runs k steps and returns the last loss.

    ``call(state) -> (state, loss)``. With ``bound``, the loop keeps jaxmirror's in-flight queue
    by hand: it remembers each step's loss and waits for the oldest past ``MAX_IN_FLIGHT``.
    """

    def __init__(self, name, call, state, bound: bool, params):
        self.name, self.call, self.state, self.bound = name, call, state, bound
        self.params = params  # () -> the current params, as a dict of arrays
        self.queue: collections.deque = collections.deque()
        self.last = None

    def __call__(self, k: int):
        call, queue, bound, state = self.call, self.queue, self.bound, self.state
        loss = None
        for _ in range(k):
            state, loss = call(state)
            if bound:  # what jaxmirror does: wait for the oldest past MAX_IN_FLIGHT
                queue.append(loss)
                if len(queue) > MAX_IN_FLIGHT:
                    queue.popleft().block_until_ready()
        self.state, self.last = state, loss
        return loss

    def sync(self):
        jax.block_until_ready((self.state, self.last))
        self.queue.clear()  # all finished


class Case:
    """L leaves on N replicas: the four loops, from the same params."""

    def __init__(self, leaves: int, n: int, body: str):
        self.leaves, self.n = leaves, n
        devices = self.devices = jax.devices()[:n]
        strategy = self.strategy = jaxmirror.MirroredStrategy(devices)
        mesh = Mesh(np.array(devices), ("replica",))
        params = host_params(leaves)
        bounded = strategy.extended.placement.bound_in_flight

        def all_reduce(x):
            return jaxmirror.get_replica_context().all_reduce("SUM", x)

        # (a) the params pytree as the argument, the new params as the result
        def pytree_fn(p):
            return update(p, n, all_reduce, body)

        self.pytree_step = strategy.function(pytree_fn)
        self.a = Loop(PYTREE, self.pytree_step, strategy.experimental_replicate(params),
                      bound=False, params=lambda: self.a.state)

        # (b) the params as variables captured by closure, assigned
        with strategy.scope():
            variables = {k: jaxmirror.Variable(v, name=k) for k, v in params.items()}

        def variables_fn():
            values = {k: v.read_value() for k, v in variables.items()}
            new, loss = update(values, n, all_reduce, body)
            for k, v in variables.items():
                v.assign(new[k])
            return loss

        self.variables_step = strategy.function(variables_fn)
        step_b = self.variables_step
        self.b = Loop(VARIABLES, lambda _: (None, step_b()), None, bound=False,
                      params=lambda: {k: v.read_value() for k, v in variables.items()})
        first = next(iter(variables.values()))
        # an eager read settles every open step that wrote the variable (here: all of them)
        self.b.sync = lambda: (first.read_value().block_until_ready(),
                               jax.block_until_ready(self.b.last))

        # (base) and (base'): the same body, hand-written
        def body_fn(p):
            return update(p, n, lambda x: jax.lax.psum(x, "replica"), body)

        base_step = jax.jit(jax.shard_map(body_fn, mesh=mesh, in_specs=P(),
                                          out_specs=(P(), P()), check_vma=False))
        replicated = NamedSharding(mesh, P())
        self.base = Loop(BASE, base_step, jax.device_put(params, replicated), bound=bounded,
                         params=lambda: self.base.state)
        self.base2 = Loop(BASE2, base_step, jax.device_put(params, replicated), bound=bounded,
                          params=lambda: self.base2.state)
        self.loops = (self.a, self.b, self.base, self.base2)

    def sync(self):
        """Every loop's steps finished, every queue empty: the machine is idle."""
        for loop in self.loops:
            loop.sync()
        _inflight.drain()

    def counts(self):
        return {s.__name__: (s.trace_count, s.compile_count)
                for s in (self.pytree_step, self.variables_step)}

    def check_agree(self, where: str, gpu_rtol: float = 1e-5) -> bool:
        """Assert (a), (b) and base' hold base's params (``check_close``: bit for bit on CPU;
        on a GPU within ``gpu_rtol``, atol 1e-7: one float32 rounding a step, an FMA or not,
        in each program); return whether bit for bit."""
        ref = {k: np.asarray(v) for k, v in self.base.params().items()}
        exact = True
        for loop in (self.a, self.b, self.base2):
            got = {k: np.asarray(v) for k, v in loop.params().items()}
            check_close(f"L={self.leaves} N={self.n} {where}: {loop.name}'s params vs base's",
                        {k: got[k] for k in ref}, ref, gpu_rtol=gpu_rtol, gpu_atol=1e-7,
                        platform=platform_of(self.devices))
            exact &= all(np.array_equal(got[k], ref[k]) for k in ref)
        return exact


def bench(leaves: int, n: int, args) -> dict:
    t0 = time.perf_counter()
    case = Case(leaves, n, args.body)
    for loop in case.loops:  # compile, and the first steps of each
        loop(args.warmup)
    case.sync()
    compiled_s = time.perf_counter() - t0
    exact = case.check_agree("after warm-up")
    counts = case.counts()
    for name, c in counts.items():
        assert c == (1, 1), f"L={leaves} N={n}: {name} traced/compiled {c} times (want (1, 1))"

    timers = {}
    for loop in case.loops:
        timers["loop", loop.name] = functools.partial(timed, loop, args.steps)
        timers["dispatch", loop.name] = functools.partial(dispatch, case.sync, loop,
                                                          args.dispatch_calls)
    times = shuffled_rounds(timers, args.rounds, args.case_seconds)
    case.sync()
    # GPU: up to ~1000 steps, each maybe one rounding apart (relative 6e-8): rtol 1e-4.
    exact &= case.check_agree("after timing", gpu_rtol=1e-4)
    assert case.counts() == counts, f"L={leaves} N={n}: retraced while timed: {case.counts()}"

    med = statistics.median
    out = {"leaves": leaves, "n": n, "rounds": len(times["loop", BASE]), "exact": exact,
           "compiled_s": compiled_s}
    for kind in ("loop", "dispatch"):
        base = times[kind, BASE]
        for loop in case.loops:
            t = times[kind, loop.name]
            out[kind, loop.name] = med(t)
            out[kind, "diff", loop.name] = med([a - b for a, b in zip(t, base)])
    return out


def print_tables(results, args, ns, leaf_counts, file=sys.stdout) -> None:
    p = functools.partial(print, file=file)
    for kind, what in (("dispatch", f"host dispatch, µs per call (time to return from "
                                    f"{args.dispatch_calls} calls started on an idle machine)"),
                       ("loop", f"steady loop, µs per step ({args.steps} steps, then "
                                f"block_until_ready)")):
        p(f"{what}; Δ = median over rounds of (variant − base) within a round, A/A = base' − "
          f"base.")
        p()
        p("| N | leaves | rounds | base | pytree (a) | variables (b) | Δ (a) | Δ (b) | A/A "
          "| Δ (a) per leaf | Δ (b) per leaf |")
        p("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in results:
            da, db = r[kind, "diff", PYTREE], r[kind, "diff", VARIABLES]
            p(f"| {r['n']} | {r['leaves']} | {r['rounds']} | {us(r[kind, BASE])} "
              f"| {us(r[kind, PYTREE])} | {us(r[kind, VARIABLES])} | {us(da)} | {us(db)} "
              f"| {us(r[kind, 'diff', BASE2])} | {da / r['leaves'] * 1e9:+.0f} ns "
              f"| {db / r['leaves'] * 1e9:+.0f} ns |")
        p()
    p("params agree with base after warm-up and after timing: "
      + ", ".join(f"L={r['leaves']} N={r['n']} {'bitwise' if r['exact'] else 'allclose'}"
                  for r in results))
    p("compile + warm-up per case, s: "
      + ", ".join(f"L={r['leaves']} N={r['n']} {r['compiled_s']:.1f}" for r in results))
    p()
    p(f"Goal: Δ dispatch <= {GOAL_US:.0f} µs at every leaf count. Per (N, L): 'met' when the "
      f"median Δ is <= {GOAL_US:.0f} µs, 'NOT met' when it exceeds {GOAL_US:.0f} µs by more "
      f"than |A/A| (the noise the same loop shows against itself), else 'unresolved'.")
    p()
    p("| style | " + " | ".join(f"N={n}" for n in ns) + " |")
    p("|---|" + "---|" * len(ns))
    for style in (PYTREE, VARIABLES):
        cells = []
        for n in ns:
            parts = []
            for r in (r for r in results if r["n"] == n):
                d, aa = r["dispatch", "diff", style], abs(r["dispatch", "diff", BASE2])
                v = ("met" if d <= GOAL_US * 1e-6 else
                     "NOT met" if d - aa > GOAL_US * 1e-6 else "unresolved")
                parts.append(f"L={r['leaves']}: {us(d)} {v}")
            cells.append("; ".join(parts))
        p(f"| {style} | " + " | ".join(cells) + " |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="1,2,8", help="replica counts, comma-separated")
    ap.add_argument("--leaves", default="10,100,1000", help="leaf counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=5, help="rounds at least, per case")
    ap.add_argument("--case-seconds", type=float, default=1.5,
                    help="more rounds (up to 10x --rounds) while a case's timing took less")
    ap.add_argument("--steps", type=int, default=8, help="steps per loop timer")
    ap.add_argument("--dispatch-calls", type=int, default=MAX_IN_FLIGHT,
                    help="calls per dispatch timer, started on an idle machine (at most "
                         f"{MAX_IN_FLIGHT}, so that the in-flight bound never waits)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per loop")
    ap.add_argument("--body", choices=("scale", "grad"), default="scale",
                    help="the update: p - lr*p with an all-reduced loss, or the gradient "
                         "all-reduced leaf by leaf (slow on CPU devices; see above)")
    ap.add_argument("--quick", action="store_true", help="a smoke run (numbers are noisy)")
    ap.add_argument("--append", action="store_true",
                    help=f"also append the tables, dated, to {RESULTS.name}")
    ap.add_argument("--results", type=pathlib.Path, default=RESULTS,
                    help="the file --append appends to")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.case_seconds, args.steps = 3, 0.0, 8
    if not 1 <= args.dispatch_calls <= MAX_IN_FLIGHT:
        ap.error(f"--dispatch-calls must be in 1..{MAX_IN_FLIGHT}")
    ns = [int(s) for s in args.devices.split(",")]
    leaf_counts = [int(s) for s in args.leaves.split(",")]
    problem = too_few_devices(max(ns), _FLAG)
    if problem:
        print(problem, file=sys.stderr)
        return 2

    command = " ".join([os.path.basename(sys.executable)] + sys.argv)
    header = io.StringIO()
    h = functools.partial(print, file=header)
    h(f"# host overhead vs parameter leaves: {machine()}")
    h(f"# command: {command}")
    h(f"# jaxmirror: {jaxmirror.__file__} ({checkout()})")
    what = ("p - lr*p and a scalar all-reduced (SUM)" if args.body == "scale" else
            "p - lr*g with g = all_reduce(SUM, p/N) leaf by leaf, and a scalar all-reduced")
    h(f"# leaves of shape {LEAF_SHAPE} float32; --body {args.body}: {what}; lr {LR}; "
      f"rounds >= {args.rounds} (more up to "
      f"{args.case_seconds:g} s a case), 8 timers per round in random order, "
      f"warm-up {args.warmup}" + (" (--quick: noisy)" if args.quick else ""))
    h(f"# with N >= 2 every loop keeps at most {MAX_IN_FLIGHT} steps in flight (jaxmirror's "
      f"CPU bound; the baselines by hand)")
    print(header.getvalue())

    results, t_start = [], time.perf_counter()
    for n in ns:
        for leaves in leaf_counts:
            t0 = time.perf_counter()
            r = bench(leaves, n, args)
            results.append(r)
            print(f"  done L={leaves} N={n} in {time.perf_counter() - t0:.1f}s: Δ dispatch "
                  f"(a) {us(r['dispatch', 'diff', PYTREE])} µs, (b) "
                  f"{us(r['dispatch', 'diff', VARIABLES])} µs", file=sys.stderr, flush=True)
    total = time.perf_counter() - t_start
    tables = io.StringIO()
    print_tables(results, args, ns, leaf_counts, file=tables)
    print(tables.getvalue())
    print(f"# total {total:.0f} s", file=sys.stderr)

    if args.append:
        append_section(args.results, "host overhead vs parameter leaves", command, header.getvalue(),
                       tables.getvalue(), total)
    return 0


if __name__ == "__main__":
    sys.exit(main())
