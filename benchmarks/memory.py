#!/usr/bin/env python
"""Device memory of params and optimizer state under MirroredStrategy: one copy per device?

An MLP's params (784 -> 512 -> 10 by default, ``--sizes``) and its ``optax.adam`` state are
kept on a ``MirroredStrategy`` over the first N of 8 simulated CPU devices (N = 1, 2, 4, 8 by
default) in three styles, and after each phase the script counts the bytes of every live
array's buffers on each device. Expected: exactly one copy of params + optimizer state on each
of the N devices (``size`` bytes each, ``N * size`` in all), nothing on the others.

  * init: ``strategy.init(lambda: (params, adam.init(params)))``;
  * pytree, donated: ``params, opt_state, loss = step(params, opt_state, x, y)`` with
    ``strategy.function(fn, donate_argnums=(0, 1))``, ``--steps`` steps;
  * pytree, not donated: the same step without ``donate_argnums``;
  * variables: params and adam state as ``jaxmirror.Variable``s made in ``strategy.scope()``,
    captured by the step (read with ``jaxmirror.read_values``, written with
    ``jaxmirror.assign_values``), ``loss = step(x, y)``; counted twice: right after
    ``jax.block_until_ready(loss)`` and ``gc.collect()`` (what a user sees between steps) and
    after an eager read of every variable (which closes the steps still open on them); then
    ``--steps`` more steps in TF's tutorial loop (each step's loss reduced and read as a
    float, so every step has finished before the next starts), counted after the last.

How bytes are counted: CPU devices have no ``memory_stats()`` (the script prints what it
returns), so it sums ``jax.live_arrays()``: for each array, each addressable shard's buffer,
deduplicated by (device, ``unsafe_buffer_pointer()``) because a shard read as its own array
shares its parent's buffer. Only buffers that appear after a snapshot taken before the phase's
arrays exist count (the snapshot's arrays are kept alive, so their addresses are not reused).
The batch is placed before the snapshot (not counted); what else the phase holds besides
params and optimizer state is subtracted explicitly: the last loss (a replicated float32
scalar, 4 bytes per device).
jaxmirror's in-flight queue (at most 8 handles, each a step's smallest output) is drained
before counting (``jaxmirror.core.inflight.drain``), as ``tests/test_central_storage.py`` does;
``--no-drain`` counts without it.

Donation check (pytree, donated): after each step, whether every leaf of the previous params
and optimizer state ``is_deleted()``, and the per-device live bytes after each of the steps
(not drained): they must not grow.

Run from the repository root:
    .venv/bin/python benchmarks/memory.py                 # N = 1, 2, 4, 8; ~15 s
    .venv/bin/python benchmarks/memory.py --append        # also append to RESULTS.md
"""

from __future__ import annotations

import os

from _platform import simulated_cpu_devices  # noqa: E402  (before JAX; CPU unless JAX_PLATFORMS)

_FLAG = simulated_cpu_devices(8)

import argparse  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import io  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxmirror  # noqa: E402
from jaxmirror.core import inflight as _inflight  # noqa: E402  (drained before counting)
from _timing import append_section, checkout, machine, mlp, too_few_devices  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "RESULTS.md"
TX = optax.adam(1e-3)
GLOBAL_BATCH = 64


# ----------------------------------------------------------------------------------------------
# Counting bytes
# ----------------------------------------------------------------------------------------------
def buffers() -> dict:
    """``{(device id, buffer address): bytes}`` of every live array's addressable shards."""
    out = {}
    for x in jax.live_arrays():
        if x.is_deleted():
            continue
        for shard in x.addressable_shards:
            data = shard.data
            out[shard.device.id, data.unsafe_buffer_pointer()] = data.nbytes
    return out


class Snapshot:
    """The live buffers now, kept alive; ``new()`` counts the buffers that appeared since."""

    def __init__(self):
        gc.collect()
        self._keep = jax.live_arrays()  # alive, so no new buffer takes one of their addresses
        self._keys = set(buffers())

    def new(self, drain: bool = True) -> list[int]:
        """Bytes per device (ids 0..7) of the buffers that appeared since the snapshot."""
        if drain:
            _inflight.drain()
        gc.collect()
        per = [0] * jax.device_count()
        for (dev, ptr), nbytes in buffers().items():
            if (dev, ptr) not in self._keys:
                per[dev] += nbytes
        return per


def tree_bytes(tree) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


