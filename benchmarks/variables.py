#!/usr/bin/env python
"""Per-step cost of a train step that keeps its params in jaxmirror Variables, against pytrees.

The same MLP SGD step (a params dict, softmax cross-entropy averaged over the replica's batch,
gradients and loss all-reduced with MEAN, ``p - lr * g``) runs four ways on a
``MirroredStrategy`` over N simulated CPU devices (N = 1, 2, 8 by default):

  (a) pytree: ``step = strategy.function(fn)``; ``params, loss = step(params, x, y)``, the
      params a dict of arrays placed once with ``strategy.extended.replicated_sharding``;
  (b) variables by closure (TF style): the params are a dict of ``jaxmirror.Variable`` made in
      ``strategy.scope()``; the step captures them, reads them with ``jaxmirror.read_values``,
      assigns the new values with ``jaxmirror.assign_values`` (``--assign sub``: one
      ``v.assign_sub(lr * g)`` each) and returns the loss: ``loss = step(x, y)``;
  (c) variables as arguments: the same step taking the dict of variables,
      ``loss = step(params_vars, x, y)``;
  (d) baseline: the same step hand-written as ``jax.jit(jax.shard_map(body, mesh=Mesh(devices,
      ("replica",)), ..., check_vma=False))`` with ``jax.lax.pmean``, fed the same placed
      arrays (the ``PerReplica``'s global array).

The batches are the ``PerReplica`` values of ``strategy.experimental_distribute_dataset``,
placed once before timing. Every variant starts from the same params and sees the same batches
in the same order. After the warm-up, before anything is timed, and again after timing, the script
asserts that all variants hold the same params (and says whether bit for bit), and that no
jaxmirror step traced or compiled again during timing.

Fairness: with N >= 2 CPU devices jaxmirror's steps keep at most ``_inflight.MAX_IN_FLIGHT`` (8)
steps in flight; the baseline loop then keeps the same queue by hand. With N = 1 nobody does.

Measured, per model size and N, with the variants rotated in rounds to cancel drift (a, b, c, d,
d', then b, c, d, d', a, ...; d' is a second copy of the baseline loop, an A/A control whose ratio
to d shows how much of a difference this machine's noise alone makes):
  * µs/step: K steps per round, ``block_until_ready`` at the end of the round; the median over
    rounds, and the median (and quartiles) over rounds of the ratios (b)/(a) and (c)/(a) (the goal:
    <= 1.05) and of each style / baseline, taken within each round. At least ``--rounds`` rounds,
    and more (whole rotations, up to 10x) while the case has taken less than ``--case-seconds``:
    the tiny steps get many more rounds for the same time;
  * dispatch (host overhead) per call: the time to return from MAX_IN_FLIGHT calls started on an
    idle machine, without waiting, divided by their number; the median over rounds.
With ``--breakdown`` (on by default) it splits the per-call host time of the tiny step into the
pieces of ``Program.__call__`` (single calls from idle, and warm timeit loops of the
pieces). With ``--ablation`` (on by default) it times steady-state tiny-step loops of each style
next to ``Program.jitted`` called directly (the variables' jitted call gets a key built once and
its loop applies the writes): the gap between a step and its ``jitted``-only loop is jaxmirror's
Python around the call, measured in the loop (jaxmirror is not patched).

Run from the repository root:
    .venv/bin/python benchmarks/variables.py                       # N = 1, 2, 8; ~2 min
    .venv/bin/python benchmarks/variables.py --quick               # a sanity run, ~25 s, noisy
    .venv/bin/python benchmarks/variables.py --devices 1,2,4,8 --no-ablation
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
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxmirror  # noqa: E402
from jaxmirror.core import _compat, inflight as _inflight  # noqa: E402  (the bound; --breakdown's pieces)
from jaxmirror.step.arguments import take_variables  # noqa: E402  (timed by --breakdown)
from jaxmirror.step.program import check_can_run  # noqa: E402  (timed by --breakdown)
from jaxmirror.variables.state import state_of, write_back  # noqa: E402  (the same)
from _timing import dispatch, init_params, mlp, steps_and_cases  # noqa: E402  (shared)
from _timing import check_close, devices_line, more_rounds, platform_of  # noqa: E402
from _timing import one_call as _one_call, per_call as _per_call  # noqa: E402
from _timing import shuffled_rounds as _shuffled_rounds, timed as _timed, us as _us  # noqa: E402

MAX_IN_FLIGHT = _inflight.MAX_IN_FLIGHT
NUM_BATCHES = 4  # distinct placed batches, cycled through
LR = 0.1

# name -> (global batch, layer sizes, default steps per round)
MODELS = {
    "tiny": (16, (8, 16, 4), 100),  # a few hundred flops: host overhead dominates
    "small": (256, (784, 512, 10), 8),  # an MNIST-sized MLP step
}

PYTREE, CLOSURE, ARGS, BASE, BASE2 = "(a) pytree", "(b) vars closure", "(c) vars args", \
    "baseline", "baseline'"


# ----------------------------------------------------------------------------------------------
# The model and the four steps
# ----------------------------------------------------------------------------------------------


def loss_fn(params, x, y):
    """The replica's mean loss; the MEAN all-reduce of its gradient is the global batch's."""
    return optax.softmax_cross_entropy_with_integer_labels(mlp(params, x), y).mean()


def sgd(params, grads):
    return jax.tree.map(lambda p, g: p - LR * g, params, grads)


def _grads_and_loss(params, x, y):
    """Gradients and loss of the replica's batch, both all-reduced with MEAN by jaxmirror."""
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    ctx = jaxmirror.get_replica_context()
    return ctx.all_reduce("mean", grads), ctx.all_reduce("mean", loss)


