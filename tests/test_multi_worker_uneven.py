"""Workers with different amounts of data (issue 27): every worker's ``next()`` agrees with the
others on each replica's rows and on whether any worker still has data, so training over
uneven data equals one-process training on the same examples, and the epoch ends on every worker
at the same step (TF's distributed iterator does the same with an all-reduce).

Workers are started by ``jaxmirror.launch.run`` on loopback (2 workers x 2 CPU devices, 4 x 1);
the reference trains a 4-device ``MirroredStrategy`` of this process on the rows each step gave
the workers' replicas together, and runs flax's BatchNorm on one device over them.
"""

import functools

import numpy as np
import pytest

import jaxmirror as jm
import multi_worker_scenarios as scenarios
from conftest import strategy as one_process

TIMEOUT = 240


@functools.lru_cache(maxsize=None)
def _launch(workers, devices, *args):
    results = jm.launch.run(scenarios.in_worker, workers=workers, devices_per_worker=devices,
                            args=("uneven",) + args, timeout=TIMEOUT)
    assert [index for index, _ in results] == list(range(workers))
    return [result for _, result in results]


def _reference(results, fused=False):
    """One process trained on each step's rows of every worker together."""
    steps = max(len(r["kept"]) for r in results)
    batches = []
    for k in range(steps):
        parts = [r["kept"][k] for r in results]
        batches.append((np.concatenate([x for x, _ in parts]),
                        np.concatenate([y for _, y in parts])))
    s = one_process(4)
    return scenarios.train_variables(s, s.experimental_distribute_dataset(batches), fused), batches


def _check(results, counts, fused=False, rows_per_step=8):
    """``rows_per_step``: how many of a worker's rows one step takes (a global batch, or
    per-replica batches of 2 rows for each of its replicas)."""
    want, batches = _reference(results, fused)
    # The epoch lasts as long as the longest worker's data, and not a step more.
    steps = max(c * 8 // rows_per_step for c in counts)
    assert len(batches) == steps
    assert all(len(b[0]) > 0 for b in batches)
    for got in results:
        assert len(got["kept"]) == steps
        np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5, atol=1e-7)
        for name in want["params"]:
            np.testing.assert_allclose(got["params"][name], want["params"][name], rtol=1e-5,
                                       atol=1e-6, err_msg=name)
        assert got["accuracy"] == want["accuracy"]  # counts: exact
        assert got["evaluation"] == 40.0  # 4 replicas x (1 + 2 + 3 + 4), after the epoch
    mean, var = scenarios.batch_norm_reference(batches)
    for got in results:  # SyncBatchNorm's statistics of the real rows: one device's
        np.testing.assert_allclose(got["batch_norm"][0], mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["batch_norm"][1], var, rtol=1e-5, atol=1e-6)
    # Every example of every worker was seen exactly once.
    seen = np.sort(np.concatenate([x for x, _ in batches]).ravel())
    data = [scenarios.worker_batches(w, c) for w, c in enumerate(counts)]
    return seen, data


@pytest.mark.parametrize("workers,devices,counts", [
    (2, 2, (3, 4)), (4, 1, (3, 4, 2, 4)), (2, 2, (0, 4)), (4, 1, (4, 0, 4, 1))])
def test_a_dataset_with_uneven_workers_trains_as_one_process(workers, devices, counts):
    results = _launch(workers, devices, counts)
    _check(results, counts)
    # DATA sharding: worker w kept its replicas' rows of its own batches.
    local = 4 // workers
    for w, got in enumerate(results):
        for k, (x, _) in enumerate(got["kept"]):
            if k < counts[w]:
                own = scenarios.worker_batches(w, counts[w])[k][0]
                np.testing.assert_array_equal(x, own[2 * local * w:2 * local * (w + 1)])
            else:
                assert x.shape == (0, 6)  # this worker's data has ended: zero rows


@pytest.mark.parametrize("workers,devices,counts", [(2, 2, (3, 4)), (4, 1, (2, 0, 3, 1))])
def test_datasets_from_function_with_uneven_workers_see_every_row_once(workers, devices, counts):
    results = _launch(workers, devices, counts, "function")
    seen, data = _check(results, counts, rows_per_step=2 * devices)
    want = np.sort(np.concatenate([x for batches in data for x, _ in batches]).ravel())
    np.testing.assert_array_equal(seen, want)


def test_fused_steps_over_uneven_workers_equal_one_process():
    counts = (3, 4)
    results = _launch(2, 2, counts, "dataset", True)
    _check(results, counts, fused=True)
    assert len(results[0]["losses"]) == 4
