"""The life of a distributed iterator: early errors, element_spec, closing, donation, exit."""

import subprocess
import sys
import textwrap
import threading
import time

import jax
import numpy as np
import pytest

import jaxmirror
from conftest import strategy


THREAD = jaxmirror.InputOptions(prefetch_thread=True)


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "jaxmirror-prefetch"]


@pytest.mark.parametrize("choice, threads", [(None, 0), (False, 0), (True, 1)])
def test_the_prefetch_thread_is_on_only_where_it_helps(choice, threads):
    """CPU devices: batches are made in next() unless asked (the thread only competes for cores)."""
    s = strategy(2)
    before = len(prefetch_threads())
    options = jaxmirror.InputOptions(prefetch_thread=choice)
    it = iter(s.experimental_distribute_dataset([np.arange(4.0)] * 3, options))
    assert len(prefetch_threads()) - before == threads
    assert [np.asarray(s.gather(b, axis=0)).tolist() for b in it] == [[0.0, 1.0, 2.0, 3.0]] * 3
    it.close()
    with pytest.raises(ValueError, match="prefetch_thread"):
        jaxmirror.InputOptions(prefetch_thread="yes")


def test_a_bad_first_batch_raises_when_the_iterator_is_made():
    s = strategy(2)
    ds = s.experimental_distribute_dataset([np.float32(1.0)])
    with pytest.raises(ValueError, match="unbatched"):
        iter(ds)


def test_element_spec_right_after_iter_of_a_one_shot_source_loses_nothing():
    s = strategy(2)
    batches = [np.arange(4.0, dtype=np.float32) + 10 * k for k in range(3)]
    it = iter(s.experimental_distribute_dataset(iter(batches)))
    assert it.element_spec == jax.ShapeDtypeStruct((2,), np.float32)
    got = [np.concatenate([np.asarray(c) for c in s.experimental_local_results(b)]) for b in it]
    np.testing.assert_array_equal(np.stack(got), np.stack(batches))


def test_a_generator_function_is_started_once_per_epoch():
    s = strategy(2)
    starts = []

    def batches():
        starts.append(1)
        yield np.zeros(2, np.float32)

    it = iter(s.experimental_distribute_dataset(batches))
    assert it.element_spec.shape == (1,)
    assert len(list(it)) == 1 and len(starts) == 1


def test_close_from_another_thread_ends_a_waiting_next():
    s = strategy(2)
    release = threading.Event()

    def slow():
        yield np.zeros(2, np.float32)
        release.wait(10)  # the second batch never comes while the consumer waits
        yield np.zeros(2, np.float32)

    it = iter(s.experimental_distribute_dataset(slow, THREAD))
    next(it)
    threading.Timer(0.2, it.close).start()
    start = time.monotonic()
    with pytest.raises(StopIteration):
        next(it)
    assert time.monotonic() - start < 5
    release.set()


def test_donating_a_padded_batch_is_refused_and_changes_nothing():
    s = strategy(2)
    x = np.arange(6.0, dtype=np.float32).reshape(3, 2)
    el = next(iter(s.experimental_distribute_dataset([{"x": x, "y": x + 100}])))
    with pytest.raises(ValueError, match="argument 0, a batch from a distributed dataset"):
        s.run(lambda a, b: (a * 2, b), args=(el["x"], el["y"]),
              options=jaxmirror.RunOptions(donate_argnums=(0,)))
    parts = s.experimental_local_results(el)
    assert [np.asarray(p["y"]).tolist() for p in parts] == [[[100, 101], [102, 103]], [[104, 105]]]
    assert [np.asarray(p["x"]).tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5]]]
    # Donating params next to a padded batch is fine.
    def add_real_rows(w, b):
        return w + (b * jaxmirror.get_replica_context().batch_mask[:, None]).sum()

    step = s.function(add_real_rows, donate_argnums=0)
    w = jax.device_put(np.zeros(2, np.float32), s.extended.replicated_sharding)
    out = step(w, el["x"])
    assert [np.asarray(c).tolist() for c in s.experimental_local_results(out)] == [[6, 6], [9, 9]]


def test_row_counts_are_placed_once_per_pattern_and_leaf():
    s = strategy(2)
    batches = [(np.zeros(4, np.float32), np.ones(4, np.int32))] * 3 + [
        (np.zeros(3, np.float32), np.ones(3, np.int32))]
    els = list(s.experimental_distribute_dataset(batches))
    counts = [x.row_counts for x, _ in els]
    assert counts[0] is counts[1] is counts[2] and counts[3] is not counts[0]
    assert els[0][1].row_counts is not els[0][0].row_counts
    assert [np.asarray(c).tolist() for c in counts] == [[2, 2]] * 3 + [[2, 1]]


def test_donating_one_leaf_in_a_users_own_jit_spares_the_others():
    s = strategy(2)
    x = np.arange(3.0, dtype=np.float32)
    ds = s.experimental_distribute_dataset([(x, x + 10)] * 2)
    it = iter(ds)
    a, b = next(it)
    jax.jit(lambda v: (v.stacked * 2, v.row_counts + 1), donate_argnums=0)(a)  # counts too
    assert a.row_counts.is_deleted() and not b.row_counts.is_deleted()
    out = s.run(lambda v: v + 1, args=(b,))
    assert [np.asarray(c).tolist() for c in s.experimental_local_results(out)] == [[11, 12], [13]]
    a2, _ = next(it)  # the next batch gets fresh counts if the cached ones were donated away
    assert [np.asarray(c).tolist() for c in s.experimental_local_results(a2)] == [[0, 1], [2]]


@pytest.mark.parametrize("ending", ["break", "exit", "raise"])
def test_leaving_with_a_busy_prefetch_thread_exits_cleanly(ending):
    """A prefetch thread in the middle of a copy at interpreter exit used to abort (SIGABRT)."""
    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        import jaxmirror
        s = jaxmirror.MirroredStrategy([f"CPU:{{i}}" for i in range(4)])
        x = np.ones((4096, 1024), np.float32)  # 16 MB: the thread is copying when we leave
        def forever():
            while True:
                yield x
        options = jaxmirror.InputOptions(experimental_per_replica_buffer_size=3,
                                         prefetch_thread=True)
        for batch in s.experimental_distribute_dataset(forever, options):
            break
        if "{ending}" == "exit":
            sys.exit(0)
        if "{ending}" == "raise":
            raise SystemExit(3)
    """)
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "PATH": "/usr/bin:/bin",
           "JAX_PLATFORMS": "cpu"}  # as conftest: the CPU platform also beside a CUDA jaxlib
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == (3 if ending == "raise" else 0), done.stderr[-2000:]