def make_pytree_step(strategy):
    """(a): params in, new params out."""

    def pytree_step(params, x, y):
        grads, loss = _grads_and_loss(params, x, y)
        return sgd(params, grads), loss

    return strategy.function(pytree_step)


def _assign(variables, grads, values, assign: str):
    if assign == "values":
        jaxmirror.assign_values(variables, sgd(values, grads))
    else:  # "sub"
        for name, v in variables.items():
            v.assign_sub(LR * grads[name])


def make_closure_step(strategy, variables, assign: str):
    """(b): the variables captured by closure; returns the loss."""

    def closure_step(x, y):
        values = jaxmirror.read_values(variables)
        grads, loss = _grads_and_loss(values, x, y)
        _assign(variables, grads, values, assign)
        return loss

    return strategy.function(closure_step)


def make_args_step(strategy, assign: str):
    """(c): the variables passed as the first argument; returns the loss."""

    def args_step(variables, x, y):
        values = jaxmirror.read_values(variables)
        grads, loss = _grads_and_loss(values, x, y)
        _assign(variables, grads, values, assign)
        return loss

    return strategy.function(args_step)


def make_baseline_step(mesh):
    def body(params, x, y):
        x, y = x.reshape(x.shape[1:]), y.reshape(y.shape[1:])  # this replica's (1, b, ...) block
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grads = jax.lax.pmean(grads, "replica")
        return sgd(params, grads), jax.lax.pmean(loss, "replica")

    return jax.jit(jax.shard_map(
        body, mesh=mesh,
        in_specs=(P(), P("replica"), P("replica")),
        out_specs=(P(), P()),
        check_vma=False,
    ))


