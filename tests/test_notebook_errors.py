"""Errors users meet in notebooks say what to do: the device count fixed once JAX started, a
strategy cell run again, strategies from different cells mixed."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmirror as jm


def test_configure_cpu_devices_in_a_fresh_process_sets_the_count():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    code = ("import jaxmirror, jax; jaxmirror.configure_cpu_devices(3); "
            "jaxmirror.configure_cpu_devices(3); "  # the first cell run again: nothing changes
            "print(jax.device_count(), jaxmirror.MirroredStrategy().num_replicas_in_sync)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "3"]


def test_configure_cpu_devices_after_jax_started_says_restart_the_kernel():
    jm.configure_cpu_devices(jax.device_count())  # the count JAX has: a re-run cell is fine
    with pytest.raises(RuntimeError) as err:
        jm.configure_cpu_devices(jax.device_count() + 1)
    message = str(err.value)
    assert f"already started with {jax.device_count()} CPU device(s)" in message
    assert "Restart the kernel" in message and "first thing" in message
    for bad in (0, -1, 2.0, True, "8"):
        with pytest.raises(ValueError, match="`n` must be a positive int"):
            jm.configure_cpu_devices(bad)
    assert jm.experimental.simulate_cpu_devices is jm.configure_cpu_devices  # the old name


def test_a_device_jax_does_not_have_points_at_configure_cpu_devices():
    with pytest.raises(ValueError, match=r"names no device.*configure_cpu_devices\(n\).*restart"):
        jm.MirroredStrategy([f"CPU:{jax.device_count()}"])


def test_a_strategy_cell_run_again_then_old_variables_used():
    first = jm.MirroredStrategy(["CPU:0", "CPU:1"])
    with first.scope():
        v = jm.Variable(jnp.ones(2))
    again = jm.MirroredStrategy(["CPU:0", "CPU:1"])  # the same cell, run a second time
    with pytest.raises(ValueError, match="cell that creates the strategy ran again") as err:
        again.run(lambda: v.assign_add(jnp.ones(2)))
    assert f"{id(first):#x}" in str(err.value) and f"{id(again):#x}" in str(err.value)
    assert v.numpy().tolist() == [1.0, 1.0]  # nothing half-done


def test_strategies_from_different_cells_mixed():
    first = jm.MirroredStrategy(["CPU:0", "CPU:1"])
    second = jm.MirroredStrategy(["CPU:0", "CPU:1"])
    with first.scope():
        for attempt in (lambda: second.scope().__enter__(),
                        lambda: second.run(lambda: jnp.float32(1))):
            with pytest.raises(RuntimeError) as err:
                attempt()
            message = str(err.value)
            # TF's wording first, then which objects (they print alike) and what to do.
            assert message.startswith("Mixing different jaxmirror Strategy objects")
            assert f"{id(first):#x}" in message and f"{id(second):#x}" in message
            assert "ran again" in message and "leave that scope" in message


def test_whole_arrays_given_as_a_dataset_say_to_batch_them():
    # TF's `from_tensor_slices((x, y)).batch(G)` habit, ported literally.
    s = jm.MirroredStrategy(["CPU:0", "CPU:1"])
    x, y = np.ones((10, 3), np.float32), np.zeros(10, np.int32)
    it = iter(s.experimental_distribute_dataset((x, y)))
    next(it)  # x, read as the first global batch
    with pytest.raises(ValueError, match=r"Given whole arrays `\(x, y\)`\?.*batch them first"):
        next(it)


def test_keras_2s_reset_states_name_resets_the_metric():
    m = jm.metrics.SparseCategoricalAccuracy()
    m.update_state(np.array([1, 0]), np.array([[0.1, 0.9], [0.2, 0.8]], np.float32))
    assert float(m.result()) == 0.5
    m.reset_states()
    assert float(m.result()) == 0.0
