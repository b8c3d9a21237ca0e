#!/usr/bin/env python
"""Keras 3 on the JAX backend (``keras.distribution.DataParallel``) against jaxmirror's loops.

The same data-parallel training runs in ONE process, on the same simulated CPU devices, through
jaxmirror and through Keras 3 (``KERAS_BACKEND=jax``, set by this script), in the loops users
write. Every loop starts from the same params and reads the same batches in the same order:

  (jm)      jaxmirror's TF-style loop, ``tf_loop.py``'s (imported from it): per step
            ``x, y = next(iterator)`` over ``strategy.experimental_distribute_dataset``,
            ``loss = train_step(x, y)`` (``strategy.function`` of a step that reads
            ``jaxmirror.Variable``s, all-reduces the grads and assigns ``w - lr * g``),
            ``total += float(strategy.reduce("SUM", loss, axis=None))``.
  (jm')     a second, independent copy of (jm): the A/A control.
  (jm K)    fused steps: ``train_steps = strategy.function(step_fn, steps_per_execution=K)``,
            per K steps ``losses = train_steps(iterator)`` and
            ``total += float(strategy.reduce("SUM", losses, axis=None).sum())``.
  (stateless) Keras' "writing a training loop from scratch in JAX" guide under the
            distribution: ``keras.distribution.set_distribution(DataParallel(devices))`` before
            the model is built (its variables are replicated on the mesh), then a ``jax.jit``
            step of ``model.stateless_call`` + ``jax.value_and_grad`` +
            ``optimizer.stateless_apply``; per step the batch is placed with
            ``jax.device_put(x, distribution.get_data_layout(x.shape).backend_layout)`` (what
            ``distribute_dataset`` leaves to the user in one process) and
            ``total += float(loss)``.
  (fit 1)   ``model.compile(SGD, SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=1)``, ``model.fit(x, y, batch_size, epochs=1, shuffle=False,
            verbose=0)`` on NumPy arrays (the batches in loop order); the per-step time is the
            epoch's (``on_epoch_begin`` to ``on_epoch_end``: it ends after ``fit`` synced the
            state) / its steps. Keras' JAX ``fit`` does not wait for each step: its per-batch
            callbacks (the loss read) run on a helper thread.
  (fit K)   the same with ``steps_per_execution=K``: in Keras' JAX trainer a Python loop of K
            calls of the same jitted step per callback, not one program.

NumPy arrays are ``fit``'s input: a Python generator of the same batches is slower here (measured
with ``--fit-input generator``; the table says which ran). Neither uses ``tf.data``.

Workload: ``tf_loop.py``'s MLPs: "tiny" 32 -> 64 -> 10, global batch 256 (host-bound) and
"wide" 512 -> 2048 -> 2048 -> 10 (compute-bound), global batch ``--wide-batch`` (64 by default,
to keep the run short). The loss is sparse softmax cross-entropy, the mean over the global batch
(jaxmirror: each replica's summed loss / the global batch, all-reduced; Keras: its loss's
``sum_over_batch_size`` on the sharded batch), SGD lr 0.1 (jaxmirror: by hand; Keras:
``keras.optimizers.SGD(0.1)``). ``NUM_BATCHES`` (10) distinct host batches are cycled; every step
count is a multiple of 10 and of K, so every loop sees the same batches in the same order.

Method, per model and N (the first N of 8 simulated CPU devices): the first ``--check`` steps of
each loop run one at a time (they compile) and their losses must agree with jm's: bit for bit
for jm' and jm K on CPU, rtol 1e-5 (atol 1e-7) for Keras (another formula for the loss, XLA's
GSPMD program against a shard_map; for ``fit``, the running means it logs, against jm's). Then
the params after them (rtol 1e-4, atol 1e-6), for every loop. One untimed warm-up round, then
rounds (tiny: 8 of 200 steps, K = 10 and 50; wide: 6 of 10 steps, K = 10; ``--rounds-*``,
``--steps-*``, ``--k-*``); each round times the same steps of every loop (GC off), in an order
rotated by one each round. Ratios are taken within a round (Keras / jaxmirror: above 1 means
jaxmirror is faster); the tables give per-step medians and the ratios' median [min-max], and how
long ``fit`` spends per step outside its epoch (set-up, not in its row). No step may compile
again while timed. At the end jm, jm' and jm K must have equal params (bit for bit on CPU);
Keras' distance to them is reported (float32 drift over hundreds of steps, not asserted).

Run from the repository root (Keras and TensorFlow come in the ``bench`` extra; about 3 minutes
on 2 cores):
    .venv/bin/python benchmarks/vs_keras.py                  # tiny and wide, N = 2, 4
    .venv/bin/python benchmarks/vs_keras.py --quick          # a smoke run, noisy
"""