# ----------------------------------------------------------------------------------------------
# One (model, N) case: the variants, their state and their loops
# ----------------------------------------------------------------------------------------------
class Loop:
    """One variant's training loop.

    ``call(state, x, y)`` makes one step and returns ``(state, loss)``; the state is the params
    pytree for (a) and the baseline, ``None`` for the variables styles (the variables hold it).
    ``bound`` says whether the loop keeps an in-flight queue itself (the baseline, where
    jaxmirror's steps keep theirs); ``params()`` returns the params as NumPy arrays.
    """

    def __init__(self, name, call, batches, state, bound: bool, params):
        self.name, self.call, self.batches, self.bound = name, call, batches, bound
        self.state, self.params = state, params
        self.i = 0  # batch counter: every variant sees the same sequence of batches
        self.queue: collections.deque = collections.deque()

    def __call__(self, k: int):
        """Run k steps, return the last loss (not waited for)."""
        call, batches, queue, bound = self.call, self.batches, self.queue, self.bound
        state, i = self.state, self.i
        loss = None
        for _ in range(k):
            x, y = batches[i % NUM_BATCHES]
            state, loss = call(state, x, y)
            if bound:  # what jaxmirror does here: wait for the oldest past MAX_IN_FLIGHT
                queue.append(loss)
                if len(queue) > MAX_IN_FLIGHT:
                    queue.popleft().block_until_ready()
            i += 1
        self.state, self.i = state, i
        return loss


def _np(tree):
    return {k: np.asarray(v) for k, v in tree.items()}


class Case:
    """A model size on N replicas: the three styles, the baseline and its A/A copy."""

    def __init__(self, model: str, n: int, assign: str, seed: int = 0):
        global_batch, sizes, _ = MODELS[model]
        self.model, self.n = model, n
        devices = self.devices = jax.devices()[:n]
        self.strategy = strategy = jaxmirror.MirroredStrategy(devices)
        self.mesh = Mesh(np.array(devices), ("replica",))

        rng = np.random.default_rng(seed)
        host = [(rng.standard_normal((global_batch, sizes[0])).astype(np.float32),
                 rng.integers(0, sizes[-1], global_batch).astype(np.int32))
                for _ in range(NUM_BATCHES)]
        # Placed once, before timing: PerReplica values for jaxmirror, their arrays for the
        # baseline.
        self.jm_batches = list(strategy.experimental_distribute_dataset(host))
        if n > 1:
            self.base_batches = [(x.stacked, y.stacked) for x, y in self.jm_batches]
        else:  # one replica: jaxmirror takes plain arrays; give the baseline its (1, b, ...) block
            stacked = NamedSharding(self.mesh, P("replica"))
            self.base_batches = [jax.device_put((x[None], y[None]), stacked)
                                 for x, y in self.jm_batches]

        params = init_params(jax.random.key(seed), sizes)
        replicated = strategy.extended.replicated_sharding
        with strategy.scope():  # two independent sets of variables, one per variables style
            self.vars_b = {k: jaxmirror.Variable(v, name=k) for k, v in params.items()}
            self.vars_c = {k: jaxmirror.Variable(v, name=k) for k, v in params.items()}
        self.pytree_step = make_pytree_step(strategy)
        self.closure_step = make_closure_step(strategy, self.vars_b, assign)
        self.args_step = make_args_step(strategy, assign)
        self.base_step = make_baseline_step(self.mesh)
        self.bounded = strategy.extended.placement.bound_in_flight  # jaxmirror's own queue is on
        self.programs = {PYTREE: self.pytree_step, CLOSURE: self.closure_step,
                         ARGS: self.args_step}

        closure_step, args_step, vars_c = self.closure_step, self.args_step, self.vars_c
        jm = dict(bound=False)
        self.a = Loop(PYTREE, self.pytree_step, self.jm_batches,
                      jax.device_put(params, replicated), params=lambda: _np(self.a.state), **jm)
        self.b = Loop(CLOSURE, lambda _, x, y: (None, closure_step(x, y)), self.jm_batches, None,
                      params=lambda: _np(jaxmirror.read_values(self.vars_b)), **jm)
        self.c = Loop(ARGS, lambda _, x, y: (None, args_step(vars_c, x, y)), self.jm_batches,
                      None, params=lambda: _np(jaxmirror.read_values(self.vars_c)), **jm)
        base = dict(bound=self.bounded)
        self.d = Loop(BASE, self.base_step, self.base_batches,
                      jax.device_put(params, replicated), params=lambda: _np(self.d.state), **base)
        self.d2 = Loop(BASE2, self.base_step, self.base_batches,
                       jax.device_put(params, replicated), params=lambda: _np(self.d2.state),
                       **base)
        self.loops = (self.a, self.b, self.c, self.d, self.d2)

    def sync(self):
        jax.block_until_ready([self.a.state, self.d.state, self.d2.state,
                               jaxmirror.read_values((self.vars_b, self.vars_c))])
        _inflight.drain()

    def counts(self) -> dict:
        """(trace_count, compile_count) of each jaxmirror step."""
        return {name: (p.trace_count, p.compile_count) for name, p in self.programs.items()}

    def check_counts(self, where: str) -> None:
        """Assert no step traced or compiled again since the warm-up (``self.warm_counts``)."""
        assert self.counts() == self.warm_counts, (
            f"{self.model} N={self.n} {where}: a step traced or compiled again: "
            f"{self.warm_counts} -> {self.counts()}")

    def check_agree(self, where: str, gpu_rtol: float = 1e-5) -> tuple[float, bool]:
        """Assert every variant's params agree with the baseline's (bit for bit on CPU; on a GPU
        within ``gpu_rtol``, atol ``gpu_rtol / 10``: a few steps from the same params, two
        programs' float32 rounding); (max |diff|, bitwise)."""
        self.sync()
        worst, exact = 0.0, True
        ref = self.d.params()
        for loop in (self.a, self.b, self.c, self.d2):
            assert loop.i == self.d.i, (loop.name, loop.i, self.d.i)
            got = loop.params()
            self.checked = check_close(
                f"{self.model} N={self.n} {where}: {loop.name}'s params vs the baseline's",
                {k: got[k] for k in ref}, ref, gpu_rtol=gpu_rtol, gpu_atol=gpu_rtol / 10,
                platform=platform_of(self.devices))
            for name in sorted(ref):
                worst = max(worst, float(np.max(np.abs(got[name] - ref[name]))))
                exact &= bool(np.array_equal(got[name], ref[name]))
        # The variables stay one replicated array each (all-reduced gradients: Mirrored).
        for v in (*self.vars_b.values(), *self.vars_c.values()):
            assert isinstance(state_of(v), jax.Array), (v.name, type(state_of(v)))
        return worst, exact


