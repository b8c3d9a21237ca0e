#!/usr/bin/env python
"""jaxmirror's own host work per call of a TF-style step, against the number of variables.

A step that reaches L variables by closure (TF's style) does, on every call, besides its one
``jax.jit`` call: read the variables' current values, store the step's new values open (kept
until the step is known to have succeeded, so that a failed step changes nothing), and later
close the step. This script times exactly that bookkeeping, without the jitted call, whose own
cost (one buffer per leaf, in C++) is the same as a hand-written ``jax.jit``'s and varies by
hundreds of µs at 1000 leaves, more than what is measured here (``leaf_overhead.py`` times the
whole call).

Per call, under ``state.lock`` as a step does: ``state.poll()`` (closes the previous call's
step, finished), ``state.check``, the values the step would take, and the step's writes stored
open: ``CommitRecord.current`` and ``state.write_record`` (this checkout), or
``tuple(map(state_of, variables))`` and ``state.write_open`` (checkouts before the record,
e.g. 3ab3eb4: the script uses whichever the imported jaxmirror has). The writes are real
arrays, already computed; calls alternate between two sets of them. Best of 30 rounds of 20
calls.

The goal (issue 30): the per-call host cost with 1000 variables within 20 µs of 10 variables.

Run from the repository root (~10 s):
    .venv/bin/python benchmarks/variable_bookkeeping.py
    PYTHONPATH=/tmp/before .venv/bin/python benchmarks/variable_bookkeeping.py   # an older one
"""

from __future__ import annotations

import os

from _platform import simulated_cpu_devices  # noqa: E402  (before JAX; CPU unless JAX_PLATFORMS)

_FLAG = simulated_cpu_devices(8)

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxmirror  # noqa: E402
from jaxmirror.variables import state  # noqa: E402
from _timing import devices_line, too_few_devices  # noqa: E402  (shared)

GOAL_US = 20.0


def bookkeeping(variables, writes):
    """One call's bookkeeping, as this checkout's (or an older one's) step does it."""
    if hasattr(state, "CommitRecord"):
        record = state.CommitRecord(tuple(v.variable_state for v in variables))

        def one(k):
            with state.lock:
                state.poll()
                state.check(record.held)
                record.current()
                state.write_record(record, writes[k], True)
    else:
        def one(k):
            with state.lock:
                state.poll()
                state.check(variables)
                tuple(map(state.state_of, variables))
                state.write_open(variables, writes[k], True)
    return one


def per_call_us(count: int, devices: int, rounds: int) -> float:
    strategy = jaxmirror.MirroredStrategy(jax.devices()[:devices])
    with strategy.scope():
        variables = tuple(jaxmirror.Variable(np.ones(8, np.float32)) for _ in range(count))
    arrays = jax.block_until_ready([jnp.ones(8) + k for k in range(2)])
    writes = [{i: arrays[k] for i in range(count)} for k in range(2)]
    one = bookkeeping(variables, writes)
    for k in range(4):
        one(k % 2)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for k in range(20):
            one(k % 2)
        best = min(best, (time.perf_counter() - start) / 20)
    state.settle_all()
    assert float(variables[-1].numpy()[0]) in (1.0, 2.0)  # the last writes, committed
    return best * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", default="10,100,1000", help="variable counts, comma-separated")
    ap.add_argument("--devices", type=int, default=2,
                    help="replicas (simulated CPU devices; GPUs with JAX_PLATFORMS=cuda)")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    problem = too_few_devices(args.devices, _FLAG)
    if problem:
        raise SystemExit(problem)
    print(f"# jaxmirror {os.path.dirname(jaxmirror.__file__)}, jax {jax.__version__}, "
          f"N = {args.devices} of {devices_line()}")
    print("| variables | µs per call |\n|---|---|")
    times = {}
    for count in counts:
        times[count] = per_call_us(count, args.devices, args.rounds)
        print(f"| {count} | {times[count]:.1f} |", flush=True)
    if len(counts) > 1:
        delta = times[counts[-1]] - times[counts[0]]
        verdict = "met" if delta <= GOAL_US else "NOT met"
        print(f"\n{counts[-1]} minus {counts[0]} variables: {delta:.1f} µs per call "
              f"(goal <= {GOAL_US:.0f} µs: {verdict})")


if __name__ == "__main__":
    main()
