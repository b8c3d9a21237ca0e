#!/usr/bin/env python
"""Per-step cost of a jaxmirror train step against the same step written by hand in JAX.

The same MLP train step (a params dict, optax adam, loss via ``jaxmirror.compute_average_loss``,
gradients all-reduced with SUM) runs two ways on N simulated CPU devices (N = 2, 4, 8 by default;
``--devices 1,2,4,8`` adds one replica):

  (a) jaxmirror: ``@strategy.run`` on a ``MirroredStrategy`` over the first N devices; the batches
      are the ``PerReplica`` values of ``strategy.experimental_distribute_dataset``, placed once
      before timing; params and optimizer state are arrays replicated over the devices.
  (b) baseline: ``jax.jit(jax.shard_map(body, mesh=Mesh(devices, ("replica",)), ...,
      check_vma=False))`` with ``jax.lax.psum`` for the all-reduce, fed the very same placed
      arrays (the ``PerReplica``'s global array) and the same replicated params.

Both start from the same params and see the same batches in the same order. After warm-up the
script asserts that their params agree (and says whether bit for bit) and that jaxmirror traced
the step once and compiled one program for it. After timing it reports how far the params
drifted apart (last-bit differences grow over thousands of adam steps), then starts every loop
from the baseline's state and asserts again that two more steps agree.

Fairness: with N >= 2 CPU devices jaxmirror bounds the steps in flight
(``jaxmirror.core.inflight.MAX_IN_FLIGHT``, 8): once 8 steps are queued each call waits for the
oldest, because an unbounded CPU loop can deadlock XLA's collectives. There the baseline loop
keeps the same queue by hand (it remembers the loss of each step and waits on the oldest past 8).
With one device neither bounds anything.

Measured, per model size and N, with the variants alternated in rounds to cancel drift
(A, B, B', then B, B', A, ...: B' is a second, identical copy of the baseline loop, an A/A control
whose ratio to B shows how much of a difference this machine's noise alone makes):
  * seconds/step: K steps per round, ``block_until_ready`` at the end of the round; the median
    over rounds, and the median (and quartiles) over rounds of the ratio jaxmirror/baseline
    taken within each round (goal <= 1.05);
  * dispatch (host overhead) per call: the time to return from K_d = MAX_IN_FLIGHT calls started
    from an idle machine, without blocking (so the in-flight bound never waits on compute),
    divided by K_d; the median over rounds, and the difference jaxmirror - baseline.
With ``--breakdown`` (on by default) it also splits jaxmirror's per-call host time (tiny model;
N=1 added) into the pieces of ``Program.__call__``: ``check_can_run``, the jitted call, and on
bounded strategies ``_inflight.track_array(prog.output_handle(out))``, next to the baseline's own queue.
With ``--ablation`` it times steady-state loops of the baseline, of jaxmirror, and of
``Program.jitted`` called directly with the baseline's queue: the gap between the last two is
jaxmirror's Python around the jitted call, the gap between the first and last the jitted call
itself (jaxmirror is not patched).

Run from the repository root (``make bench`` runs the first line):
    .venv/bin/python benchmarks/step_overhead.py                          # N = 2, 4, 8; ~1.5 min
    .venv/bin/python benchmarks/step_overhead.py --devices 1,2,4,8 --ablation       # ~2 min
    .venv/bin/python benchmarks/step_overhead.py --quick          # a sanity run, ~30 s, noisy
"""

from __future__ import annotations

import os

from _platform import simulated_cpu_devices  # noqa: E402  (before JAX; CPU unless JAX_PLATFORMS)

_FLAG = simulated_cpu_devices(8)

import argparse  # noqa: E402
import collections  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxmirror  # noqa: E402
from jaxmirror.core import inflight as _inflight  # noqa: E402  (the bound, and the queue for --breakdown)
from jaxmirror.step.program import check_can_run  # noqa: E402  (timed by --breakdown)
from _timing import check_close, devices_line, platform_of  # noqa: E402  (shared)
from _timing import dispatch, init_params, mlp, steps_and_cases  # noqa: E402  (shared)
from _timing import one_call as _one_call, per_call as _per_call  # noqa: E402
from _timing import shuffled_rounds as _shuffled_rounds, timed as _timed, us as _us  # noqa: E402