# ----------------------------------------------------------------------------------------------
# Timing helpers (as in step_overhead.py)
# ----------------------------------------------------------------------------------------------


def _median_ratio(num, den):
    ratios = [a / b for a, b in zip(num, den)]
    return statistics.median(ratios), np.percentile(ratios, 25), np.percentile(ratios, 75)


def bench_case(case: Case, args, steps: int) -> dict:
    # Warm-up: compile, run a few steps each, then check that they computed the same thing.
    for loop in case.loops:
        loop(args.warmup)
    diff, exact = case.check_agree("after warm-up")
    case.warm_counts = case.counts()

    t = {loop.name: [] for loop in case.loops}
    d = {loop.name: [] for loop in case.loops}
    loops = case.loops
    gc.collect()
    gc.disable()
    t0, r = time.perf_counter(), 0
    try:
        # Rotated each round, so no variant always goes first; whole rotations only.
        while r % 5 or more_rounds(r, args.rounds, args.case_seconds, t0):
            for loop in loops[r % 5:] + loops[:r % 5]:
                t[loop.name].append(_timed(loop, steps))
            r += 1
        for j in range(args.dispatch_rounds):
            for loop in loops[j % 5:] + loops[:j % 5]:
                d[loop.name].append(dispatch(case.sync, loop, MAX_IN_FLIGHT))
    finally:
        gc.enable()
    # GPU: the timed rounds are hundreds of SGD steps of two programs; SGD damps their
    # rounding differences, which stay below rtol 1e-4 (as in tf_loop.py, which held on an H200).
    diff_end, exact_end = case.check_agree("after timing", gpu_rtol=1e-4)
    case.check_counts("after timing")

    med = statistics.median
    return dict(
        model=case.model, n=case.n, counts=case.warm_counts, rounds=len(t[PYTREE]),
        ms={name: med(v) for name, v in t.items()},
        b_a=_median_ratio(t[CLOSURE], t[PYTREE]), c_a=_median_ratio(t[ARGS], t[PYTREE]),
        a_d=_median_ratio(t[PYTREE], t[BASE]), b_d=_median_ratio(t[CLOSURE], t[BASE]),
        c_d=_median_ratio(t[ARGS], t[BASE]), control=_median_ratio(t[BASE2], t[BASE]),
        us={name: med(v) for name, v in d.items()},
        d_b_a=med([a - b for a, b in zip(d[CLOSURE], d[PYTREE])]),
        d_c_a=med([a - b for a, b in zip(d[ARGS], d[PYTREE])]),
        d_control=med([a - b for a, b in zip(d[BASE2], d[BASE])]),
        diff=max(diff, diff_end), exact=exact and exact_end,
    )


