"""What the benchmark scripts share: the MLP they time, the timing loops, the machine line and
the agreement checks (``check_close``: bit for bit on CPU, a stated tolerance on a GPU).

Import it after ``_platform.simulated_cpu_devices`` (it imports JAX).
"""

from __future__ import annotations

import collections
import datetime
import gc
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import jaxmirror


def _no_such_platform(kind, value, tb):
    """JAX 0.10/0.11 with ``JAX_PLATFORMS=cuda`` and no GPU it can use fails an ``assert``
    deep in its backend set-up, with no message: say what happened instead."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if issubclass(kind, AssertionError) and platforms not in ("", "cpu") and not str(value):
        names = [frame.f_code.co_filename for frame, _ in traceback.walk_tb(tb)]
        if any(name.endswith("xla_bridge.py") for name in names):
            sys.stderr.write(
                f"{os.path.basename(sys.argv[0])}: JAX_PLATFORMS={platforms}, but JAX found no "
                f"such device on this machine; on a GPU machine install jaxmirror[cuda13] (or "
                f"cuda12) and check nvidia-smi, or leave JAX_PLATFORMS unset to run on "
                f"simulated CPU devices\n")
            raise SystemExit(2)
    sys.__excepthook__(kind, value, tb)


sys.excepthook = _no_such_platform
from jaxmirror.core import inflight as _inflight


def init_params(key, sizes):
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        key, k = jax.random.split(key)
        params[f"w{i}"] = jax.random.normal(k, (a, b), jnp.float32) / np.sqrt(a)
        params[f"b{i}"] = jnp.zeros((b,), jnp.float32)
    return params


def mlp(params, x):
    n = len(params) // 2
    for i in range(n):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        if i < n - 1:
            x = jax.nn.relu(x)
    return x


def timed(loop, k: int) -> float:
    """Seconds per step for k steps of ``loop``, waiting for the last one at the end."""
    t0 = time.perf_counter()
    jax.block_until_ready(loop(k))
    return (time.perf_counter() - t0) / k


def dispatch(sync, loop, k: int) -> float:
    """Seconds per call to *return* from k calls started on an idle machine (no waiting).

    ``sync()`` makes the machine idle first. With k = MAX_IN_FLIGHT no in-flight bound waits on
    a step that is still running: what is timed is the host's work to launch a step.
    """
    sync()
    t0 = time.perf_counter()
    out = loop(k)
    t = time.perf_counter() - t0
    jax.block_until_ready(out)
    return t / k


def more_rounds(r: int, rounds: int, seconds: float, t0: float) -> bool:
    """Whether to run round ``r``: at least ``rounds``, then more (up to 10x) for ``seconds``."""
    return r < rounds or (r < 10 * rounds and time.perf_counter() - t0 < seconds)


def shuffled_rounds(timers: dict, rounds: int, seconds: float = 0.0) -> dict:
    """Call each timer once per round, in a fresh random order each round, with GC off.

    Args:
        timers: name -> a zero-argument callable returning seconds.
        rounds: how many rounds at least.
        seconds: go on with more rounds (up to 10 x ``rounds``) until this much time has passed.

    Returns:
        name -> the list of seconds, one per round.
    """
    rng = random.Random(0)
    times = {name: [] for name in timers}
    order = list(timers)
    gc.collect()
    gc.disable()
    t0, r = time.perf_counter(), 0
    try:
        while more_rounds(r, rounds, seconds, t0):
            r += 1
            rng.shuffle(order)
            for name in order:
                times[name].append(timers[name]())
    finally:
        gc.enable()
        _inflight.drain()
    return times


def one_call(fn) -> float:
    """Seconds to return from one call of ``fn`` on an idle machine; then waits and drains."""
    t0 = time.perf_counter()
    out = fn()
    t = time.perf_counter() - t0
    jax.block_until_ready(out)
    _inflight.drain()
    return t


def per_call(fn, number: int, repeat: int) -> float:
    """Median over `repeat` of the seconds per call of `fn()` called `number` times."""
    runs = []
    gc.disable()  # as timeit does
    try:
        for _ in range(repeat):
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            runs.append((time.perf_counter() - t0) / number)
    finally:
        gc.enable()
    return statistics.median(runs)


def checkout() -> str:
    """The imported jaxmirror's git commit, and whether its jaxmirror/ has uncommitted changes."""
    git = ["git", "-C", os.path.dirname(os.path.dirname(os.path.abspath(jaxmirror.__file__)))]
    try:
        out = [subprocess.run(git + c, capture_output=True, text=True, check=True).stdout.strip()
               for c in (["rev-parse", "--short", "HEAD"], ["status", "--porcelain", "jaxmirror"])]
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    return f"commit {out[0]}, " + ("jaxmirror/ modified" if out[1] else "clean")