from __future__ import annotations

import os

from _platform import simulated_cpu_devices  # noqa: E402  (before JAX; CPU unless JAX_PLATFORMS)

_FLAG = simulated_cpu_devices(8)
os.environ["KERAS_BACKEND"] = "jax"  # this script compares with Keras' JAX backend

import argparse, gc, importlib.metadata, itertools, json, platform, statistics  # noqa: E401,E402
import sys, time, warnings  # noqa: E401,E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxmirror  # noqa: E402
from _timing import check_close, checkout, devices_and_models, devices_line  # noqa: E402
from _timing import platform_of, spread  # noqa: E402  (shared)
from fused_steps import make_loop  # noqa: E402  (fused steps, K at a time)
from tf_loop import LR, jaxmirror_loop  # noqa: E402

# tf_loop's step sums its rows' losses; every batch here splits evenly, so no row is padding
warnings.filterwarnings("ignore", message="run: a sum or mean over the rows of a padded batch")
NUM_BATCHES = 10  # distinct host global batches, cycled; step counts are multiples of it
# name -> layer sizes
SIZES = {"tiny": (32, 64, 10), "wide": (512, 2048, 2048, 10)}
JM, JM2, STATELESS = "jm", "jm'", "stateless"


def fused_name(k):
    return f"jm K={k}"


def fit_name(k):
    return f"fit spe={k}"


def host_data(sizes, global_batch: int, seed: int = 0):
    """The initial params (NumPy float32, ``w{i}``/``b{i}``) and the host global batches."""
    rng = np.random.default_rng(seed)
    params = {name: value for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])) for name, value
              in ((f"w{i}", (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)),
                  (f"b{i}", np.zeros((b,), np.float32)))}
    batches = [(rng.standard_normal((global_batch, sizes[0])).astype(np.float32),
                rng.integers(0, sizes[-1], global_batch).astype(np.int32))
               for _ in range(NUM_BATCHES)]
    return params, batches


def keras_model(keras, sizes, params):
    """A ``keras.Sequential`` MLP of ``sizes`` holding ``params`` (built under the distribution
    that is set, so its variables are laid out by it)."""
    layers = [keras.Input((sizes[0],))]
    for i, width in enumerate(sizes[1:]):
        layers.append(keras.layers.Dense(width, activation="relu" if i < len(sizes) - 2 else None))
    model = keras.Sequential(layers)
    model.set_weights([params[f"{p}{i}"] for i in range(len(sizes) - 1) for p in "wb"])
    return model


def keras_params(weights) -> dict:
    """Keras' ``[kernel, bias, ...]`` weights as ``{w0, b0, ...}`` NumPy arrays."""
    return {f"{p}{i // 2}": np.asarray(w) for i, (p, w) in enumerate(zip("wb" * len(weights),
                                                                           weights))}


