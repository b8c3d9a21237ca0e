"""Which devices a benchmark runs on. Imported first by every script: it imports no JAX.

A script runs on simulated CPU devices (``--xla_force_host_platform_device_count``) unless
``JAX_PLATFORMS`` names another platform; on a GPU machine
``JAX_PLATFORMS=cuda python benchmarks/<script>.py --devices 1`` runs it on one GPU, and the
CPU flag is left out (it only ever changes the CPU platform).
"""

from __future__ import annotations

import os

COUNT_FLAG = "--xla_force_host_platform_device_count"


def simulated_cpu_devices(count: int) -> str:
    """Ask for ``count`` simulated CPU devices, unless ``JAX_PLATFORMS`` names another platform.

    Call it before JAX starts. ``JAX_PLATFORMS`` defaults to ``cpu`` (the numbers in
    ``RESULTS.md`` are simulated CPU devices, on any machine); a value the user set is kept.

    Args:
        count: how many simulated CPU devices.

    Returns:
        The ``XLA_FLAGS`` setting asked for, for the scripts' messages.
    """
    flag = f"{COUNT_FLAG}={count}"
    platforms = os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if (not platforms or "cpu" in platforms.split(",")) and COUNT_FLAG not in os.environ.get(
            "XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    return flag
