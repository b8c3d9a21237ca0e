"""Eight simulated CPU devices for every test; set before JAX starts its backend.

The suite forces the CPU platform itself (``JAX_PLATFORMS=cpu``), also on a machine with a CUDA
jaxlib, where JAX's default backend would be the GPU; it is set in ``os.environ``, so the
subprocesses, notebook kernels and Ray workers the tests start inherit it. The GPU test set is
``tests_gpu/`` (``make test-gpu``).
"""

import functools
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
if "jax" in sys.modules:  # imported already (a plugin): its backend may not have started yet
    sys.modules["jax"].config.update("jax_platforms", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

if jax.default_backend() != "cpu" or jax.device_count() != 8:
    raise pytest.UsageError(
        f"tests/conftest.py: JAX started before the tests could set it up, on "
        f"{jax.default_backend()!r} with {jax.device_count()} device(s); the tests need 8 "
        f"simulated CPU devices: run them in a fresh process where nothing imports and uses JAX "
        f"first (e.g. `JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 "
        f"pytest tests`), and run the GPU set with `make test-gpu`.")


@pytest.fixture
def devices():
    return jax.devices()


def mirrored(n):
    import jaxmirror

    return jaxmirror.MirroredStrategy([f"CPU:{i}" for i in range(n)])


@functools.lru_cache(maxsize=None)
def strategy(n):
    """A MirroredStrategy over the first ``n`` CPU devices, made once per test session."""
    return mirrored(n)


def ctx():
    import jaxmirror

    return jaxmirror.get_replica_context()


def local(s, value):
    """``s``'s local results of ``value`` as NumPy arrays."""
    return [np.asarray(c) for c in s.experimental_local_results(value)]


@pytest.fixture
def nothing_open():
    """No step open or in flight before and after the test (failure tests start clean)."""
    from jaxmirror.core import inflight
    from jaxmirror.variables import state

    state.settle_all()
    inflight.drain()
    yield
    state.settle_all()
    inflight.drain()
