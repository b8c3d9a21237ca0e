"""A distributed iterator saved in a checkpoint (issue 28): the restored iterator continues
after the elements given before the save, as TF's ``tf.data`` iterators in a
``tf.train.Checkpoint`` do, so a resumed run sees every example once. In one process here;
across workers in ``tests/test_preemption.py``.
"""

import numpy as np
import pytest

import jaxmirror as jm
from conftest import strategy

GLOBAL = 6


def _batches(n=7, last=4):
    rows = [GLOBAL] * (n - 1) + [last]
    start = np.cumsum([0] + rows)
    return [{"x": np.arange(a, a + r, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32),
             "id": np.arange(a, a + r, dtype=np.int32)} for a, r in zip(start, rows)]


def _ids(s, element):
    return [int(i) for c in s.experimental_local_results(element["id"]) for i in np.asarray(c)]


def _rest(s, it):
    return [_ids(s, e) for e in it]


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("taken", [0, 1, 3, 6, 7])
def test_a_restored_iterator_continues_after_the_saved_position(tmp_path, prefetch, taken):
    s = strategy(4)
    options = jm.InputOptions(prefetch_thread=prefetch)
    data = _batches()
    it = iter(s.experimental_distribute_dataset(data, options))
    for _ in range(taken):
        next(it)
    jm.checkpoint.save(tmp_path / "ck", {"iterator": it})
    expected = _rest(s, it)
    fresh = iter(s.experimental_distribute_dataset(data, options))
    next(fresh)  # a position of its own, replaced by the restore
    out = jm.checkpoint.restore(tmp_path / "ck", {"iterator": fresh})
    assert out["iterator"] is fresh
    got = _rest(s, fresh)
    assert got == expected
    assert sorted(i for e in got for i in e) == list(range(taken * GLOBAL, 6 * GLOBAL + 4))


def test_the_restored_pass_keeps_the_padded_size_of_the_batches_before(tmp_path):
    # Saved just before the short last batch: it is padded to the full batches' size, as in
    # the uninterrupted pass, so the step keeps its compiled program and its exact numbers.
    s = strategy(4)
    it = iter(s.experimental_distribute_dataset(_batches()))
    for _ in range(6):
        next(it)
    jm.checkpoint.save(tmp_path / "ck", {"iterator": it})
    last = next(it)
    fresh = iter(s.experimental_distribute_dataset(_batches()))
    jm.checkpoint.restore(tmp_path / "ck", {"iterator": fresh})
    again = next(fresh)
    assert [c.shape for c in s.experimental_local_results(again["x"])] == \
        [c.shape for c in s.experimental_local_results(last["x"])]
    assert s.experimental_local_results(again["x"])[0].shape[0] > 0


def test_fused_steps_count_the_elements_they_take(tmp_path):
    s = strategy(2)
    data = _batches()
    it = iter(s.experimental_distribute_dataset(data))
    fused = s.function(lambda b: b["id"].sum(), steps_per_execution=3)
    fused(it)
    assert int(it.checkpoint_state()[1]) == 3
    jm.checkpoint.save(tmp_path / "ck", {"iterator": it})
    fresh = iter(s.experimental_distribute_dataset(data))
    jm.checkpoint.restore(tmp_path / "ck", {"iterator": fresh})
    assert _ids(s, next(fresh)) == list(range(18, 24))


def test_drop_remainder_and_a_function_dataset_and_grain(tmp_path):
    import grain

    s = strategy(2)
    sources = {
        "dropped": (_batches(), jm.InputOptions(drop_remainder=True)),
        "function": (lambda: iter(_batches()), None),
        "grain": (grain.MapDataset.source(np.arange(40, dtype=np.int32)).batch(GLOBAL), None),
    }
    for name, (source, options) in sources.items():
        it = iter(s.experimental_distribute_dataset(source, options))
        first = [next(it) for _ in range(2)]
        del first
        jm.checkpoint.save(tmp_path / name, {"iterator": it})
        expected = [[int(i) for c in s.experimental_local_results(e) for i in
                     np.asarray(c["id"] if isinstance(e, dict) else c).ravel()] for e in it]
        fresh = iter(s.experimental_distribute_dataset(source, options))
        jm.checkpoint.restore(tmp_path / name, {"iterator": fresh})
        got = [[int(i) for c in s.experimental_local_results(e) for i in
                np.asarray(c["id"] if isinstance(e, dict) else c).ravel()] for e in fresh]
        assert got == expected and got, name


