"""Devices: TF device names ("GPU:0"-style strings, full TF names) and simulated CPU devices."""

from __future__ import annotations

import re

import jax

from jaxmirror.core import _compat

_PLATFORM_TO_TF = {"cpu": "CPU", "gpu": "GPU", "cuda": "GPU", "rocm": "GPU", "tpu": "TPU"}
_TF_TO_PLATFORM = {"CPU": "cpu", "GPU": "gpu", "TPU": "tpu"}
_DEVICE_RE = re.compile(
    r"^(?:/job:[^/]+)?(?:/replica:\d+)?(?:/task:(?P<task>\d+))?(?:/device:|/)?"
    r"(?P<kind>cpu|gpu|tpu)(?::(?P<index>\d+))?$",
    re.IGNORECASE,
)
_EXPECTED = ("a jax.Device or a TF device string such as 'GPU:0', '/gpu:1', '/device:CPU:0' or "
             "'/job:localhost/replica:0/task:0/device:CPU:0'")


def _platform_devices(kind: str, task: int) -> list:
    try:
        devs = jax.devices(_TF_TO_PLATFORM[kind])
    except RuntimeError:
        return []
    return [d for d in devs if d.process_index == task]


def tf_kind(device) -> str:
    return _PLATFORM_TO_TF.get(device.platform, device.platform.upper())


def tf_name(device, tasks=None) -> str:
    """The full TF name of a JAX device, e.g. ``/job:localhost/replica:0/task:0/device:GPU:1``.

    The index counts the devices of the same kind in the device's own process, as TF does
    (JAX's ids, e.g. 2048 for another process's CPU, are never shown).

    Args:
        device: a ``jax.Device``.
        tasks: for a multi-worker cluster, the ``(job, task index)`` of each process, in
            process order (``/job:worker/replica:0/task:1/...``); ``None``: ``localhost``.

    Returns:
        A str.
    """
    kind = tf_kind(device)
    index = _platform_devices(kind, device.process_index).index(device)
    job, task = ("localhost", device.process_index) if tasks is None else \
        tasks[device.process_index]
    return f"/job:{job}/replica:0/task:{task}/device:{kind}:{index}"


def resolve(spec, api: str, arg_name: str):
    """The ``jax.Device`` that ``spec`` names; ValueError naming ``api`` and ``arg_name`` otherwise."""
    if isinstance(spec, jax.Device):
        return spec
    match = _DEVICE_RE.match(spec.strip()) if isinstance(spec, str) else None
    if match is None:
        raise ValueError(f"{api}: `{arg_name}` {spec!r} is not a device; give {_EXPECTED}.")
    kind = match["kind"].upper()
    task = int(match["task"]) if match["task"] is not None else jax.process_index()
    index = int(match["index"] or 0)
    candidates = _platform_devices(kind, task)
    if index >= len(candidates):
        have = ", ".join(f"{kind}:{i}" for i in range(len(candidates))) or f"no {kind} devices"
        hint = (" For more CPU devices without a GPU, call jaxmirror.configure_cpu_devices(n) "
                "before anything uses JAX (in a notebook: restart the kernel, then run it in the "
                "first cell)." if kind == "CPU" else "")
        raise ValueError(f"{api}: `{arg_name}` {spec!r} names no device of task {task}; name "
                         f"one it has: {have}.{hint}")
    return candidates[index]


def resolve_all(specs, api: str, arg_name: str) -> list:
    """Resolve a sequence of device specs; duplicates and an empty sequence raise ValueError."""
    if isinstance(specs, (str, jax.Device)):
        specs = [specs]
    specs = list(specs)
    if not specs:
        raise ValueError(f"{api}: `{arg_name}` names no device; name at least one, or pass None "
                         f"for every local device.")
    devices = [resolve(s, api, arg_name) for s in specs]
    if len(set(devices)) != len(devices):
        # TF's wording, on purpose.
        raise ValueError(f"No duplicates allowed in `{arg_name}` argument: {specs!r}.")
    return devices


def default_local_devices() -> list:
    """All local GPUs if there are any, else all local devices of the default backend (CPUs)."""
    try:
        gpus = jax.local_devices(backend="gpu")
    except RuntimeError:
        gpus = []
    return gpus or jax.local_devices()


def default_global_devices() -> list:
    """Every process's devices, GPUs if this process has any, else the default backend's,
    in process order (each worker's devices together, as its replicas must be).

    Returns:
        A list of ``jax.Device``.

    Example:
        >>> len(default_global_devices()) == len(jax.devices())
        True
    """
    kind = default_local_devices()[0].platform
    return sorted(jax.devices(kind), key=lambda d: (d.process_index, d.id))


def configure_cpu_devices(n: int) -> None:
    """Give JAX ``n`` CPU devices, so ``MirroredStrategy()`` has ``n`` replicas without a GPU.

    Call it in a notebook's first cell, before anything touches JAX: XLA fixes the device count
    when its backend starts, and only a fresh process (a restarted kernel) can change it. Calling
    it again with the same ``n`` (re-running the cell) does nothing. On a machine with GPUs it is
    harmless: ``MirroredStrategy()`` still takes the GPUs.

    Args:
        n: how many CPU devices to simulate (>= 1).

    Returns:
        None.

    Raises:
        ValueError: when ``n`` is not a positive int.
        RuntimeError: when JAX has already started with another CPU device count; the message
            says to restart the kernel and run this call first.

    Example:
        >>> import jaxmirror
        >>> try:
        ...     jaxmirror.configure_cpu_devices(8)
        ... except RuntimeError:
        ...     pass  # too late in this process: JAX is already running
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"configure_cpu_devices: `n` must be a positive int; got {n!r}.")
    if _compat.backend_started():
        have = jax.device_count("cpu") if jax.default_backend() == "cpu" else len(jax.devices("cpu"))
        if have == n:
            return
        raise RuntimeError(
            f"configure_cpu_devices({n}): JAX has already started with {have} CPU device(s), "
            f"and XLA fixes the count when it starts (something above this call used JAX). "
            f"Restart the kernel (Jupyter: Kernel > Restart; a script: run it again) and make "
            f"jaxmirror.configure_cpu_devices({n}) the first thing it runs, right after "
            f"`import jaxmirror`."
        )
    _compat.set_cpu_device_count(n)


# The name this function had before it became public at the top level; kept so code written
# against ``jaxmirror.experimental.simulate_cpu_devices`` keeps working.
simulate_cpu_devices = configure_cpu_devices
