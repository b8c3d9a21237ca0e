"""Eight simulated CPU devices for every test; set before JAX starts its backend."""

import functools
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

assert jax.device_count() == 8, "tests need 8 simulated CPU devices; something started JAX first"


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