def stateless_loop(keras, distribution, sizes, params, batches):
    """Keras' guide's training loop from scratch in JAX, the batches laid out by the
    distribution: ``loop(k)`` runs k steps, returns their losses."""
    model = keras_model(keras, sizes, params)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.SGD(learning_rate=LR)
    optimizer.build(model.trainable_variables)

    def compute_loss_and_updates(trainable, non_trainable, x, y):
        y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        return loss_fn(y, y_pred), non_trainable

    grad_fn = jax.value_and_grad(compute_loss_and_updates, has_aux=True)

    @jax.jit
    def train_step(state, data):
        trainable, non_trainable, optimizer_variables = state
        x, y = data
        (loss, non_trainable), grads = grad_fn(trainable, non_trainable, x, y)
        trainable, optimizer_variables = optimizer.stateless_apply(
            optimizer_variables, grads, trainable)
        return loss, (trainable, non_trainable, optimizer_variables)

    state = {"state": ([v.value for v in model.trainable_variables],
                       [v.value for v in model.non_trainable_variables],
                       [v.value for v in optimizer.variables])}
    x0, y0 = batches[0]
    layout_x = distribution.get_data_layout(x0.shape).backend_layout
    layout_y = distribution.get_data_layout(y0.shape).backend_layout
    it = itertools.cycle(batches)

    def loop(k: int) -> list:
        out, s = [], state["state"]
        for _ in range(k):
            x, y = next(it)
            loss, s = train_step(s, (jax.device_put(x, layout_x), jax.device_put(y, layout_y)))
            out.append(float(loss))
        state["state"] = s
        return out

    loop.params = lambda: keras_params(state["state"][0])
    # jax.jit's compiled-program count (private, as no public one exists); None if it goes
    loop.counts = lambda: (getattr(train_step, "_cache_size", lambda: None)(),)
    return loop


class _EpochTimer:
    """A Keras callback's epoch hooks: the seconds of each epoch; no batch hook, so ``fit``
    keeps dispatching its per-batch callbacks asynchronously. Made a ``keras.callbacks.Callback``
    subclass by ``fit_loop``."""

    def on_epoch_begin(self, epoch, logs=None):
        self.t0 = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds = time.perf_counter() - self.t0


def fit_loop(keras, sizes, params, batches, k: int, fit_input: str):
    """``model.fit`` with ``steps_per_execution=k``: ``loop(steps)`` runs one epoch of that many
    steps over the batches in loop order and returns its epoch's seconds (also
    ``loop.epoch_seconds()``; the whole call's: ``loop.call_seconds``)."""
    model = keras_model(keras, sizes, params)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=LR),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=k)
    timer = type("EpochTimer", (_EpochTimer, keras.callbacks.Callback), {})()
    global_batch = len(batches[0][1])
    arrays = {}

    def data(steps):
        if steps not in arrays:  # the batches cycled, as the iterators see them
            order = [batches[i % NUM_BATCHES] for i in range(steps)]
            arrays[steps] = (np.concatenate([x for x, _ in order]),
                             np.concatenate([y for _, y in order]))
        return arrays[steps]

    def loop(steps: int, callbacks=()) -> float:
        assert steps % NUM_BATCHES == 0 and steps % k == 0, steps
        t0 = time.perf_counter()
        if fit_input == "numpy":
            x, y = data(steps)
            model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0,
                      callbacks=[timer, *callbacks])
        else:
            model.fit((b for b in itertools.islice(itertools.cycle(batches), steps)),
                      steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[timer, *callbacks])
        loop.call_seconds = time.perf_counter() - t0
        return timer.seconds

    loop.epoch_seconds = lambda: timer.seconds

    def losses(steps: int) -> list:
        """Per-step losses of ``steps`` steps, recovered from the running means ``fit`` logs
        (with ``steps_per_execution=1``: one log per step)."""
        assert k == 1
        means = []
        logger = type("Logger", (keras.callbacks.Callback,), {
            "on_train_batch_end": lambda self, batch, logs=None: means.append(logs["loss"])})()
        loop(steps, [logger])
        return means

    loop.losses = losses
    loop.params = lambda: keras_params(model.get_weights())
    return loop


def running_means(losses) -> list:
    return [float(v) for v in np.cumsum(np.asarray(losses, np.float64))
            / np.arange(1, len(losses) + 1)]


