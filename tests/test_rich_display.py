"""Jupyter's rich display (``_repr_html_``): a small per-device table for distributed values and
variables, a property table for strategies; ``repr`` stays short and a display never raises."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmirror as jm
from jaxmirror.core import rich_display


def _rows(html: str) -> list[list[str]]:
    """The body rows of the table, as lists of cell texts (HTML entities left escaped)."""
    body = re.search(r"<tbody>(.*)</tbody>", html).group(1)
    return [re.findall(r"<td>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", body)]


@pytest.fixture(scope="module")
def strategy():
    return jm.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])


def test_per_replica_shows_each_component_on_its_device(strategy):
    v = strategy.experimental_distribute_values_from_function(
        lambda ctx: jnp.arange(8.0) * 0 + ctx.replica_id_in_sync_group)
    rows = _rows(v._repr_html_())
    assert [r[:4] for r in rows] == [[str(i), f"CPU:{i}", "(8,)", "float32"] for i in range(3)]
    assert rows[2][4] == "[2.0, 2.0, 2.0, 2.0, 2.0, 2.0, …] (8 values)"  # the first values only
    assert "\n" not in repr(v).split("{")[0]


def test_a_partial_batch_shows_each_replicas_real_rows(strategy):
    # 7 rows over 3 replicas: TF's split gives 3, 2, 2; the table shows what each replica got.
    data = np.arange(14.0, dtype=np.float32).reshape(7, 2)
    batch = next(iter(strategy.experimental_distribute_dataset([data])))
    rows = _rows(batch._repr_html_())
    assert [r[2] for r in rows] == ["(3, 2)", "(2, 2)", "(2, 2)"]
    assert rows[1][4] == "[6.0, 7.0, 8.0, 9.0]"


def test_mirrored_value_and_variables(strategy):
    mirrored = jm.Mirrored(strategy.extended.placement.replicate(jnp.float32(4.0)))
    assert [r[1:] for r in _rows(mirrored._repr_html_())] == [
        [f"CPU:{i}", "()", "float32", "4.0"] for i in range(3)]
    with strategy.scope():
        w = jm.Variable(jnp.array([1.5, -2.0]), name="w<1>")
        s = jm.Variable(0.0, synchronization=jm.VariableSynchronization.ON_READ,
                        aggregation=jm.VariableAggregation.SUM)
    html = w._repr_html_()
    assert "MirroredVariable &#x27;w&lt;1&gt;&#x27;" in html  # names are escaped
    assert _rows(html) == [[f"CPU:{i}", "(2,)", "float32", "[1.5, -2.0]"] for i in range(3)]
    assert "a copy on each of 3 devices" in html

    def add():
        s.assign_add(jnp.float32(jm.get_replica_context().replica_id_in_sync_group))
    strategy.run(add)
    rows = _rows(s._repr_html_())  # sync-on-read: each replica's own component
    assert [(r[0], r[1], r[4]) for r in rows] == [("0", "CPU:0", "0.0"), ("1", "CPU:1", "1.0"),
                                                   ("2", "CPU:2", "2.0")]
    assert repr(w).startswith("MirroredVariable:{") and "_repr_html_" not in repr(w)


def test_plain_central_storage_and_sharded_variables():
    plain = jm.Variable(3.0, name="p")
    assert _rows(plain._repr_html_()) == [["CPU:0", "()", "float32", "3.0"]]
    central = jm.experimental.CentralStorageStrategy(["CPU:0", "CPU:1"])
    with central.scope():
        c = jm.Variable(jnp.ones(2))
    assert len(_rows(c._repr_html_())) == 1  # one copy, on the parameter device
    sharded = jm.experimental.ShardedVariable(
        [jm.Variable(jnp.arange(3.0)), jm.Variable(jnp.arange(3.0, 5.0))], name="emb")
    assert [r[:2] + r[3:] for r in _rows(sharded._repr_html_())] == [
        ["0", "0:3", "(3,)", "[0.0, 1.0, 2.0]"], ["1", "3:5", "(2,)", "[3.0, 4.0]"]]


def test_strategies_show_devices_mesh_workers_and_cross_device_ops(strategy):
    props = dict(_rows(strategy._repr_html_()))
    assert props == {"replicas in sync": "3", "devices": "CPU:0, CPU:1, CPU:2",
                     "mesh": "replica: 3", "workers": "1",
                     "variables": "a copy on every replica&#x27;s device",
                     "cross-device ops": "NcclAllReduce(num_packs=0, pack_leaves_under=65536)"}
    hier = jm.MirroredStrategy(["CPU:0", "CPU:1"],
                               cross_device_ops=jm.HierarchicalCopyAllReduce(num_packs=2))
    assert dict(_rows(hier._repr_html_()))["cross-device ops"] == \
        "HierarchicalCopyAllReduce(num_packs=2)"
    central = dict(_rows(jm.experimental.CentralStorageStrategy(["CPU:0", "CPU:1"])._repr_html_()))
    assert central["variables"] == "on CPU:0 (central storage)"
    assert dict(_rows(jm.OneDeviceStrategy("CPU:1")._repr_html_()))["devices"] == "CPU:1"
    assert dict(_rows(jm.MultiWorkerMirroredStrategy()._repr_html_()))["workers"] == "1"
    assert repr(strategy) == "<MirroredStrategy with 3 replica(s)>"


def test_many_devices_are_cut_short_and_a_traced_value_says_so():
    assert rich_display.device_list(jax.devices()[:8], limit=2) == \
        "CPU:0, CPU:1, … (8 devices)"
    seen = []

    @jax.jit
    def f(x):
        seen.append(rich_display.preview(x))
        return x
    f(jnp.ones(2))
    assert seen == ["(traced: no values until the step runs)"]


def test_a_display_that_fails_falls_back_to_repr():
    class Broken(jm.PerReplica):
        def display_rows(self):
            raise RuntimeError("boom")
    broken = Broken(jnp.zeros((2, 1)))
    assert broken._repr_html_() is None  # Jupyter then shows repr()


def test_a_donated_value_says_so_and_only_the_shown_values_are_read(strategy):
    v = strategy.experimental_distribute_values_from_function(lambda ctx: jnp.ones(3))
    strategy.function(lambda x: x + 1, donate_argnums=(0,))(v)
    assert "deleted: donated to a step" in v._repr_html_() and "deleted" in repr(v)
    big = strategy.extended.placement.replicate(jnp.arange(10_000.0))
    assert rich_display.preview(big) == "[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, …] (10000 values)"


def test_datasets_and_iterators_print_their_public_names(strategy):
    ds = strategy.experimental_distribute_dataset([np.ones((3, 1), np.float32)])
    assert repr(ds) == ("<DistributedDataset from experimental_distribute_dataset over "
                        "3 replica(s)>")
    assert repr(iter(ds)) == f"<DistributedIterator over {ds!r}>"
