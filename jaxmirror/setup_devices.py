"""Simulated CPU devices, so multi-replica code runs on a laptop."""

from __future__ import annotations

from jaxmirror import _compat


def simulate_cpu_devices(n: int) -> None:
    """Give JAX ``n`` CPU devices, so ``MirroredStrategy()`` has ``n`` replicas without a GPU.

    Call it first thing, before any JAX computation: XLA fixes the device count when its backend
    starts. On a machine with GPUs it is harmless (``MirroredStrategy()`` still takes the GPUs).

    Args:
        n: how many CPU devices to simulate (>= 1).

    Returns:
        None.

    Raises:
        ValueError: when ``n`` is not a positive int.
        RuntimeError: when JAX's backend has already started (restart the kernel and call this
            before anything else touches JAX).

    Example:
        >>> import jaxmirror
        >>> try:
        ...     jaxmirror.experimental.simulate_cpu_devices(8)
        ... except RuntimeError:
        ...     pass  # too late in this process: JAX is already running
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"simulate_cpu_devices: `n` must be a positive int; got {n!r}.")
    if _compat.backend_started():
        import jax

        have = jax.device_count("cpu") if jax.default_backend() == "cpu" else len(jax.devices("cpu"))
        if have == n:
            return
        raise RuntimeError(
            f"simulate_cpu_devices({n}): JAX has already started with {have} CPU device(s), and "
            f"the count is fixed once it starts. Restart the kernel (or process) and call "
            f"jaxmirror.experimental.simulate_cpu_devices({n}) before any other JAX work."
        )
    _compat.set_cpu_device_count(n)