def timed_steps(loop, steps: int) -> float:
    """Seconds per step of ``loop(steps)``; ``fit`` loops time their epoch themselves."""
    t0 = time.perf_counter()
    loop(steps)
    t = time.perf_counter() - t0
    return getattr(loop, "epoch_seconds", lambda: t)() / steps


def bench(keras, model: str, n: int, args) -> dict:
    sizes = SIZES[model]
    global_batch = 256 if model == "tiny" else args.wide_batch
    params, batches = host_data(sizes, global_batch)
    devices = jax.devices()[:n]
    steps, ks = args.steps[model], args.ks[model]
    distribution = keras.distribution.DataParallel(devices=devices)
    keras.distribution.set_distribution(distribution)
    try:
        loops = {JM: jaxmirror_loop(devices, params, batches, global_batch)}
        if args.aa:
            loops[JM2] = jaxmirror_loop(devices, params, batches, global_batch)
        for k in ks:
            loops[fused_name(k)] = make_loop(devices, params, batches, k,
                                               global_batch=global_batch)
        loops[STATELESS] = stateless_loop(keras, distribution, sizes, params, batches)
        loops[fit_name(1)] = fit_loop(keras, sizes, params, batches, 1, args.fit_input)
        for k in ks:
            loops[fit_name(k)] = fit_loop(keras, sizes, params, batches, k, args.fit_input)
        result = run(loops, model, n, steps, ks, args)
    finally:
        keras.distribution.set_distribution(None)
    result.update(model=model, n=n, global_batch=global_batch, ks=ks)
    return result