# ----------------------------------------------------------------------------------------------
# The model and the styles
# ----------------------------------------------------------------------------------------------
def host_params(sizes, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"w{i}"] = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        params[f"b{i}"] = np.zeros((b,), np.float32)
    return params


def host_batch(sizes, seed: int = 1):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((GLOBAL_BATCH, sizes[0])).astype(np.float32),
            rng.integers(0, sizes[-1], GLOBAL_BATCH).astype(np.int32))


def train_update(params, opt_state, x, y):
    """One replica's adam step on its rows, gradients all-reduced; the loss all-reduced."""
    def loss_fn(p):
        per_example = optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y)
        return jaxmirror.compute_average_loss(per_example)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    ctx = jaxmirror.get_replica_context()
    grads = ctx.all_reduce("SUM", grads)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, ctx.all_reduce("SUM", loss)


def placed_batch(strategy, sizes):
    """One global batch split over the replicas (placed before a snapshot: not counted)."""
    return next(iter(strategy.experimental_distribute_dataset([host_batch(sizes)])))


def phase_rows(n: int, sizes, steps: int, drain: bool):
    """Rows ``(phase, per-device bytes on the N devices, bytes elsewhere, extra accounted)``."""
    strategy = jaxmirror.MirroredStrategy(jax.devices()[:n])
    params0 = host_params(sizes)
    size = tree_bytes((params0, TX.init(params0)))
    rows, checks = [], {}
    loss_bytes = 4  # a replicated float32 scalar: 4 bytes on each device

    def row(name, per, extra):
        on = per[:n]
        rows.append((name, on, sum(per[n:]), extra))

    # init: strategy.init builds both, Mirrored
    snap = Snapshot()
    state = strategy.init(lambda: (lambda p: (p, TX.init(p)))(host_params(sizes)))
    row("init (strategy.init)", snap.new(drain), 0)
    del state

    # pytree styles
    for donate in (True, False):
        batch = placed_batch(strategy, sizes)
        step = strategy.function(train_update, donate_argnums=(0, 1) if donate else ())
        snap = Snapshot()
        params, opt_state = strategy.init(lambda: (lambda p: (p, TX.init(p)))(host_params(sizes)))
        history, deleted = [], []
        loss = None
        for _ in range(steps):
            old = jax.tree.leaves((params, opt_state))
            params, opt_state, loss = step(params, opt_state, *batch)
            jax.block_until_ready(loss)
            deleted.append(all(a.is_deleted() for a in old))
            del old
            history.append(snap.new(drain=False)[:n])
        per = snap.new(drain)
        row(f"pytree, {'donated' if donate else 'not donated'}: after {steps} steps", per,
            loss_bytes)
        if donate:
            checks = {"deleted": deleted, "history": history, "size": size,
                      "compiles": (step.trace_count, step.compile_count)}
        del params, opt_state, loss, batch, step

    # variables by closure
    batch = placed_batch(strategy, sizes)
    snap = Snapshot()
    with strategy.scope():
        pv = jax.tree.map(jaxmirror.Variable, host_params(sizes))
        ov = jax.tree.map(jaxmirror.Variable, TX.init(host_params(sizes)))

    def var_step(x, y):
        params, opt_state = jaxmirror.read_values((pv, ov))
        params, opt_state, loss = train_update(params, opt_state, x, y)
        jaxmirror.assign_values((pv, ov), (params, opt_state))
        return loss

    vstep = strategy.function(var_step)
    row("variables: created", snap.new(drain), 0)
    for _ in range(steps):
        loss = vstep(*batch)
    jax.block_until_ready(loss)
    row(f"variables: {steps} steps, block_until_ready(loss)", snap.new(drain), loss_bytes)
    for v in jax.tree.leaves((pv, ov)):
        v.read_value()  # an eager read settles the variable: open steps close
    row("variables: ... then each variable read", snap.new(drain), loss_bytes)
    for _ in range(steps):  # TF's tutorial loop: each step's loss read as a float
        loss = vstep(*batch)
        float(strategy.reduce("SUM", loss, axis=None))
    row(f"variables: {steps} more steps, each waited (float of the reduced loss)",
        snap.new(drain), loss_bytes)
    return size, rows, checks


