#!/usr/bin/env python
"""What the guard against deleted (donated) arrays costs a ``strategy.run`` call.

JAX 0.10 segfaults when an array an earlier call donated reaches a multi-device program it has
run before; jaxmirror's guard (``jaxmirror/step/arguments.py``) deletes, after each call of a
step that donates, the arrays JAX took (``forget_donated``: one pass over the donated
arguments' leaves), so that a later call raises and the error can name the argument. Steps that
donate nothing do no per-call work for it. This script times, on a params tree of ``--leaves``
leaves (default 50: 25 layers of an (8, 8) weight and an (8,) bias) on a ``MirroredStrategy``
over the first ``--devices`` of 8 simulated CPU devices:

  * donating: ``params, loss = strategy.run(fn, (params, x), options=RunOptions(
    donate_argnums=(0,)))``, with the guard, and with ``forget_donated`` replaced by a no-op
    (what the call cost before the guard);
  * not donating: the same call without ``options`` (no guard work), and the same call after a
    full check of every argument leaf (``is_deleted``), the design not taken, for comparison.

Method: each timer runs ``--calls`` calls and waits for the last result (per-call time, device
work included); ``--rounds`` rounds, the timers in a fresh random order each round, GC off
(``_timing.shuffled_rounds``). Ratios are taken within a round: median [min-max] over rounds.
The guard's own pass is also timed alone (``_timing.per_call`` on live params, where it deletes
nothing). Before timing, the script asserts that both donating variants compute the same
params and that each step traced once; at the end that none traced again.

Run from the repository root:
    .venv/bin/python benchmarks/deleted_array_guard.py               # ~10 s on 2 cores
    .venv/bin/python benchmarks/deleted_array_guard.py --leaves 1000 --calls 10
    .venv/bin/python benchmarks/deleted_array_guard.py --quick       # a smoke run, noisy
"""

from __future__ import annotations


from _platform import simulated_cpu_devices  # noqa: E402  (before JAX; CPU unless JAX_PLATFORMS)

_FLAG = simulated_cpu_devices(8)

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxmirror  # noqa: E402
from jaxmirror.step import arguments, call_plan  # noqa: E402  (the guard, patched out to compare)
from _timing import checkout, machine, per_call, shuffled_rounds, spread  # noqa: E402
from _timing import check_close, platform_of, too_few_devices  # noqa: E402

LR = 1e-3


def host_params(leaves: int) -> dict:
    rng = np.random.default_rng(0)
    shapes = [(8, 8), (8,)] * (leaves // 2) + [(8,)] * (leaves % 2)
    return {f"p{i:04d}": rng.standard_normal(s).astype(np.float32)
            for i, s in enumerate(shapes)}


def fn(params, x):
    loss = jaxmirror.get_replica_context().all_reduce("SUM", x)
    return jax.tree.map(lambda p: p - LR * p, params), loss


def full_check(args) -> None:
    """The design not taken: every leaf of every call checked before it runs."""
    for leaf in jax.tree.leaves(args):
        is_deleted = getattr(leaf, "is_deleted", None)
        if is_deleted is not None and is_deleted():
            raise ValueError("deleted")


def loop(s, calls: int, donate: bool, check: bool, params):
    """A timer: ``calls`` run calls from the current params, per-call seconds."""
    options = jaxmirror.RunOptions(donate_argnums=(0,)) if donate else None
    state = {"params": params}
    x = np.float32(1.0)

    def timer() -> float:
        p = state["params"]
        t0 = time.perf_counter()
        for _ in range(calls):
            if check:
                full_check((p, x))
            p, loss = s.run(fn, (p, x), options=options)
        jax.block_until_ready((p, loss))
        state["params"] = p
        return (time.perf_counter() - t0) / calls

    return timer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--leaves", type=int, default=50)
    ap.add_argument("--devices", type=int, default=2,
                    help="replicas (simulated CPU devices; GPUs with JAX_PLATFORMS=cuda)")
    ap.add_argument("--calls", type=int, default=50, help="calls per timer per round")
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--quick", action="store_true", help="3 rounds of 10 calls")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.calls = 3, 10
    t_start = time.perf_counter()
    problem = too_few_devices(args.devices, _FLAG)
    if problem:
        raise SystemExit(problem)
    s = jaxmirror.MirroredStrategy(jax.devices()[:args.devices])
    host = host_params(args.leaves)
    guard = call_plan.forget_donated
    off = lambda *a: None  # noqa: E731

    def with_guard(timer, on):
        def timed():
            call_plan.forget_donated = guard if on else off
            try:
                return timer()
            finally:
                call_plan.forget_donated = guard
        return timed

    timers = {
        "donating, guard": with_guard(loop(s, args.calls, True, False,
                                           s.experimental_replicate(host)), True),
        "donating, no guard": with_guard(loop(s, args.calls, True, False,
                                              s.experimental_replicate(host)), False),
        "not donating": loop(s, args.calls, False, False, s.experimental_replicate(host)),
        "not donating, full check": loop(s, args.calls, False, True,
                                         s.experimental_replicate(host)),
    }
    # Warm-up: compile, and both donating variants compute the same params.
    a = s.run(fn, (s.experimental_replicate(host), np.float32(1.0)),
              options=jaxmirror.RunOptions(donate_argnums=(0,)))[0]
    call_plan.forget_donated = off
    b = s.run(fn, (s.experimental_replicate(host), np.float32(1.0)),
              options=jaxmirror.RunOptions(donate_argnums=(0,)))[0]
    call_plan.forget_donated = guard
    # The same program on the same arrays, with and without the guard (host work only):
    # equal bit for bit on CPU; on a GPU rtol 1e-6 (one step, one program; the bits should
    # match there too, the tolerance only admits a nondeterministic reduction order).
    checked = check_close("donating with the guard vs without", {k: a[k] for k in host},
                          {k: b[k] for k in host}, gpu_rtol=1e-6, platform=platform_of(a))
    for timer in timers.values():
        timer()
    steps = [s.function(fn, donate_argnums=d) for d in ((0,), ())]
    counts = [(st.trace_count, st.compile_count) for st in steps]
    assert all(t == 1 for t, _ in counts), counts

    times = shuffled_rounds(timers, args.rounds)
    assert [(st.trace_count, st.compile_count) for st in steps] == counts, "compiled again"
    live = s.experimental_replicate(host)
    guard_alone = per_call(lambda: arguments.forget_donated(
        arguments.donated_arrays((live,), {}, (0,), "run")), 200, 7)
    check_alone = per_call(lambda: full_check((live, 1.0)), 200, 7)

    def ratio(x, y):
        return spread([p / q for p, q in zip(times[x], times[y])])

    print(f"# deleted-array guard: {machine()}")
    print(f"# jaxmirror {checkout()}; {args.leaves} leaves, N = {args.devices}, "
          f"{args.calls} calls x {args.rounds} rounds; took {time.perf_counter() - t_start:.0f} s; "
          f"params of both donating variants equal: {checked}")
    print()
    print("| run call | µs per call (median) |")
    print("|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts) * 1e6:.1f} |")
    print()
    print(f"donating, guard / no guard: {ratio('donating, guard', 'donating, no guard')}")
    print(f"not donating, full check / none: "
          f"{ratio('not donating, full check', 'not donating')}")
    print(f"the guard's pass alone: {guard_alone * 1e6:.2f} µs per call "
          f"({guard_alone * 1e9 / args.leaves:.0f} ns per leaf); a full check of every leaf: "
          f"{check_alone * 1e6:.2f} µs")


if __name__ == "__main__":
    main()