def run(loops, model, n, steps, ks, args) -> dict:
    where = platform_of(jax.devices()[:n])
    label = f"{model} N={n}"
    lcm = int(np.lcm.reduce([NUM_BATCHES, *ks]))  # fused and fit calls run K steps
    check = -(-args.check // lcm) * lcm
    first = {JM: [loops[JM](1) for _ in range(check)]}
    if JM2 in loops:
        first[JM2] = [loops[JM2](1) for _ in range(check)]
    for k in ks:
        first[fused_name(k)] = loops[fused_name(k)](check)
    first[STATELESS] = loops[STATELESS](check)
    first[fit_name(1)] = loops[fit_name(1)].losses(check)
    for k in ks:
        loops[fit_name(k)](check)
    how_jm = None
    for name in [name for name in first if name not in (JM, STATELESS, fit_name(1))]:
        # GPU: the fused scan or another strategy's program may round differently
        how_jm = check_close(f"{label}: {name}'s first losses vs jm's", first[name], first[JM],
                             gpu_rtol=1e-5, gpu_atol=1e-7, platform=where)
    # Keras vs jaxmirror: another loss formula (log_softmax against logsumexp), another program
    # (GSPMD against shard_map): float32 rounding, well inside rtol 1e-5 over the first steps.
    keras_tol = dict(gpu_rtol=1e-5, gpu_atol=1e-7, cpu_rtol=1e-5, cpu_atol=1e-7)
    how_keras = check_close(f"{label}: Keras stateless first losses vs jm's", first[STATELESS],
                            first[JM], platform=where, **keras_tol)
    check_close(f"{label}: Keras fit's running mean loss vs jm's", first[fit_name(1)],
                running_means(first[JM]), platform=where, **keras_tol)
    ref = loops[JM].params()
    params_tol = dict(gpu_rtol=1e-4, gpu_atol=1e-6, cpu_rtol=1e-4, cpu_atol=1e-6)
    for name, loop in loops.items():
        if name != JM:
            exact = not name.startswith(("fit", STATELESS))
            check_close(f"{label}: {name}'s params after {check} steps vs jm's", loop.params(),
                        ref, platform=where, **({"gpu_rtol": 1e-4, "gpu_atol": 1e-6} if exact
                                                else params_tol))
    counts = {name: loop.counts() for name, loop in loops.items() if hasattr(loop, "counts")}

    names = list(loops)
    times = {name: [] for name in names}
    gc.collect()
    gc.disable()
    try:
        for r in range(-1, args.rounds[model]):  # round -1: warm-up
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                t = timed_steps(loops[name], steps)
                if r >= 0:
                    times[name].append(t)
    finally:
        gc.enable()
    after = {name: loop.counts() for name, loop in loops.items() if hasattr(loop, "counts")}
    assert after == counts, (
        f"{label}: a step traced or compiled again while timed: {counts} -> {after}")
    ref = loops[JM].params()
    for name in names:
        if not name.startswith(("fit", STATELESS)) and name != JM:
            check_close(f"{label}: {name}'s params after timing vs jm's", loops[name].params(),
                        ref, gpu_rtol=1e-4, gpu_atol=1e-5, platform=where)
    drift = {name: max(float(np.max(np.abs(loops[name].params()[p] - ref[p]))) for p in ref)
             for name in names if name.startswith(("fit", STATELESS))}
    ratios = {name: [a / b for a, b in zip(times[name], times[JM])] for name in names}
    fit = loops[fit_name(1)]  # its last call (a timed round): the time fit spends off the epoch
    outside = (fit.call_seconds - fit.epoch_seconds()) / steps
    for k in ks:
        ratios[f"{fit_name(k)} / {fused_name(k)}"] = [
            a / b for a, b in zip(times[fit_name(k)], times[fused_name(k)])]
    rel = float(np.max(np.abs(np.subtract(first[STATELESS], first[JM])) / np.abs(first[JM])))
    return {"steps": steps, "rounds": args.rounds[model], "check": check, "times": times,
            "ratios": ratios, "first_losses": first, "stateless_max_rel_diff": rel,
            "keras_params_max_abs_diff_at_end": drift, "checked_jm": how_jm,
            "checked_keras": how_keras, "fit_outside_epoch_per_step": outside}


def table(results, args) -> list:
    lines = ["µs/step: median over rounds of the whole loop; ratios within a round, "
             "median [min–max]; > 1: that loop is slower than jaxmirror's.", "",
             "| model | N | batch | steps × rounds | jm (TF loop) | stateless | fit spe=1 "
             "| stateless / jm | fit spe=1 / jm | A/A jm' / jm | fit's call outside its epoch |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        med = {k: statistics.median(v) * 1e6 for k, v in r["times"].items()}
        aa = spread(r["ratios"][JM2]) if JM2 in r["ratios"] else "n/a"
        lines.append(
            f"| {r['model']} | {r['n']} | {r['global_batch']} | {r['steps']} × {r['rounds']} "
            f"| {med[JM]:.1f} | {med[STATELESS]:.1f} | {med[fit_name(1)]:.1f} "
            f"| {spread(r['ratios'][STATELESS])} | {spread(r['ratios'][fit_name(1)])} | {aa} "
            f"| +{r['fit_outside_epoch_per_step'] * 1e6:.1f} µs/step |")
    lines += ["", "| model | N | K | jm fused µs/step | fit spe=K µs/step | fit spe=K / jm fused "
              "| jm / jm fused |", "|---|---|---|---|---|---|---|"]
    for r in results:
        med = {k: statistics.median(v) * 1e6 for k, v in r["times"].items()}
        for k in r["ks"]:
            f, fit = fused_name(k), fit_name(k)
            lines.append(f"| {r['model']} | {r['n']} | {k} | {med[f]:.1f} | {med[fit]:.1f} "
                         f"| {spread(r['ratios'][f'{fit} / {f}'])} "
                         f"| {spread([1 / x for x in r['ratios'][f]])} |")
    lines += ["", "| model | N | first losses checked | stateless vs jm: max rel diff "
              "| params at the end, max abs diff to jm: stateless, fit spe=1 |",
              "|---|---|---|---|---|"]
    for r in results:
        d = r["keras_params_max_abs_diff_at_end"]
        lines.append(f"| {r['model']} | {r['n']} | {r['check']} steps; jm', jm K: "
                     f"{r['checked_jm']}; Keras: {r['checked_keras']} "
                     f"| {r['stateless_max_rel_diff']:.1e} "
                     f"| {d[STATELESS]:.1e}, {d[fit_name(1)]:.1e} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="2,4", help="replica counts, comma-separated")
    ap.add_argument("--models", default="tiny,wide", help=f"comma-separated, from {sorted(SIZES)}")
    ap.add_argument("--k-tiny", default="10,50",
                    help="tiny: steps per execution (fused, fit), comma-separated")
    ap.add_argument("--k-wide", default="10", help="wide: steps per execution, comma-separated")
    ap.add_argument("--rounds-tiny", type=int, default=8,
                    help="tiny: timed rounds, after one warm-up round")
    ap.add_argument("--rounds-wide", type=int, default=6,
                    help="wide: timed rounds, after one warm-up round")
    ap.add_argument("--steps-tiny", type=int, default=200,
                    help="tiny: steps per round per loop (rounded to a multiple of 10 and K)")
    ap.add_argument("--steps-wide", type=int, default=10, help="wide: steps per round per loop")
    ap.add_argument("--wide-batch", type=int, default=64, help="wide: the global batch")
    ap.add_argument("--check", type=int, default=10, help="first steps whose losses must agree")
    ap.add_argument("--no-aa", dest="aa", action="store_false", help="leave out jm' (A/A)")
    ap.add_argument("--fit-input", choices=("numpy", "generator"), default="numpy",
                    help="what fit reads: NumPy arrays (default) or a Python generator")
    ap.add_argument("--json", metavar="PATH", help="write the raw numbers here")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 rounds, fewer steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds_tiny, args.rounds_wide, args.steps_tiny, args.steps_wide = 2, 2, 50, 10
    args.ks = {m: [int(s) for s in getattr(args, f"k_{m}").split(",")] for m in SIZES}
    args.rounds = {m: getattr(args, f"rounds_{m}") for m in SIZES}
    args.steps = {}
    for m in SIZES:  # every loop sees the batches in the same order: multiples of 10 and K
        lcm, v = int(np.lcm.reduce([NUM_BATCHES, *args.ks[m]])), getattr(args, f"steps_{m}")
        args.steps[m] = max(lcm, v // lcm * lcm)
    checked = devices_and_models(ap, args.devices, args.models, SIZES, _FLAG)
    if checked is None:
        return 2
    ns, models = checked
    import keras  # after XLA_FLAGS and KERAS_BACKEND

    command = " ".join([os.path.basename(sys.executable)] + sys.argv)
    print(f"# Keras {keras.__version__} (JAX backend, DataParallel) vs jaxmirror: "
          f"{devices_line()}, {os.cpu_count()} host cores, jax {jax.__version__}, "
          f"Python {platform.python_version()}")
    print(f"# command: {command}")
    commit = checkout()
    print(f"# jaxmirror: {jaxmirror.__file__} ({commit}); keras "
          f"{importlib.metadata.version('keras')}; fit reads {args.fit_input}")
    print(f"# SGD lr {LR}, sparse softmax cross-entropy (mean over the global batch); "
          f"{NUM_BATCHES} host batches cycled; 1 warm-up round, then timed rounds, the order "
          f"rotated by one each round" + (" (--quick: noisy)" if args.quick else ""))
    for m in models:
        g = 256 if m == "tiny" else args.wide_batch
        print(f"# {m}: MLP {' -> '.join(map(str, SIZES[m]))}, global batch {g}, "
              f"{args.steps[m]} steps × {args.rounds[m]} rounds, K = "
              f"{', '.join(map(str, args.ks[m]))}")
    print()
    results, t_start = [], time.perf_counter()
    for m in models:
        for n in ns:
            t0 = time.perf_counter()
            r = bench(keras, m, n, args)
            results.append(r)
            print(f"  done {m} N={n} in {time.perf_counter() - t0:.1f}s", file=sys.stderr,
                  flush=True)
    print("\n".join(table(results, args)))
    print()
    print(f"# total {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "jaxmirror_checkout": commit, "args": vars(args),
                       "keras": keras.__version__, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
