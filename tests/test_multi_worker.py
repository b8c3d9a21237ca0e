"""MultiWorkerMirroredStrategy across real processes on loopback, against one process.

Workers are started by ``jaxmirror.launch.run`` (2 workers x 2 CPU devices, 4 x 1); the
reference is the same scenario on a ``MirroredStrategy`` over 4 devices of this process.
Every launch is bounded by a timeout, and the launcher kills what it started.
"""

import functools

import jax
import numpy as np
import pytest

import jaxmirror as jm
import multi_worker_scenarios as scenarios
from conftest import strategy as one_process

LAYOUTS = [(2, 2), (4, 1)]
TIMEOUT = 180


@functools.lru_cache(maxsize=None)
def _launch(name, workers, devices, *args):
    results = jm.launch.run(scenarios.in_worker, workers=workers, devices_per_worker=devices,
                            args=(name,) + args, timeout=TIMEOUT)
    assert [index for index, _ in results] == list(range(workers))
    return [result for _, result in results]


@functools.lru_cache(maxsize=None)
def _reference(name):
    return getattr(scenarios, name)(one_process(4))


@pytest.mark.parametrize("workers,devices", LAYOUTS)
def test_collectives_variables_and_input_match_one_process(workers, devices):
    results, ref = _launch("collectives", workers, devices), _reference("collectives")
    for index, got in enumerate(results):
        assert got["num_replicas"] == 4
        assert got["worker_devices"] == devices
        assert got["should_checkpoint"] == (index == 0)  # the chief only, as TF
        for key in ["reduce_sum", "reduce_mean_axis0", "gather", "merge_call", "mirrored",
                    "sync_sum", "sync_mean"]:
            np.testing.assert_allclose(got[key], ref[key], rtol=1e-6, err_msg=key)
        for key in ["all_reduce_mean_nest", "all_reduce_sum_nest"]:  # packed across workers
            for a, b in zip(jax.tree.leaves(got[key]), jax.tree.leaves(ref[key])):
                assert a.dtype == b.dtype, key
                np.testing.assert_array_equal(a, b, err_msg=key)
        for seen, want in zip(got["dataset_seen"], ref["dataset_seen"]):
            np.testing.assert_array_equal(seen, want)
        for sums, want in zip(got["dataset_sums"], ref["dataset_sums"]):
            np.testing.assert_array_equal(sums, want)
    # Local results: each worker holds its own replicas, in replica order.
    for key in ["local", "all_reduce", "all_gather", "sync_local"]:
        joined = [c for got in results for c in got[key]]
        assert len(joined) == 4
        for c, want in zip(joined, ref[key]):
            np.testing.assert_allclose(c, want, err_msg=key)
    for step in range(3):
        joined = [c for got in results for c in got["dataset_local"][step]]
        for c, want in zip(joined, ref["dataset_local"][step]):
            np.testing.assert_array_equal(c, want)
    # The reference numbers themselves (4 replicas): replica i holds (i + 1) * [1, 2].
    np.testing.assert_allclose(ref["reduce_sum"], [10.0, 20.0])
    np.testing.assert_allclose(ref["merge_call"], 12.0)
    assert ref["sync_sum"] == 10.0 and ref["sync_mean"] == 4.5
    np.testing.assert_array_equal(ref["dataset_seen"][2], np.arange(40.0, 54.0).reshape(7, 2))
    assert ref["all_reduce_mean_nest"]["int"] == 1.5
    assert ref["all_reduce_mean_nest"]["int"].dtype == np.float32
    assert ref["all_reduce_mean_nest"]["half"].dtype == np.float16
    np.testing.assert_array_equal(ref["all_reduce_sum_nest"][1], np.full((2, 2), 6.0))


@pytest.mark.parametrize("workers,devices", LAYOUTS)
def test_mlp_training_equals_one_process_step_for_step(workers, devices):
    results, ref = _launch("train_mlp", workers, devices), _reference("train_mlp")
    assert len(ref["losses"]) == 8  # 2 epochs of 16, 16, 16, 2 rows
    for got in results:
        np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        for k in ref["params"]:
            np.testing.assert_allclose(got["params"][k], ref["params"][k], rtol=1e-5,
                                       atol=1e-6, err_msg=k)
    assert ref["losses"][-1] < ref["losses"][0]


@pytest.mark.parametrize("workers,devices", LAYOUTS)
def test_communication_options_across_processes(workers, devices):
    want = _reference("communication_options")
    for got in _launch("communication_options", workers, devices):
        for name in ("default", "packs"):  # gloo may add in another order: float tolerance
            np.testing.assert_allclose(got[name][0], want["default"][0], rtol=1e-6)
            assert got[name][1:] == want[name][1:] == [10.0, 8]
        np.testing.assert_allclose(got["bfloat16"][0], want["bfloat16"][0], rtol=1e-6)
        np.testing.assert_allclose(got["bfloat16"][0], want["default"][0], rtol=2 ** -7)
        assert got["reduce_to"] == want["reduce_to"] == 2.5