def spread(xs) -> str:
    """``median [min–max]`` of ``xs``, three decimals (how the scripts print ratios)."""
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}–{max(xs):.3f}]"


def us(s: float | None) -> str:
    if s is None:
        return "n/a"
    return f"{s * 1e6:+.1f}" if s < 0 else f"{s * 1e6:.1f}"


def steps_and_cases(ap, args, models_table: dict, flag: str):
    """The options both scripts share, checked: steps per round, replica counts, model names.

    Args:
        ap: the script's ``argparse.ArgumentParser`` (for ``ap.error``).
        args: its parsed arguments (``quick``, ``steps_tiny``, ``steps_small``, ``devices``,
            ``models``).
        models_table: name -> (global batch, layer sizes, default steps per round).
        flag: the ``XLA_FLAGS`` setting the script made, for the error message.

    Returns:
        ``(steps, ns, models)``, or ``None`` (after a message on stderr) when JAX has fewer
        devices than asked for.
    """
    steps = {m: s for m, (_, _, s) in models_table.items()}
    if args.quick:
        steps = {"tiny": 24, "small": 3}
    if args.steps_tiny is not None:
        steps["tiny"] = args.steps_tiny
    if args.steps_small is not None:
        steps["small"] = args.steps_small
    checked = devices_and_models(ap, args.devices, args.models, models_table, flag)
    return None if checked is None else (steps, *checked)


def devices_and_models(ap, devices: str, model_names: str, models_table, flag: str):
    """The ``--devices`` and model options, checked against the table and JAX's devices.

    Args:
        ap: the script's ``argparse.ArgumentParser`` (for ``ap.error``).
        devices: comma-separated replica counts.
        model_names: comma-separated model names.
        models_table: the known model names (a dict or set).
        flag: the ``XLA_FLAGS`` setting the script made, for the error message.

    Returns:
        ``(ns, models)``, or ``None`` (after a message on stderr) when JAX has fewer devices
        than asked for.
    """
    ns = [int(s) for s in devices.split(",")]
    models = [m.strip() for m in model_names.split(",")]
    for m in models:
        if m not in models_table:
            ap.error(f"unknown model {m!r}; choose from {sorted(models_table)}")
    problem = too_few_devices(max(ns), flag)
    if problem:
        print(problem, file=sys.stderr)
        return None
    return ns, models


def too_few_devices(needed: int, flag: str) -> str | None:
    """What to tell the user when JAX has fewer than ``needed`` devices, or None.

    Args:
        needed: the most devices the run asks for.
        flag: the ``XLA_FLAGS`` setting the script made (for simulated CPU devices).

    Returns:
        The message, or None when JAX has enough devices.
    """
    have = jax.device_count()
    if needed <= have:
        return None
    if jax.default_backend() == "cpu":
        return (f"need {needed} devices, JAX has {have}: XLA_FLAGS must be set before JAX "
                f"starts (this script sets {flag}).")
    return (f"need {needed} devices, JAX has {have} ({devices_line()}): pass --devices with "
            f"at most {have}, e.g. --devices 1, or JAX_PLATFORMS=cpu for simulated CPU devices.")


def devices_line() -> str:
    """JAX's devices in a few words: ``8 simulated CPU devices`` or ``1 x NVIDIA H200 (gpu)``."""
    devices = jax.devices()
    first = devices[0]
    if first.platform == "cpu":
        return f"{len(devices)} simulated CPU device" + ("s" if len(devices) > 1 else "")
    kinds = collections.Counter(d.device_kind for d in devices)
    version = getattr(getattr(first, "client", None), "platform_version", "")
    version = f", {version}" if version and version != first.platform else ""
    return (", ".join(f"{count} x {kind}" for kind, count in kinds.items())
            + f" ({first.platform}{version})")


