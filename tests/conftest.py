"""Eight simulated CPU devices for every test; set before JAX starts its backend."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

assert jax.device_count() == 8, "tests need 8 simulated CPU devices; something started JAX first"


@pytest.fixture
def devices():
    return jax.devices()


def mirrored(n):
    import jaxmirror

    return jaxmirror.MirroredStrategy([f"CPU:{i}" for i in range(n)])