MAX_IN_FLIGHT = _inflight.MAX_IN_FLIGHT
NUM_BATCHES = 4  # distinct placed batches, cycled through

# name -> (global batch, layer sizes, default steps per round)
MODELS = {
    "tiny": (16, (8, 16, 4), 100),  # a few hundred flops: host overhead dominates
    "small": (256, (784, 512, 10), 8),  # an MNIST-sized MLP step
}


# ----------------------------------------------------------------------------------------------
# The model, shared verbatim by both variants
# ----------------------------------------------------------------------------------------------


TX = optax.adam(1e-3)


def make_jaxmirror_step(strategy):
    @strategy.run
    def train_step(params, opt_state, x, y):
        def loss_fn(p):
            per_example = optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y)
            return jaxmirror.compute_average_loss(per_example)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        ctx = jaxmirror.get_replica_context()
        grads = ctx.all_reduce("sum", grads)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ctx.all_reduce("sum", loss)

    return train_step


def make_baseline_step(mesh, n):
    def body(params, opt_state, x, y):
        x, y = x.reshape(x.shape[1:]), y.reshape(y.shape[1:])  # this replica's (1, b, ...) block

        def loss_fn(p):
            per_example = optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y)
            global_batch = per_example.shape[0] * n  # what compute_average_loss does
            return jnp.sum(per_example) / jnp.asarray(global_batch).astype(per_example.dtype)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = jax.lax.psum(grads, "replica")
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.psum(loss, "replica")

    return jax.jit(jax.shard_map(
        body, mesh=mesh,
        in_specs=(P(), P(), P("replica"), P("replica")),
        out_specs=(P(), P(), P()),
        check_vma=False,
    ))


# ----------------------------------------------------------------------------------------------
# One (model, N) case: the variants, their state and their loops
# ----------------------------------------------------------------------------------------------
class Loop:
    """One variant's training loop: its step, its batches, its params and optimizer state.

    ``bound`` says whether the loop keeps an in-flight queue itself: the baseline does where
    jaxmirror's ``Program.__call__`` bounds its own (N >= 2 CPU devices); jaxmirror's loop never.
    """

    def __init__(self, name, step, batches, state, bound: bool):
        self.name, self.step, self.batches, self.bound = name, step, batches, bound
        self.state = state
        self.i = 0  # batch counter: every variant sees the same sequence of batches
        self.queue: collections.deque = collections.deque()

    def __call__(self, k: int):
        """Run k steps, return the last loss (not waited for)."""
        step, batches, queue, bound = self.step, self.batches, self.queue, self.bound
        (params, opt_state), i = self.state, self.i
        loss = None
        for _ in range(k):
            x, y = batches[i % NUM_BATCHES]
            params, opt_state, loss = step(params, opt_state, x, y)
            if bound:  # what jaxmirror does here: wait for the oldest past MAX_IN_FLIGHT
                queue.append(loss)
                if len(queue) > MAX_IN_FLIGHT:
                    queue.popleft().block_until_ready()
            i += 1
        self.state, self.i = (params, opt_state), i
        return loss