# ----------------------------------------------------------------------------------------------
# --breakdown: where the variables styles' per-call host time goes
# ----------------------------------------------------------------------------------------------
def _apply(writes, variables):
    """Program.__call__'s write-back: ``writes`` maps a bound variable's index to its new array."""
    write_back(variables, writes)


def _jit_args(prog, args):
    """What ``Program`` hands ``Program.jitted`` for these step arguments.

    ``(key, captured states, args)``: ``key`` is the static binding of
    ``step.compiled.trace_replica``, ``(positions, variables, captured)``, and in ``args`` every
    variable is replaced by its array (``arguments.take_variables``, which the breakdown also times
    as the cost of finding variables among the arguments). A ``jitted`` call with a key that
    differs from the step's would build a second program: ``check_counts`` would fail.
    """
    key, args, _ = take_variables(args, {}, prog.captured)
    return prog.binding_of(key), tuple(map(state_of, prog.captured)), args


def breakdown(case: Case, samples: int) -> list[tuple[str, float | None]]:
    """Per-call host costs of each style's call and of the pieces of ``Program.__call__``.

    End-to-end rows: one call at a time from an idle machine (inputs ready, queue drained),
    the forms interleaved in random order, ``samples`` calls each; the median seconds to return.
    Every form carries its state from call to call, so every call frees the previous arrays
    inside the timed region: a pytree form by rebinding its params, a variables step in its
    write-back. Piece rows: timeit-style loops (median of 7), warm caches, so smaller than in situ.
    """
    case.sync()
    pa, pb, pc, base = (case.pytree_step.program, case.closure_step.program,
                        case.args_step.program, case.base_step)
    vars_c, captured = case.vars_c, pb.captured
    x, y = case.jm_batches[0]
    bx, by = case.base_batches[0]
    key_b, _, _ = _jit_args(pb, (x, y))
    held = {"base": case.d.state, "a": case.a.state, "a_jitted": case.a.state}

    def baseline_call():
        held["base"], loss = base(held["base"], bx, by)
        return loss

    def pytree_call():
        held["a"], loss = case.pytree_step(held["a"], x, y)
        return loss

    def pytree_jitted():
        (held["a_jitted"], loss), _, _, _ = pa.jitted(None, (), held["a_jitted"], x, y)
        return loss

    def closure_jitted():
        loss, _, writes, _ = pb.jitted(key_b, tuple(map(state_of, captured)), x, y)
        _apply(writes, captured)
        return loss

    forms = {
        "baseline: jitted shard_map call": baseline_call,
        "(a) pytree: step(params, x, y)": pytree_call,
        "(a) pytree: Program.jitted only": pytree_jitted,
        "(b) vars closure: step(x, y)": lambda: case.closure_step(x, y),
        "(b) vars closure: Program.jitted only (key built once), then the write-back":
            closure_jitted,
        "(c) vars args: step(vars, x, y)": lambda: case.args_step(vars_c, x, y),
    }
    times = _shuffled_rounds({k: functools.partial(_one_call, f) for k, f in forms.items()},
                             samples)
    rows = [(k, statistics.median(v)) for k, v in times.items()]
    case.sync()
    writes = pb.jitted(key_b, tuple(map(state_of, captured)), x, y)[2]
    jax.block_until_ready(writes)
    _apply(writes, captured)  # the variables now hold these arrays: the piece rewrites the same
    pieces = {
        "  piece: check_can_run(strategy)": lambda: check_can_run(case.strategy),
        "  piece: _compat.trace_state_clean()": _compat.trace_state_clean,
        "  piece: (b) tuple(map(state_of, captured)), 4 variables":
            lambda: tuple(map(state_of, captured)),
        "  piece: (b) write back, 4 variables (no array freed)": lambda: _apply(writes, captured),
        "  piece: (c) find the variables among the arguments (flatten, swap, unflatten, key)":
            lambda: _jit_args(pc, ((vars_c, x, y), {})),
        "  piece: of which jax.tree.flatten(((vars, x, y), {}))":
            lambda: jax.tree.flatten(((vars_c, x, y), {})),
    }
    rows += [(k, _per_call(f, 2000, 7)) for k, f in pieces.items()]
    case.sync()
    case.check_counts("after the breakdown")  # the _jitted-only calls used the steps' programs
    return rows