def test_an_iterator_of_per_replica_pipelines_restores_only_onto_as_many(tmp_path):
    per_replica = jm.InputOptions(
        experimental_replication_mode=jm.InputReplicationMode.PER_REPLICA)

    def dataset_fn(ctx):
        return [np.full((2, 1), 10 * step + ctx.input_pipeline_id, np.float32)
                for step in range(4)]

    s2 = strategy(2)
    it = iter(s2.distribute_datasets_from_function(dataset_fn, per_replica))
    next(it)
    assert it.checkpoint_state().tolist() == [1, 1, 2, 1]
    jm.checkpoint.save(tmp_path / "ck", {"iterator": it, "v": 1.0})
    same = iter(s2.distribute_datasets_from_function(dataset_fn, per_replica))
    jm.checkpoint.restore(tmp_path / "ck", {"iterator": same, "v": 0.0})
    assert [float(np.asarray(c)[0, 0]) for c in s2.experimental_local_results(next(same))] == \
        [10.0, 11.0]
    s4 = strategy(4)
    other = iter(s4.distribute_datasets_from_function(dataset_fn, per_replica))
    with s4.scope():
        v = jm.Variable(5.0)
    with pytest.raises(ValueError, match="saved with 2 input pipelines.*this dataset has 4"):
        jm.checkpoint.restore(tmp_path / "ck", {"iterator": other, "v": v})
    assert float(v.numpy()) == 5.0  # nothing assigned
    assert float(np.asarray(s4.experimental_local_results(next(other))[3])[0, 0]) == 3.0


def test_an_argument_taken_for_a_call_that_did_not_run_is_given_again(tmp_path):
    from jaxmirror.data.iterators import elements_not_used

    s = strategy(2)
    it = iter(s.experimental_distribute_dataset(_batches()))
    next(it)
    pending = next(it)
    with elements_not_used([s.run, (pending,)]):
        jm.checkpoint.save(tmp_path / "ck", {"iterator": it})
    assert int(it.checkpoint_state()[1]) == 2  # outside, the element counts as given
    fresh = iter(s.experimental_distribute_dataset(_batches()))
    jm.checkpoint.restore(tmp_path / "ck", {"iterator": fresh})
    assert _ids(s, next(fresh)) == _ids(s, pending)


def test_a_bad_saved_value_is_refused_before_anything_is_assigned(tmp_path):
    s = strategy(2)
    with s.scope():
        v = jm.Variable(1.0)
    jm.checkpoint.save(tmp_path / "ck", {"iterator": np.array([7, 0, 0, 0], np.int64), "v": 2.0})
    it = iter(s.experimental_distribute_dataset(_batches()))
    with pytest.raises(ValueError, match="not a position"):
        jm.checkpoint.restore(tmp_path / "ck", {"iterator": it, "v": v})
    assert float(v.numpy()) == 1.0
    assert _ids(s, next(it)) == list(range(GLOBAL))


def _epoch_loop(s, ds, start_total, steps_per_epoch, epochs, stop_at=None):
    """TF's loop: an iterator per epoch, steps counted from the total; returns the ids seen
    per (epoch, step), and the total where it stopped."""
    seen, total = {}, start_total
    for epoch in range(total // steps_per_epoch, epochs):
        iterator = iter(ds)
        for step in range(total % steps_per_epoch, steps_per_epoch):
            if total == stop_at:
                return seen, total
            seen[epoch, step] = _ids(s, next(iterator))
            total += 1
    return seen, total


@pytest.mark.parametrize("stop_at", [3, 7, 14])  # mid-epoch, at an epoch's end, the last one
def test_a_dataset_in_the_checkpoint_resumes_tfs_loop_with_an_iterator_per_epoch(tmp_path,
                                                                                  stop_at):
    s = strategy(2)
    data = _batches(7, GLOBAL)
    ds = s.experimental_distribute_dataset(data)
    first, total = _epoch_loop(s, ds, 0, 7, 3, stop_at)
    assert total == stop_at
    jm.checkpoint.save(tmp_path / "ck", {"data": ds, "total": total})
    fresh = s.experimental_distribute_dataset(data)
    total = jm.checkpoint.restore(tmp_path / "ck", {"data": fresh, "total": 0})["total"]
    rest, end = _epoch_loop(s, fresh, total, 7, 3)
    assert end == 21 and not set(first) & set(rest)
    uninterrupted, _ = _epoch_loop(s, s.experimental_distribute_dataset(data), 0, 7, 3)
    assert {**first, **rest} == uninterrupted  # every example once per epoch, in order


def test_an_iterator_of_an_earlier_pass_is_refused_when_saved(tmp_path):
    s = strategy(2)
    ds = s.experimental_distribute_dataset(_batches())
    old = iter(ds)
    next(old)
    iter(ds)  # the next epoch's iterator, made by TF's per-epoch loop
    with pytest.raises(ValueError, match="not the latest pass over its dataset.*put the "
                                         "distributed dataset itself in the checkpoint"):
        jm.checkpoint.save(tmp_path / "ck", {"iterator": old})
    assert not (tmp_path / "ck").exists()


def test_a_one_shot_dataset_is_refused_when_saved(tmp_path):
    s = strategy(2)
    it = iter(s.experimental_distribute_dataset(iter(_batches())))
    next(it)
    with pytest.raises(ValueError, match="one-shot iterator.*cannot read again"):
        jm.checkpoint.save(tmp_path / "ck", {"iterator": it})
    assert not (tmp_path / "ck").exists()
