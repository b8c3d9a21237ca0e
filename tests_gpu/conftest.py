"""The GPU test set (``make test-gpu``): jaxmirror on the real accelerator, against plain JAX.

Every test compares what a ``MirroredStrategy`` over every GPU computes with the same math in
plain JAX (``jax.jit``, ``nnx.jit``) on the first GPU. Matmuls and convolutions run at
``"highest"`` precision in the whole set (float32, no TF32 on Ampere and later), so the two
differ only by summation order: each test states its tolerance and why.

Without a GPU every test is skipped, with a message saying what to install; where the machine
has an NVIDIA GPU (``nvidia-smi``) that JAX cannot use, the set stops with that message instead
of passing without testing anything. Run it on its own, not in one command with ``tests/``
(which needs 8 simulated CPU devices). To check the set's
logic without one, run it on CPU devices: ``JAXMIRROR_GPU_SET_PLATFORM=cpu`` (two simulated
devices unless ``XLA_FLAGS`` names a count; ``JAXMIRROR_GPU_SET_CPU_DEVICES=n`` for ``n``).
"""

import os
import shutil
import sys

PLATFORM = os.environ.get("JAXMIRROR_GPU_SET_PLATFORM", "gpu").strip().lower()
PLATFORM = "gpu" if PLATFORM == "cuda" else PLATFORM  # JAX_PLATFORMS' name for it
if PLATFORM not in ("gpu", "cpu"):
    raise ValueError(f"tests_gpu: JAXMIRROR_GPU_SET_PLATFORM={PLATFORM!r} is not a platform of "
                     f"this set; use 'gpu' (the default; 'cuda' names it too) or 'cpu'.")
if PLATFORM == "cpu":  # set before JAX starts: simulated CPU devices, never the GPU
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        count = os.environ.get("JAXMIRROR_GPU_SET_CPU_DEVICES", "2")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={count}").strip()
    if "jax" in sys.modules:  # imported already (a plugin): its backend may not have started yet
        sys.modules["jax"].config.update("jax_platforms", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

# float32 matmuls and convolutions as float32 (not TF32, not bf16 passes), in every program.
jax.config.update("jax_default_matmul_precision", "highest")


def _find_devices():
    """(the chosen platform's devices, or None; why none)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    try:
        return jax.devices(PLATFORM), ""
    except AssertionError:  # JAX 0.10/0.11 with JAX_PLATFORMS=cuda and no GPU it can use
        return None, f"JAX_PLATFORMS={platforms} but JAX found no GPU it can use"
    except RuntimeError as e:  # no such backend, or it failed to start
        hidden = platforms and not any(p in platforms for p in ("cuda", "gpu", "rocm"))
        return None, str(e) + (f"; JAX_PLATFORMS={platforms} leaves the GPU out" if hidden else "")


DEVICES, _WHY = _find_devices()
SKIP_MESSAGE = (
    f"no GPU: jax.devices('gpu') found none ({_WHY}); install jaxmirror[cuda13] (or cuda12) "
    f"on a machine with an NVIDIA GPU, or set JAXMIRROR_GPU_SET_PLATFORM=cpu to check this set "
    f"on the CPU")


def pytest_report_header(config):
    if DEVICES is None:
        return [f"tests_gpu: {SKIP_MESSAGE}"]
    return [f"tests_gpu: jax {jax.__version__}, {len(DEVICES)} {PLATFORM} device(s): "
            f"{DEVICES[0].device_kind}"]


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    outside = [item.nodeid for item in items if not str(item.path).startswith(here)]
    if outside:
        raise pytest.UsageError(
            f"tests_gpu: run the GPU set on its own (`make test-gpu`): {outside[0]} and "
            f"{len(outside) - 1} more tests need tests/conftest.py's 8 simulated CPU devices, in "
            f"a process of their own (`make test`)")
    if DEVICES is None and PLATFORM == "gpu" and shutil.which("nvidia-smi"):
        raise pytest.UsageError(
            f"tests_gpu: this machine has an NVIDIA GPU (nvidia-smi) but JAX cannot use it: "
            f"{_WHY}; install JAX's CUDA build (`pip install -e '.[cuda13]'`, or cuda12 for a "
            f"CUDA 12 driver) and check `python -c 'import jax; print(jax.devices())'`")
    if DEVICES is None:
        mark = pytest.mark.skip(reason=SKIP_MESSAGE)
        for item in items:
            item.add_marker(mark)


def pytest_terminal_summary(terminalreporter):
    """What the set ran on, also under ``-q`` (which hides the header)."""
    if DEVICES is not None:
        terminalreporter.write_line(
            f"tests_gpu ran on jax {jax.__version__}, {len(DEVICES)} {PLATFORM} device(s): "
            f"{DEVICES[0].device_kind}")


@pytest.fixture(scope="session")
def devices():
    """Every device of the platform: the strategy's replicas (one per GPU)."""
    return list(DEVICES)


@pytest.fixture(scope="session")
def strategy(devices):
    """A ``MirroredStrategy`` over every device of the platform, made once for the set."""
    import jaxmirror

    return jaxmirror.MirroredStrategy(devices)


@pytest.fixture(scope="session")
def device(devices):
    """The first device: where the plain-JAX reference runs."""
    return devices[0]