class Case:
    """A model size on N replicas: jaxmirror, the baseline, and a second baseline (A/A control)."""

    def __init__(self, model: str, n: int, seed: int = 0):
        global_batch, sizes, _ = MODELS[model]
        self.model, self.n = model, n
        devices = self.devices = jax.devices()[:n]
        self.strategy = jaxmirror.MirroredStrategy(devices)
        self.mesh = Mesh(np.array(devices), ("replica",))

        rng = np.random.default_rng(seed)
        host = [(rng.standard_normal((global_batch, sizes[0])).astype(np.float32),
                 rng.integers(0, sizes[-1], global_batch).astype(np.int32))
                for _ in range(NUM_BATCHES)]
        # Placed once, before timing: PerReplica values for jaxmirror, their arrays for the
        # baseline.
        self.jm_batches = list(self.strategy.experimental_distribute_dataset(host))
        if n > 1:
            self.base_batches = [(x.stacked, y.stacked) for x, y in self.jm_batches]
        else:  # one replica: jaxmirror takes plain arrays; give the baseline its (1, b, ...) block
            stacked = NamedSharding(self.mesh, P("replica"))
            self.base_batches = [jax.device_put((x[None], y[None]), stacked)
                                 for x, y in self.jm_batches]

        replicated = NamedSharding(self.mesh, P())
        params = init_params(jax.random.key(seed), sizes)
        opt_state = TX.init(params)
        self.jm_step = make_jaxmirror_step(self.strategy)
        self.base_step = make_baseline_step(self.mesh, n)
        self.bounded = self.strategy.extended.placement.bound_in_flight  # jaxmirror's own queue is on
        # Independent copies of the same initial state (nothing is donated, but be safe).
        self.jm = Loop("jaxmirror", self.jm_step, self.jm_batches,
                       jax.device_put((params, opt_state), replicated), bound=False)
        self.base = Loop("baseline", self.base_step, self.base_batches,
                         jax.device_put((params, opt_state), replicated), bound=self.bounded)
        self.base2 = Loop("baseline'", self.base_step, self.base_batches,
                          jax.device_put((params, opt_state), replicated), bound=self.bounded)
        self.loops = (self.jm, self.base, self.base2)

    def sync(self):
        jax.block_until_ready([loop.state for loop in self.loops])

    def check_traced_once(self):
        """Assert jaxmirror traced the user's step once and built one program for it."""
        step = self.jm_step
        assert (step.trace_count, step.compile_count) == (1, 1), (
            f"jaxmirror retraced: trace_count={step.trace_count}, "
            f"compile_count={step.compile_count}")

    def drift(self) -> tuple[float, bool]:
        """``(max |jaxmirror - baseline|, bitwise)`` of the params, not asserted."""
        ref = jax.tree.map(np.asarray, self.base.state[0])
        got = jax.tree.map(np.asarray, self.jm.state[0])
        worst = max(float(np.max(np.abs(got[k] - ref[k]))) for k in ref)
        return worst, all(np.array_equal(got[k], ref[k]) for k in ref)

    def resync(self) -> None:
        """Every loop continues from the baseline's params and optimizer state (copies)."""
        for loop in (self.jm, self.base2):
            loop.state = jax.tree.map(lambda a: a.copy(), self.base.state)

    def check_agree(self, where: str, gpu_rtol: float = 1e-5) -> tuple[float, bool]:
        """Assert jaxmirror's params agree with the baseline's (bit for bit on CPU; on a GPU within
        ``gpu_rtol``, atol ``gpu_rtol / 10``: a few adam steps from the same state, two programs'
        float32 rounding); return (max |diff|, bitwise)."""
        worst, exact = 0.0, True
        ref = jax.tree.map(np.asarray, self.base.state[0])
        for loop in (self.jm, self.base2):
            assert loop.i == self.base.i, (loop.name, loop.i, self.base.i)
            got = jax.tree.map(np.asarray, loop.state[0])
            self.checked = check_close(
                f"{self.model} N={self.n} {where}: {loop.name}'s params vs the baseline's",
                {k: got[k] for k in ref}, ref, gpu_rtol=gpu_rtol, gpu_atol=gpu_rtol / 10,
                platform=platform_of(self.devices), **({} if loop is self.base2 else CPU_TOL))
            for name in sorted(ref):
                worst = max(worst, float(np.max(np.abs(got[name] - ref[name]))))
                exact &= bool(np.array_equal(got[name], ref[name]))
        return worst, exact


# jaxmirror against the baseline on CPU: two different programs (at N = 1 jaxmirror's is no
# shard_map), which XLA may fuse differently: a value of the tiny model 6e-11 apart after the
# warm-up steps (2026-11-27). The table says whether they were equal bit for bit; the A/A copy
# must be.
CPU_TOL = {"cpu_rtol": 1e-5, "cpu_atol": 1e-6}