def platform_of(*values) -> str:
    """Where the arrays or devices among ``values`` live (``cpu``, ``gpu``, ``tpu``): the
    platform of the first ``jax.Device`` or ``jax.Array`` leaf, else JAX's default backend
    (host copies were made from it)."""
    for leaf in jax.tree.leaves(values):
        if isinstance(leaf, jax.Device):
            return leaf.platform
        if isinstance(leaf, jax.Array):
            try:
                return next(iter(leaf.devices())).platform
            except (RuntimeError, StopIteration):  # a deleted array
                break
    return jax.default_backend()


def check_close(name: str, got, want, *, gpu_rtol: float, gpu_atol: float = 0.0,
                cpu_rtol: float = 0.0, cpu_atol: float = 0.0, platform: str | None = None) -> str:
    """Assert that ``got`` equals ``want``: bit for bit on CPU, within a tolerance elsewhere.

    On CPU both sides are the same float32 arithmetic, so the scripts ask for equal bits. On a
    GPU two compiled programs may fuse and reduce in different orders, so the last bits differ,
    and the difference grows with every training step: each call site states its tolerance and
    why. A CPU tolerance is only for variants that compute differently on any platform (TF
    against JAX, a bfloat16 wire).

    Args:
        name: what is compared, for the messages.
        got: an array, number, or pytree (dict, list) of them.
        want: the same structure.
        gpu_rtol: ``assert_allclose``'s ``rtol`` off CPU.
        gpu_atol: its ``atol`` off CPU.
        cpu_rtol: on CPU: 0 (with ``cpu_atol`` 0) asks for equal bits.
        cpu_atol: on CPU, as ``cpu_rtol``.
        platform: the rule to apply; default: where ``got``'s arrays live (``platform_of``).

    Returns:
        What was checked, e.g. ``bit for bit (cpu)`` or ``rtol 1e-05, atol 0 (gpu)``.
    """
    platform = platform or platform_of(got, want)
    rtol, atol = (cpu_rtol, cpu_atol) if platform == "cpu" else (gpu_rtol, gpu_atol)
    exact = rtol == 0 and atol == 0
    how = f"bit for bit ({platform})" if exact else f"rtol {rtol:g}, atol {atol:g} ({platform})"
    got_leaves, got_tree = jax.tree.flatten(got)
    want_leaves, want_tree = jax.tree.flatten(want)
    assert got_tree == want_tree, f"{name}: structures differ: {got_tree} vs {want_tree}"
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        g, w = np.asarray(g), np.asarray(w)
        where = f"{name}" + (f", leaf {i}" if len(got_leaves) > 1 else "")
        assert g.shape == w.shape, f"{where}: shapes {g.shape} vs {w.shape} (checked {how})"
        if exact:  # the same bits (NaNs, -0.0 and all) where the dtypes agree
            same = (g.tobytes() == w.tobytes() if g.dtype == w.dtype
                    else np.array_equal(g, w, equal_nan=True))
            if not same:
                diff = np.abs(g.astype(np.float64) - w.astype(np.float64))
                if g.dtype == w.dtype:  # elements whose bytes differ
                    rows = (g.size, g.dtype.itemsize)
                    differ = (np.ascontiguousarray(g).view(np.uint8).reshape(rows)
                              != np.ascontiguousarray(w).view(np.uint8).reshape(rows)).any(1)
                else:
                    differ = g != w
                raise AssertionError(
                    f"{where}: {int(np.count_nonzero(differ))} of {g.size} values differ, "
                    f"max abs diff {float(np.nanmax(diff)):.3g}; checked {how}")
        else:
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol,
                                       err_msg=f"{where}: checked {how}")
    return how


def machine() -> str:
    """The host in one line: CPU, cores, memory, load, jax, Python and JAX's devices (the
    accelerator's kind and count where there is one: ``devices_line``)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        mem = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
    except (ValueError, OSError):
        mem = ""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{cpu}, {os.cpu_count()} cores{mem}; load average {load}; jax {jax.__version__}, "
            f"Python {platform.python_version()}, {devices_line()}")


def append_section(path: str, title: str, command: str, header: str, body: str,
                   seconds: float) -> None:
    """Append a dated ``# Results: title`` section (machine, commit, command, tables) to
    ``path`` (``benchmarks/RESULTS.md``)."""
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    with open(path, "a") as f:
        f.write(f"\n# Results: {title} ({when})\n\n"
                f"Machine: {machine()}. jaxmirror {checkout()}. Took {seconds:.0f} s.\n\n"
                f"```\n{command}\n```\n\n```\n{header.rstrip()}\n```\n\n{body.rstrip()}\n")
    print(f"# appended to {path}", file=sys.stderr)