# ----------------------------------------------------------------------------------------------
# --ablation: jaxmirror's Python around the jitted call vs the jitted call itself, in a loop
# ----------------------------------------------------------------------------------------------
def ablation(case: Case, rounds: int, steps: int,
             seconds: float) -> list[tuple[str, float, float, int]]:
    """Steady-state loops of each style and of ``Program.jitted`` called directly.

    The ``jitted``-only loops call jaxmirror's cached ``jax.jit`` with the arguments the step
    would pass (for the variables style a key built once; that loop then applies the writes to
    (b)'s variables, as the step does) and keep the baseline's queue where jaxmirror keeps one.
    Nothing in jaxmirror is patched. All loops run in random order each round. The variables are
    not compared afterwards: two loops advance (b)'s. Returns (name, median s/step, median ratio
    to the pytree step within a round, rounds).
    """
    case.sync()
    pa, pb, bounded = case.pytree_step.program, case.closure_step.program, case.bounded
    key_b, _, _ = _jit_args(pb, tuple(case.jm_batches[0]))
    captured = pb.captured

    def pytree_jitted(params, x, y):
        out, _, _, _ = pa.jitted(None, (), params, x, y)
        return out

    def closure_jitted(_, x, y):
        loss, _, writes, _ = pb.jitted(key_b, tuple(map(state_of, captured)), x, y)
        _apply(writes, captured)
        return None, loss

    loops = [case.a, case.b, case.c,
             Loop("(a) Program.jitted only", pytree_jitted, case.jm_batches, case.a.state,
                  bound=bounded, params=None),
             Loop("(b) Program.jitted only (key built once), then the write-back",
                  closure_jitted, case.jm_batches, None, bound=bounded, params=None)]
    for loop in loops[3:]:
        loop.i = case.a.i
        loop(2)
    case.sync()
    times = _shuffled_rounds({loop.name: functools.partial(_timed, loop, steps) for loop in loops},
                             rounds, seconds)
    case.sync()
    case.check_counts("after the ablation")  # the _jitted-only loops used the steps' programs
    ref = times[PYTREE]
    return [(loop.name, statistics.median(times[loop.name]),
             statistics.median([a / b for a, b in zip(times[loop.name], ref)]), len(ref))
            for loop in loops]


# ----------------------------------------------------------------------------------------------


def _ratio(r) -> str:
    return f"{r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}]"