def bench_case(case: Case, args, steps: int) -> dict:
    # Warm-up: compile, run a few steps each, then check that they computed the same thing.
    for loop in case.loops:
        loop(args.warmup)
    case.sync()
    diff, exact = case.check_agree("after warm-up")
    case.check_traced_once()

    t = {loop.name: [] for loop in case.loops}
    d = {loop.name: [] for loop in case.loops}
    gc.collect()
    gc.disable()
    try:
        for r in range(args.rounds):  # A, B, B' rotated each round so no variant always goes first
            order = case.loops[r % 3:] + case.loops[:r % 3]
            for loop in order:
                t[loop.name].append(_timed(loop, steps))
        for r in range(args.dispatch_rounds):
            for loop in case.loops[r % 3:] + case.loops[:r % 3]:
                d[loop.name].append(dispatch(case.sync, loop, MAX_IN_FLIGHT))
    finally:
        gc.enable()
    case.sync()
    # Over thousands of adam steps the loops' last-bit differences (each program's own XLA
    # fusion) grow along the trajectory: report that drift, then start every loop from the
    # baseline's state and check that they still take the same steps.
    diff_end, exact_end = case.drift()
    case.resync()
    for loop in case.loops:
        loop(2)
    case.sync()
    case.check_agree("two steps after timing, from the baseline's state")
    case.check_traced_once()

    med = statistics.median
    tj, tb, tb2 = t["jaxmirror"], t["baseline"], t["baseline'"]
    ratios = [a / b for a, b in zip(tj, tb)]
    control = [a / b for a, b in zip(tb2, tb)]
    dj, db, db2 = d["jaxmirror"], d["baseline"], d["baseline'"]
    return dict(
        model=case.model, n=case.n,
        jm=med(tj), base=med(tb), ratio=med(ratios),
        ratio_q=(np.percentile(ratios, 25), np.percentile(ratios, 75)),
        control=med(control),
        d_jm=med(dj), d_base=med(db), d_diff=med([a - b for a, b in zip(dj, db)]),
        d_control=med([a - b for a, b in zip(db2, db)]),
        diff=max(diff, diff_end), exact=exact and exact_end,
    )


# ----------------------------------------------------------------------------------------------
# --breakdown: where jaxmirror's per-call host time goes (Program.__call__'s pieces)
# ----------------------------------------------------------------------------------------------


def breakdown(case: Case, samples: int) -> list[tuple[str, float | None]]:
    """Per-call host costs of jaxmirror's hot path (``Program.__call__``) and of its pieces.

    End-to-end rows: one call at a time from an idle machine (inputs ready, queue drained),
    the forms interleaved in random order, ``samples`` calls each; the median seconds to return.
    Piece rows: timeit-style loops (median of 7), warm caches, so smaller than in situ. The queue
    rows are None where neither loop keeps a queue (one device).
    """
    prog, strategy = case.jm_step, case.strategy
    params, opt_state = case.jm.state
    x, y = case.jm_batches[0]
    bx, by = case.base_batches[0]
    jax.block_until_ready((params, opt_state))
    _inflight.drain()
    forms = {
        "baseline: jitted shard_map call": lambda: case.base_step(params, opt_state, bx, by),
        "jaxmirror: Program.jitted only (jit of _trace)":
            lambda: prog.program.jitted(None, (), params, opt_state, x, y),
        "jaxmirror: step(...), i.e. Program.__call__": lambda: prog(params, opt_state, x, y),
        "jaxmirror: strategy.run(fn, args=...)":
            lambda: strategy.run(prog.fn, args=(params, opt_state, x, y)),
    }
    times = _shuffled_rounds({k: functools.partial(_one_call, f) for k, f in forms.items()},
                             samples)
    rows = [(k, statistics.median(v)) for k, v in times.items()]
    try:
        out = prog(params, opt_state, x, y)
        jax.block_until_ready(out)
        _inflight.drain()
        rows.append(("  piece: check_can_run(strategy)",
                     _per_call(lambda: check_can_run(strategy), 2000, 7)))
        # The handle must come from the trace-time key path (no flattening fallback): the
        # smallest output array.
        leaves = jax.tree.leaves(out)
        handle = functools.reduce(lambda t, get: get(t), prog.program.handle_path, out)
        assert prog.program.output_handle(out) is handle and any(handle is leaf for leaf in leaves), handle
        assert handle.size == min(leaf.size for leaf in leaves), handle.shape
        if case.bounded:
            for _ in range(MAX_IN_FLIGHT):  # steady state: a full queue of finished steps
                _inflight.track_array(handle)
            tracked = _per_call(lambda: _inflight.track_array(prog.program.output_handle(out)), 2000, 7)
            _inflight.drain()
            loss = out[-1]
            queue = collections.deque([loss] * MAX_IN_FLIGHT)

            def base_queue():
                queue.append(loss)
                if len(queue) > MAX_IN_FLIGHT:
                    queue.popleft().block_until_ready()

            own = _per_call(base_queue, 2000, 7)
        else:
            tracked = own = None
        rows.append(("  piece: _inflight.track_array(prog.output_handle(out)), steady state", tracked))
        rows.append(("  piece: the baseline's own queue, steady state", own))
        # PerReplica arguments through jit's C++ path: a trivial one-device program.
        dev = jax.devices()[0]
        a, b = jax.device_put(np.zeros((2, 3), np.float32), dev), jax.device_put(np.zeros(2), dev)
        trivial = jax.jit(lambda u, v: sum(t.sum() for t in jax.tree.leaves((u, v))))
        wrapped = (jaxmirror.PerReplica(a), jaxmirror.PerReplica(b))
        jax.block_until_ready((trivial(a, b), trivial(*wrapped)))
        plain_t = _per_call(lambda: trivial(a, b), 2000, 7)
        wrapped_t = _per_call(lambda: trivial(*wrapped), 2000, 7)
        rows.append(("  piece: 2 PerReplica args vs 2 arrays through jax.jit (extra)",
                     wrapped_t - plain_t))
    finally:
        _inflight.drain()
    return rows