def test_dataset_from_function_sees_every_example_once_with_uneven_workers():
    results = _launch("pipelines", 2, 2)
    for index, got in enumerate(results):
        assert got["contexts"] == [(2, index, 4)]
    # Both workers agree on every step; pipeline 0 has 7 rows, pipeline 1 has 9.
    steps = results[0]["steps"]
    for a, b in zip(steps, results[1]["steps"]):
        np.testing.assert_array_equal(a, b)
    seen = np.concatenate(steps)
    want = np.concatenate([np.arange(7.0), 100.0 + np.arange(9.0)])
    np.testing.assert_array_equal(np.sort(seen), np.sort(want))
    assert len(steps) == 3  # 4 + 4 rows per step; pipeline 1's last step is partial


def test_checkpoint_saved_by_two_workers_restores_in_one_process(tmp_path):
    path = str(tmp_path / "two_workers")
    results = jm.launch.run(scenarios.in_worker, workers=2, devices_per_worker=2,
                            args=("save_trained", path), timeout=TIMEOUT)
    trained = results[0][1]["params"]
    restored = scenarios.restore_params(one_process(4), path)
    for k in trained:
        np.testing.assert_array_equal(restored[k], trained[k])
    assert not np.allclose(trained["w1"], scenarios.init_params()["w1"])


def test_checkpoint_saved_by_one_process_restores_on_two_workers(tmp_path):
    path = str(tmp_path / "one_process")
    trained = scenarios.save_trained(one_process(4), path)["params"]
    results = jm.launch.run(scenarios.in_worker, workers=2, devices_per_worker=2,
                            args=("restore_params", path), timeout=TIMEOUT)
    for _, restored in results:
        for k in trained:
            np.testing.assert_array_equal(restored[k], trained[k])


def test_reuses_a_matching_jax_distributed_refuses_a_mismatch_and_server_joins():
    results = jm.launch.run(scenarios.joined_by_hand, workers=2, devices_per_worker=1,
                            timeout=TIMEOUT)
    for index, got in enumerate(results):
        assert got["total"] == 2.0
        assert "already initialized as process" in got["mismatch"]
        assert f"process {index} of 2" in got["mismatch"]
        assert got["target"].startswith("grpc://127.0.0.1:")
        assert got["initialized_after"] is False


def _files(tmp_path):
    paths, start = [], 0
    for i, rows in enumerate([5, 3, 6, 2]):
        paths.append(str(tmp_path / f"part{i}.npy"))
        np.save(paths[-1], np.arange(start, start + rows, dtype=np.float32))
        start += rows
    return paths


@pytest.mark.parametrize("policy", ["FILE", "AUTO"])
def test_a_file_dataset_is_split_by_file_and_every_example_is_seen_once(tmp_path, policy):
    paths = _files(tmp_path)
    results = _launch("file_sharded", 2, 2, tuple(paths), policy)
    steps = results[0]["steps"]
    for a, b in zip(steps, results[1]["steps"]):
        np.testing.assert_array_equal(a, b)
    # Worker 0 reads files 0 and 2 (11 rows), worker 1 files 1 and 3 (5 rows: 5-7, 14, 15), 2 per
    # replica and step: 3 steps; worker 1 runs out in the second.
    np.testing.assert_array_equal(np.sort(np.concatenate(steps)), np.arange(16.0))
    assert len(steps) == 3
    np.testing.assert_array_equal(steps[0], [0, 1, 2, 3, 5, 6, 7, 14])
    assert results[0]["totals"] == [float(s.sum()) for s in steps]


def test_a_file_dataset_on_one_process_is_plain_global_batches(tmp_path):
    got = scenarios.file_sharded(one_process(4), _files(tmp_path), "FILE")
    assert [s.tolist() for s in got["steps"]] == [list(range(8)), list(range(8, 16))]
    assert got["totals"] == [28.0, 92.0]


@pytest.mark.parametrize("workers,devices", LAYOUTS)
def test_values_workers_give_differently_take_the_chiefs_as_tf(workers, devices):
    # TF broadcasts a variable's initial value from the chief; a worker's own (an unseeded
    # random initialization) would otherwise silently train different replicas.
    for got in _launch("placed_values", workers, devices):
        np.testing.assert_array_equal(got["differs"], np.zeros(3))
        np.testing.assert_array_equal(got["same"], np.arange(3.0))
        np.testing.assert_array_equal(got["a"], [10.0, 10.0])
        assert got["b"].tolist() == [0, 1] and got["b"].dtype == np.int32
        np.testing.assert_array_equal(got["total"], np.zeros(3))  # every replica holds 0s
        assert got["scalar"] == 1.5  # the chief's number
        assert got["scalar_weak"] and got["scalar_times_bf16"] == "bfloat16"  # as one process
        # A host value of each worker (1.0 + its index), reduced across the workers as TF.
        hosts = [1.0 + w for w in range(workers)]
        reduced = got["reduced"]
        assert reduced["mean"] == reduced["mean_to"] == np.mean(hosts)
        assert reduced["sum_axis"] == devices * 3 * sum(hosts)  # each replica sums [v, 2v]
        if devices == 1:  # TF's case: one replica per worker, 2 workers of 1.0 give 2.0
            assert reduced["sum"] == reduced["sum_to"] == sum(hosts)
        else:  # copies on this worker's replicas: refused, as on one worker
            assert "cannot be reduced" in reduced["sum"] and "2 replicas" in reduced["sum"]