def _tiny_case(cases: dict, n: int, args) -> Case:
    """The tiny-model case on n replicas: the one timed already, or a new one, warmed up."""
    case = cases.get(("tiny", n))
    if case is None:
        case = cases["tiny", n] = Case("tiny", n, args.assign)
        for loop in case.loops:
            loop(args.warmup)
        case.check_agree("after warm-up")
        case.warm_counts = case.counts()
    return case


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="1,2,8", help="replica counts, comma-separated")
    ap.add_argument("--models", default="tiny,small", help=f"from {sorted(MODELS)}")
    ap.add_argument("--assign", choices=("values", "sub"), default="values",
                    help="how the variables styles write: jaxmirror.assign_values(params, new) "
                         "or v.assign_sub(lr * g) per variable")
    ap.add_argument("--rounds", type=int, default=20,
                    help="timed rounds per variant, at least (the main table rounds it up to whole "
                         "rotations of the 5 variants)")
    ap.add_argument("--case-seconds", type=float, default=4.0,
                    help="after --rounds, go on with more rounds (up to 10x) until a case's timed "
                         "rounds took this long (helps the short tiny steps)")
    ap.add_argument("--steps-tiny", type=int, default=None, help="steps per round, tiny model")
    ap.add_argument("--steps-small", type=int, default=None, help="steps per round, small model")
    ap.add_argument("--dispatch-rounds", type=int, default=20,
                    help=f"rounds of {MAX_IN_FLIGHT} un-awaited calls per variant")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before timing")
    ap.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=True,
                    help="also split the per-call host time into its pieces (tiny model)")
    ap.add_argument("--breakdown-samples", type=int, default=300,
                    help="calls per form for the --breakdown table")
    ap.add_argument("--ablation", action=argparse.BooleanOptionalAction, default=True,
                    help="also time steady-state loops of Program.jitted called directly, next "
                         "to the three styles (tiny model)")
    ap.add_argument("--quick", action="store_true", help="a fast sanity run (numbers are noisy)")
    args = ap.parse_args(argv)

    if args.quick:
        args.rounds, args.dispatch_rounds, args.warmup, args.breakdown_samples = 5, 5, 2, 30
        args.case_seconds = 0.0
    checked = steps_and_cases(ap, args, MODELS, _FLAG)
    if checked is None:
        return 2
    steps, ns, models = checked

    t_start = time.perf_counter()
    print(f"# jaxmirror variables vs pytree step: {devices_line()}, "
          f"{os.cpu_count()} host cores, jax {jax.__version__}, "
          f"Python {platform.python_version()}")
    print(f"# command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    print(f"# jaxmirror from {os.path.dirname(jaxmirror.__file__)}")
    print(f"# rounds >= {args.rounds} (5 variants rotated; more, up to 10x, while a case has "
          f"taken < {args.case_seconds:g} s), steps/round={steps}, dispatch: "
          f"{args.dispatch_rounds} rounds x {MAX_IN_FLIGHT} calls, warmup={args.warmup}, "
          f"assign={args.assign}")
    print(f"# with N >= 2 every loop keeps at most {MAX_IN_FLIGHT} steps in flight (jaxmirror's "
          f"CPU bound; the baseline keeps the same queue by hand); with N = 1 none does")
    for m in models:
        g, sizes, _ = MODELS[m]
        print(f"# {m}: global batch {g}, MLP {' -> '.join(map(str, sizes))}, SGD lr {LR}")
    print()

    results, cases = [], {}
    for m in models:
        for n in ns:
            t0 = time.perf_counter()
            case = Case(m, n, args.assign)
            r = bench_case(case, args, steps[m])
            results.append(r)
            cases[(m, n)] = case
            print(f"  done {m} N={n} in {time.perf_counter() - t0:.1f}s: (b)/(a) "
                  f"{r['b_a'][0]:.3f}, (c)/(a) {r['c_a'][0]:.3f}", file=sys.stderr, flush=True)

    print("µs/step (median over rounds) and ratios within a round (median [IQR]):")
    print()
    print("| model | N | rounds | (a) pytree | (b) vars closure | (c) vars args | baseline "
          "| (b)/(a) | (c)/(a) | (a)/base | (b)/base | (c)/base | A/A base'/base "
          "| params agree |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        agree = "bitwise" if r["exact"] else f"max abs diff {r['diff']:.1e}"
        ms = r["ms"]
        print(f"| {r['model']} | {r['n']} | {r['rounds']} | {_us(ms[PYTREE])} "
              f"| {_us(ms[CLOSURE])} | {_us(ms[ARGS])} | {_us(ms[BASE])} "
              f"| {_ratio(r['b_a'])} | {_ratio(r['c_a'])} "
              f"| {r['a_d'][0]:.3f} | {r['b_d'][0]:.3f} | {r['c_d'][0]:.3f} "
              f"| {r['control'][0]:.3f} | {agree} |")
    print()
    for m in models:
        for key, label in (("b_a", "(b)/(a)"), ("c_a", "(c)/(a)")):
            worst = max((r for r in results if r["model"] == m), key=lambda r: r[key][0])
            verdict = "met" if worst[key][0] <= 1.05 else "NOT met"
            print(f"{m}: worst median {label} {worst[key][0]:.3f} (N={worst['n']}); "
                  f"goal <= 1.05 {verdict}.")
    print()
    print(f"Dispatch: µs per call to return from {MAX_IN_FLIGHT} calls started on an idle "
          f"machine (median over rounds); Δ are medians of within-round differences:")
    print()
    print("| model | N | (a) pytree | (b) vars closure | (c) vars args | baseline "
          "| Δ (b)-(a) | Δ (c)-(a) | Δ A/A base'-base | trace, compile counts (a), (b), (c) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        us, c = r["us"], r["counts"]
        print(f"| {r['model']} | {r['n']} | {_us(us[PYTREE])} | {_us(us[CLOSURE])} "
              f"| {_us(us[ARGS])} | {_us(us[BASE])} | {_us(r['d_b_a'])} | {_us(r['d_c_a'])} "
              f"| {_us(r['d_control'])} "
              f"| {', '.join(f'{t}/{k}' for t, k in (c[PYTREE], c[CLOSURE], c[ARGS]))} |")

    bns = sorted(set(ns))
    if args.breakdown:
        print()
        print(f"Per-call host time of the tiny step, µs: end-to-end rows are the median time to "
              f"return from one call made on an idle machine ({args.breakdown_samples} calls per "
              f"form, forms interleaved at random); 'piece' rows are timeit loops (warm caches).")
        print()
        print("| form / piece | " + " | ".join(f"N={n}" for n in bns) + " |")
        print("|---|" + "---|" * len(bns))
        table = {n: breakdown(_tiny_case(cases, n, args), args.breakdown_samples) for n in bns}
        for i, (name, _) in enumerate(table[bns[0]]):
            print(f"| {name} | " + " | ".join(_us(table[n][i][1]) for n in bns) + " |")

    if args.ablation:
        print()
        print(f"Ablation, tiny model: steady-state loops ({steps['tiny']} steps a round, "
              f"loops in random order each round); µs/step, and in brackets the median ratio to "
              f"(a) pytree within a round.")
        print()
        print("| loop | " + " | ".join(f"N={n}" for n in bns) + " |")
        print("|---|" + "---|" * len(bns))
        table = {}
        for n in bns:
            table[n] = ablation(_tiny_case(cases, n, args), args.rounds, steps["tiny"],
                                args.case_seconds)
            print(f"  ablation N={n} done", file=sys.stderr, flush=True)
        print("| rounds | " + " | ".join(str(table[n][0][3]) for n in bns) + " |")
        for i, (name, _, _, _) in enumerate(table[bns[0]]):
            cells = [f"{table[n][i][1] * 1e6:.1f} ({table[n][i][2]:.3f})" for n in bns]
            print(f"| {name} | " + " | ".join(cells) + " |")
    print()
    print(f"# total {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