# ----------------------------------------------------------------------------------------------
# --ablation: jaxmirror's Python around the jitted call vs the jitted call itself, in a loop
# ----------------------------------------------------------------------------------------------
JITTED_ONLY = "Program.jitted only, baseline's queue (none at N=1)"


def ablation(case: Case, rounds: int, steps: int) -> list[tuple[str, float, float]]:
    """Steady-state loops: the baseline, jaxmirror, and ``Program.jitted`` called directly.

    The last loop calls jaxmirror's cached ``jax.jit`` (PerReplica arguments, the program built
    by ``_trace``) and keeps the baseline's queue where the baseline keeps one; nothing in
    jaxmirror is patched. All loops start from the same state and run in random order each
    round. Returns (name, median s/step, median ratio to the baseline within a round).
    """
    prog = case.jm_step

    def jitted_only(*a):
        return prog.program.jitted(None, (), *a)[0]

    loops = [case.base, case.jm,
             Loop(JITTED_ONLY, jitted_only, case.jm_batches, case.base.state, bound=case.bounded)]
    loops[-1].i = case.base.i
    loops[-1](2)
    jax.block_until_ready([loop.state for loop in loops])
    times = _shuffled_rounds({loop.name: functools.partial(_timed, loop, steps) for loop in loops},
                             rounds)
    base = times["baseline"]
    return [(loop.name, statistics.median(times[loop.name]),
             statistics.median([a / b for a, b in zip(times[loop.name], base)])) for loop in loops]


# ----------------------------------------------------------------------------------------------
def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