# ----------------------------------------------------------------------------------------------
def kib(b: float) -> str:
    return f"{b / 1024:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="1,2,4,8", help="replica counts, comma-separated")
    ap.add_argument("--sizes", default="784,512,10", help="MLP layer sizes, comma-separated")
    ap.add_argument("--steps", type=int, default=10, help="steps per style")
    ap.add_argument("--drain", action=argparse.BooleanOptionalAction, default=True,
                    help="drain jaxmirror's in-flight queue before counting")
    ap.add_argument("--append", action="store_true",
                    help=f"also append the tables, dated, to {RESULTS.name}")
    ap.add_argument("--results", type=pathlib.Path, default=RESULTS,
                    help="the file --append appends to")
    args = ap.parse_args(argv)
    ns = [int(s) for s in args.devices.split(",")]
    sizes = tuple(int(s) for s in args.sizes.split(","))
    problem = too_few_devices(max(ns), _FLAG)
    if problem:
        print(problem, file=sys.stderr)
        return 2

    command = " ".join([os.path.basename(sys.executable)] + sys.argv)
    header = io.StringIO()
    h = functools.partial(print, file=header)
    h(f"# device memory of params + adam state: {machine()}")
    h(f"# command: {command}")
    h(f"# jaxmirror: {jaxmirror.__file__} ({checkout()})")
    h(f"# MLP {' -> '.join(map(str, sizes))}, adam; global batch {GLOBAL_BATCH}; {args.steps} "
      f"steps per style; in-flight queue {'drained' if args.drain else 'not drained'} before "
      f"counting")
    h(f"# jax.devices()[0].memory_stats() = {jax.devices()[0].memory_stats()!r} "
      f"(so bytes are summed over jax.live_arrays(), buffers deduplicated)")
    print(header.getvalue())

    t0 = time.perf_counter()
    out = io.StringIO()
    p = functools.partial(print, file=out)
    p("Bytes (KiB) of new live buffers per device after each phase, against one copy of "
      "params + adam state (`size`); 'extra' is what the phase holds besides them and is "
      "subtracted (the last loss, a replicated scalar). 'copies' = (bytes - extra) / size per "
      "device; 'elsewhere' = bytes on the devices outside the strategy.")
    p()
    p("| N | phase | size KiB | per device KiB (min–max) | copies per device | total / size "
      "| elsewhere KiB | one copy each? |")
    p("|---|---|---|---|---|---|---|---|")
    donation = []
    for n in ns:
        size, rows, checks = phase_rows(n, sizes, args.steps, args.drain)
        for name, on, elsewhere, extra in rows:
            copies = [(b - extra) / size for b in on]
            total = (sum(on) - extra * n) / size
            ok = all(b - extra == size for b in on) and elsewhere == 0
            p(f"| {n} | {name} | {kib(size)} | {kib(min(on))}–{kib(max(on))} "
              f"| {min(copies):.3f}–{max(copies):.3f} | {total:.3f} (want {n}) "
              f"| {kib(elsewhere)} | {'yes' if ok else 'NO'} |")
        donation.append((n, checks))
        print(f"  done N={n} ({time.perf_counter() - t0:.1f}s)", file=sys.stderr, flush=True)
    p()
    p(f"Donation (pytree, donate_argnums=(0, 1)): whether every old params and adam-state "
      f"array is_deleted() after each step; and the live bytes on device 0 after each step "
      f"(queue not drained) above those after the first step. jaxmirror's in-flight queue "
      f"(N >= 2) keeps each step's smallest output, the 4-byte loss, for up to "
      f"{_inflight.MAX_IN_FLIGHT} steps: growth up to {(_inflight.MAX_IN_FLIGHT - 1) * 4} B, "
      f"then flat, is that queue.")
    p()
    p("| N | old arrays deleted, per step | device 0: bytes above step 1, per step "
      "| grows beyond the queue? | trace, compile count |")
    p("|---|---|---|---|---|")
    for n, c in donation:
        dev0 = [h[0] - c["history"][0][0] for h in c["history"]]
        grows = max(dev0) > (_inflight.MAX_IN_FLIGHT - 1) * 4 or dev0[-1] != dev0[-2]
        p(f"| {n} | {''.join('y' if d else 'N' for d in c['deleted'])} "
          f"| {', '.join(map(str, dev0))} | {'YES' if grows else 'no'} | {c['compiles']} |")
    total = time.perf_counter() - t0
    print(out.getvalue())
    print(f"# total {total:.0f} s", file=sys.stderr)

    if args.append:
        append_section(args.results, "device memory of params and optimizer state", command, header.getvalue(),
                       out.getvalue(), total)
    return 0


if __name__ == "__main__":
    sys.exit(main())
