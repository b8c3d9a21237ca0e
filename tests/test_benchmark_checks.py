"""The benchmarks' agreement rule (``benchmarks/_timing.py``): bit for bit on CPU, a stated
tolerance on a GPU; and the machine line naming the devices."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

_PATH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "_timing.py"
_spec = importlib.util.spec_from_file_location("benchmarks_timing", _PATH)
timing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(timing)

ONE = np.float32(1.0)
ONE_ULP_UP = np.nextafter(ONE, np.float32(2.0))  # 1 + 1.19e-7


def test_cpu_asks_for_equal_bits_and_says_so():
    want = {"w": np.array([ONE, 2.0], np.float32), "b": np.zeros(3, np.float32)}
    assert timing.check_close("params", dict(want), want, gpu_rtol=1e-4,
                              platform="cpu") == "bit for bit (cpu)"
    got = {"w": np.array([ONE_ULP_UP, 2.0], np.float32), "b": np.zeros(3, np.float32)}
    with pytest.raises(AssertionError, match=r"params, leaf 1: 1 of 2 values differ.*"
                                             r"bit for bit \(cpu\)"):
        timing.check_close("params", got, want, gpu_rtol=1e-4, platform="cpu")


def test_bit_for_bit_means_the_bits_nans_and_signed_zeros_included():
    nan = np.array([np.nan, 1.0], np.float32)
    assert timing.check_close("loss", nan.copy(), nan, gpu_rtol=1e-4,
                              platform="cpu") == "bit for bit (cpu)"
    with pytest.raises(AssertionError, match="1 of 1 values differ"):
        timing.check_close("zero", np.float32(-0.0), np.float32(0.0), gpu_rtol=1e-4,
                           platform="cpu")


def test_gpu_allows_the_stated_tolerance_and_no_more():
    want = [float(ONE), 2.0, 3.0]
    got = [float(ONE_ULP_UP), 2.0, 3.0]
    assert timing.check_close("losses", got, want, gpu_rtol=1e-6,
                              platform="gpu") == "rtol 1e-06, atol 0 (gpu)"
    with pytest.raises(AssertionError, match=r"losses.*rtol 1e-06, atol 0 \(gpu\)"):
        timing.check_close("losses", [1.001, 2.0, 3.0], want, gpu_rtol=1e-6, platform="gpu")
    # gpu_rtol=0: equal bits on a GPU too (copies of the same arrays).
    with pytest.raises(AssertionError, match=r"bit for bit \(gpu\)"):
        timing.check_close("batch", got, want, gpu_rtol=0.0, platform="gpu")


def test_a_cpu_tolerance_is_for_variants_that_compute_differently():
    assert timing.check_close("tf vs jm", [1.00001], [1.0], gpu_rtol=1e-4, cpu_rtol=1e-4,
                              platform="cpu") == "rtol 0.0001, atol 0 (cpu)"
    with pytest.raises(AssertionError):
        timing.check_close("tf vs jm", [1.001], [1.0], gpu_rtol=1e-4, cpu_rtol=1e-4,
                           platform="cpu")


def test_shapes_and_structures_must_match():
    with pytest.raises(AssertionError, match="shapes"):
        timing.check_close("x", np.zeros(2), np.zeros(3), gpu_rtol=1e-4, platform="cpu")
    with pytest.raises(AssertionError, match="structures differ"):
        timing.check_close("x", {"a": 1.0}, {"b": 1.0}, gpu_rtol=1e-4, platform="cpu")


def test_the_platform_is_where_the_arrays_live_and_the_devices_are_named():
    x = jax.device_put(jnp.arange(3.0), jax.devices()[1])
    assert timing.platform_of(x) == timing.platform_of(jax.devices()[:2]) == "cpu"
    assert timing.platform_of(np.zeros(2)) == jax.default_backend() == "cpu"
    # Without a platform argument the rule follows the arrays: here CPU, so bit for bit.
    assert timing.check_close("x", x, np.arange(3.0, dtype=np.float32),
                              gpu_rtol=1e-4) == "bit for bit (cpu)"
    assert timing.devices_line() == "8 simulated CPU devices"
    assert "8 simulated CPU devices" in timing.machine()
    assert timing.too_few_devices(8, "--flag") is None
    assert timing.too_few_devices(9, "--flag") == (
        "need 9 devices, JAX has 8: XLA_FLAGS must be set before JAX starts (this script sets "
        "--flag).")