def _tiny_case(cases: dict, n: int, warmup: int) -> Case:
    """The tiny-model case on n replicas: the one timed already, or a new one, warmed up."""
    case = cases.get(("tiny", n))
    if case is None:
        case = cases["tiny", n] = Case("tiny", n)
        for loop in case.loops:
            loop(warmup)
    return case


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="2,4,8", help="replica counts, comma-separated")
    ap.add_argument("--models", default="tiny,small", help=f"from {sorted(MODELS)}")
    ap.add_argument("--rounds", type=int, default=21, help="timed rounds per variant")
    ap.add_argument("--steps-tiny", type=int, default=None, help="steps per round, tiny model")
    ap.add_argument("--steps-small", type=int, default=None, help="steps per round, small model")
    ap.add_argument("--dispatch-rounds", type=int, default=20,
                    help=f"rounds of {MAX_IN_FLIGHT} un-awaited calls per variant")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before timing")
    ap.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=True,
                    help="also split jaxmirror's per-call overhead into its pieces (tiny model, "
                         "N=1 added)")
    ap.add_argument("--breakdown-samples", type=int, default=300,
                    help="calls per form for the --breakdown table")
    ap.add_argument("--ablation", action="store_true",
                    help="also time steady-state loops of Program.jitted called directly, "
                         "next to jaxmirror and the baseline (tiny model, N=1 added)")
    ap.add_argument("--quick", action="store_true", help="a fast sanity run (numbers are noisy)")
    args = ap.parse_args(argv)

    if args.quick:
        args.rounds, args.dispatch_rounds, args.warmup, args.breakdown_samples = 3, 5, 2, 30
    checked = steps_and_cases(ap, args, MODELS, _FLAG)
    if checked is None:
        return 2
    steps, ns, models = checked

    print(f"# jaxmirror step overhead: {devices_line()}, "
          f"{os.cpu_count()} host cores, jax {jax.__version__}, "
          f"Python {platform.python_version()}")
    print(f"# command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    print(f"# rounds={args.rounds} (jaxmirror, baseline, baseline' rotated), steps/round={steps}, "
          f"dispatch: {args.dispatch_rounds} rounds x {MAX_IN_FLIGHT} calls, warmup={args.warmup}")
    print(f"# with N >= 2, both loops keep at most {MAX_IN_FLIGHT} steps in flight (jaxmirror's "
          f"CPU bound; the baseline keeps the same queue by hand); with N = 1 neither does")
    for m in models:
        g, sizes, _ = MODELS[m]
        print(f"# {m}: global batch {g}, MLP {' -> '.join(map(str, sizes))}, adam")
    print()

    results, cases = [], {}
    for m in models:
        for n in ns:
            t0 = time.perf_counter()
            case = Case(m, n)
            r = bench_case(case, args, steps[m])
            results.append(r)
            cases[(m, n)] = case
            print(f"  done {m} N={n} in {time.perf_counter() - t0:.1f}s: ratio {r['ratio']:.3f}",
                  file=sys.stderr, flush=True)

    print("| model | N | jaxmirror ms/step | baseline ms/step | ratio jm/base, median [IQR] "
          "| A/A control base'/base | dispatch jm µs/call | dispatch base µs/call "
          "| Δ dispatch µs/call (A/A control) | params agree |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        agree = "bitwise" if r["exact"] else f"max abs diff {r['diff']:.1e}"
        lo, hi = r["ratio_q"]
        print(f"| {r['model']} | {r['n']} | {_ms(r['jm'])} | {_ms(r['base'])} "
              f"| {r['ratio']:.3f} [{lo:.3f}, {hi:.3f}] | {r['control']:.3f} "
              f"| {_us(r['d_jm'])} | {_us(r['d_base'])} "
              f"| {_us(r['d_diff'])} ({_us(r['d_control'])}) "
              f"| {agree} |")
    print()
    for m in models:
        worst = max((r for r in results if r["model"] == m), key=lambda r: r["ratio"])
        verdict = "met" if worst["ratio"] <= 1.05 else "NOT met"
        print(f"{m}: worst median ratio {worst['ratio']:.3f} (N={worst['n']}); "
              f"goal <= 1.05 {verdict}.")

    if args.breakdown:
        bns = sorted({1} | set(ns))  # one replica too: there the launch is cheap, Python shows
        print()
        print(f"Per-call host time of the tiny step, µs: end-to-end rows are the median time to "
              f"return from one call made on an idle machine ({args.breakdown_samples} calls per "
              f"form, forms interleaved at random); 'piece' rows are timeit loops (warm caches).")
        print()
        print("| form / piece | " + " | ".join(f"N={n}" for n in bns) + " |")
        print("|---|" + "---|" * len(bns))
        table = {n: breakdown(_tiny_case(cases, n, args.warmup), args.breakdown_samples)
                 for n in bns}
        for i, (name, _) in enumerate(table[bns[0]]):
            print(f"| {name} | " + " | ".join(_us(table[n][i][1]) for n in bns) + " |")

    if args.ablation:
        bns = sorted({1} | set(ns))
        print()
        print(f"Ablation, tiny model: steady-state loops ({steps['tiny']} steps a round, "
              f"{args.rounds} rounds, variants in random order each round); µs/step, and in "
              f"brackets the median ratio to the baseline within a round.")
        print()
        print("| loop | " + " | ".join(f"N={n}" for n in bns) + " |")
        print("|---|" + "---|" * len(bns))
        table = {}
        for n in bns:
            table[n] = ablation(_tiny_case(cases, n, args.warmup), args.rounds, steps["tiny"])
            print(f"  ablation N={n} done", file=sys.stderr, flush=True)
        for i, (name, _, _) in enumerate(table[bns[0]]):
            cells = [f"{table[n][i][1] * 1e6:.1f} ({table[n][i][2]:.3f})" for n in bns]
            print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
