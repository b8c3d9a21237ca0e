"""The GPU test set (``tests_gpu/``, ``make test-gpu``) checked without a GPU, and the suite's own
CPU platform (``tests/conftest.py`` forces it, also beside a CUDA jaxlib).

The set runs in a subprocess, twice: on two simulated CPU devices (``JAXMIRROR_GPU_SET_PLATFORM=
cpu``), where every test must pass, and with the GPU hidden (``JAX_PLATFORMS=cpu``, as on a
machine without one), where every test must be skipped with the message saying what to install.
"""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]
GPU_SET = ROOT / "tests_gpu"
SKIP_MESSAGE = ("no GPU: jax.devices('gpu') found none", "install jaxmirror[cuda13] (or cuda12) "
                "on a machine with an NVIDIA GPU")
# What the outer run sets that the subprocess must not inherit: its device count, the set's
# options, and pytest's own variables (PYTEST_ADDOPTS, pytest-xdist's worker names).
DROPPED = ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "JAXMIRROR_GPU_SET_PLATFORM",
           "JAXMIRROR_GPU_SET_CPU_DEVICES")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in DROPPED and not k.startswith("PYTEST_")}
    env.update(extra)
    return env


def _pytest(args, env, timeout):
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _test_count() -> int:
    """The set's tests: its ``test_*`` functions (it parametrizes none)."""
    return sum(isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
               for path in sorted(GPU_SET.glob("test_*.py"))
               for node in ast.parse(path.read_text()).body)


def _outcomes(done) -> dict:
    """pytest's summary line as {outcome: count}, warnings left out."""
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    return {outcome: int(n) for n, outcome in re.findall(r"(\d+) (\w+)", last)
            if not outcome.startswith("warning")}


def test_the_gpu_set_passes_on_cpu_devices_when_asked():
    count = _test_count()
    assert count >= 8  # run, reduce, variables, rollback, fused, NNX, checkpoint, input, tutorial
    done = _pytest(["tests_gpu"], _env(JAXMIRROR_GPU_SET_PLATFORM="cpu"), timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert _outcomes(done) == {"passed": count}, done.stdout[-4000:]
    assert "2 cpu device(s)" in done.stdout  # the report header: the platform it ran on


def test_the_gpu_set_skips_with_a_message_without_a_gpu():
    count = _test_count()
    done = _pytest(["-q", "-rs", "tests_gpu"], _env(JAX_PLATFORMS="cpu"), timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert _outcomes(done) == {"skipped": count}, done.stdout[-4000:]
    skips = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skips and all(all(part in line for part in SKIP_MESSAGE) for line in skips), skips


def test_the_suite_runs_on_eight_cpu_devices():
    assert os.environ["JAX_PLATFORMS"] == "cpu"  # inherited by what the tests start
    assert jax.default_backend() == "cpu" and jax.device_count() == 8


def test_the_suite_forces_the_cpu_platform_over_the_environments():
    # JAX_PLATFORMS=cuda: the GPU backend where a CUDA jaxlib is installed, and a backend that
    # fails to start where none is; either way the suite's conftest makes it the CPU, also when
    # JAX was imported (not started) before it.
    code = ("import sys, jax, pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', "
            "'tests/test_gpu_set.py::test_the_suite_runs_on_eight_cpu_devices']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(JAX_PLATFORMS="cuda"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert _outcomes(done) == {"passed": 1}, done.stdout[-2000:]


def test_the_suite_stops_with_a_message_when_jax_started_first():
    code = ("import sys, jax; jax.devices(); import pytest; sys.exit(pytest.main(['-q', '-p', "
            "'no:cacheprovider', 'tests/test_gpu_set.py::test_the_suite_runs_on_eight_cpu_devices"
            "']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "tests/conftest.py: JAX started before the tests could set it up, on 'cpu' with 1 " \
           "device(s); the tests need 8 simulated CPU devices" in out, out[-3000:]
