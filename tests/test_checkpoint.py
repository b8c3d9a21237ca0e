"""``jaxmirror.checkpoint``: orbax checkpoints of variables and arrays (TF's rules for
variables and checkpoints: ON_READ saves the aggregate and SUM restores value / N; ON_WRITE saves component 0
and restores it everywhere; both interoperate with plain arrays and variables)."""

import collections
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxmirror as jm
from conftest import mirrored
from jaxmirror import checkpoint

Pair = collections.namedtuple("Pair", "kernel bias")


def rid():
    return jm.get_replica_context().replica_id_in_sync_group


def comps(v):
    """The variable's components (a OneDeviceStrategy's variables are plain: one component)."""
    values = v.values if isinstance(v, jm.DistributedValues) else (v.read_value(),)
    return [np.asarray(c).tolist() for c in values]


def sync_on_read(s, aggregation, per_replica=lambda i: i + 1.0):
    """A sync-on-read variable of ``s`` whose replica ``i`` holds ``per_replica(i)``."""
    with s.scope():
        v = jm.Variable(0.0, synchronization="on_read", aggregation=aggregation, trainable=False,
                        name=f"metric_{aggregation}")
    s.run(lambda: v.assign(per_replica(rid()), read_value=False))
    return v


def variable(s, value, **kwargs):
    if s is None:
        return jm.Variable(value, **kwargs)
    with s.scope():
        return jm.Variable(value, **kwargs)


@pytest.fixture(scope="module")
def s4():
    return mirrored(4)


@pytest.fixture(scope="module")
def s2():
    return jm.MirroredStrategy(["CPU:4", "CPU:5"])  # other devices than s4's


@pytest.fixture(scope="module")
def one():
    return jm.OneDeviceStrategy("CPU:6")


# -- ON_WRITE -------------------------------------------------------------------------------------
def test_mirrored_variable_on_4_replicas_restores_into_2_replicas(tmp_path, s4, s2):
    v = variable(s4, 3.0)
    checkpoint.save(tmp_path / "ck", {"v": v})
    target = variable(s2, 0.0)
    out = checkpoint.restore(tmp_path / "ck", {"v": target})
    assert out["v"] is target and isinstance(target, jm.MirroredVariable)
    assert comps(target) == [3.0, 3.0]
    assert {d for c in target.values for d in c.devices()} == set(s2.extended.devices)


def test_mirrored_variable_with_diverged_components_saves_component_0(tmp_path, s4):
    v = variable(s4, 0.0, aggregation="none")
    s4.run(lambda: v.assign(rid() * 10.0 + 1.0, read_value=False))
    assert comps(v) == [1.0, 11.0, 21.0, 31.0]
    checkpoint.save(tmp_path / "ck", {"v": v})
    w = variable(s4, 0.0, aggregation="none")
    checkpoint.restore(tmp_path / "ck", {"v": w})
    assert comps(w) == [1.0] * 4


# -- ON_READ --------------------------------------------------------------------------------------
def test_sync_on_read_sum_saves_the_sum_and_restores_value_over_n(tmp_path, s4, s2, one):
    v = sync_on_read(s4, "sum")
    assert comps(v) == [1.0, 2.0, 3.0, 4.0]
    assert float(checkpoint.to_saveable({"v": v})["v"]) == 10.0
    checkpoint.save(tmp_path / "ck", {"v": v})

    on2 = sync_on_read(s2, "sum", lambda i: i * 0.0)
    checkpoint.restore(tmp_path / "ck", {"v": on2})
    assert comps(on2) == [5.0, 5.0] and float(on2.numpy()) == 10.0

    on1 = sync_on_read(one, "sum", lambda i: i * 0.0)
    checkpoint.restore(tmp_path / "ck", {"v": on1})
    assert comps(on1) == [10.0] and float(on1.numpy()) == 10.0

    plain = variable(None, 0.0)
    assert float(checkpoint.restore(tmp_path / "ck", {"v": plain})["v"].numpy()) == 10.0

    arrays = checkpoint.restore(tmp_path / "ck", {"v": np.float32(0)})
    assert isinstance(arrays["v"], np.float32) and arrays["v"] == 10.0

    # And back: 4 replicas again, each holding a quarter.
    again = sync_on_read(s4, "sum", lambda i: i * 0.0)
    checkpoint.restore(tmp_path / "ck", {"v": again})
    assert comps(again) == [2.5] * 4 and float(again.numpy()) == 10.0


@pytest.mark.parametrize("aggregation,saved", [("mean", 2.5), ("only_first_replica", 1.0)])
def test_sync_on_read_mean_and_only_first_store_the_value_in_every_component(
        tmp_path, s4, s2, aggregation, saved):
    v = sync_on_read(s4, aggregation)
    checkpoint.save(tmp_path / "ck", {"v": v})
    assert float(checkpoint.restore(tmp_path / "ck", {"v": np.zeros((), np.float32)})["v"]) == saved
    on2 = sync_on_read(s2, aggregation, lambda i: i * 0.0)
    checkpoint.restore(tmp_path / "ck", {"v": on2})
    assert comps(on2) == [saved, saved] and float(on2.numpy()) == saved
    on4 = sync_on_read(s4, aggregation, lambda i: i * 0.0)
    checkpoint.restore(tmp_path / "ck", {"v": on4})
    assert comps(on4) == [saved] * 4


def test_sync_on_read_none_cannot_be_saved(tmp_path, s4):
    v = sync_on_read(s4, "none")
    with pytest.raises(ValueError, match=r"tree\['metrics'\]\[0\].*metric_none"):
        checkpoint.save(tmp_path / "ck", {"metrics": [v]})
    assert not os.path.exists(tmp_path / "ck")


def test_sync_on_read_none_can_be_restored_into(tmp_path, s2):
    checkpoint.save(tmp_path / "ck", {"v": 7.0})
    v = sync_on_read(s2, "none")
    checkpoint.restore(tmp_path / "ck", {"v": v})
    assert comps(v) == [7.0, 7.0]


# -- arrays and mixed trees -----------------------------------------------------------------------
def test_run_results_and_variables_restore_into_another_strategys_placement(tmp_path, s4, s2):
    params = jax.device_put({"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)},
                            s4.extended.replicated_sharding)
    params = s4.run(lambda p: jax.tree.map(lambda x: x * 2.0, p), args=(params,))
    assert params["w"].sharding == s4.extended.replicated_sharding  # a Mirrored result
    state = {"params": params, "count": sync_on_read(s4, "sum"), "step": 5,
             "pair": Pair(jm.Mirrored(params["b"]), np.arange(2, dtype=np.int32))}
    checkpoint.save(str(tmp_path / "ck"), state)

    rep2 = s2.extended.replicated_sharding
    count = sync_on_read(s2, "sum", lambda i: i * 0.0)
    target = {"params": {"w": jax.device_put(jnp.zeros((2, 3)), rep2),
                         "b": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=rep2)},
              "count": count, "step": 0,
              "pair": Pair(jm.Mirrored(jax.device_put(jnp.zeros(3), rep2)),
                           jax.ShapeDtypeStruct((2,), jnp.int32))}
    out = checkpoint.restore(tmp_path / "ck", target)

    assert out["params"]["w"].sharding == rep2 and out["params"]["b"].sharding == rep2
    np.testing.assert_array_equal(out["params"]["w"], np.arange(6.0).reshape(2, 3) * 2)
    np.testing.assert_array_equal(out["params"]["b"], [2.0, 2.0, 2.0])
    assert out["count"] is count and comps(count) == [5.0, 5.0]
    assert out["step"] == 5 and type(out["step"]) is int
    assert isinstance(out["pair"], Pair) and isinstance(out["pair"].kernel, jm.Mirrored)
    assert out["pair"].kernel.value.sharding == rep2 and out["pair"].kernel.num_replicas == 2
    assert isinstance(out["pair"].bias, np.ndarray) and out["pair"].bias.dtype == np.int32
    assert out["pair"].bias.tolist() == [0, 1]


def test_abstract_target_with_sharding_is_honoured(tmp_path, s4, s2):
    x = jax.device_put(jnp.arange(4.0), s4.extended.replicated_sharding)
    checkpoint.save(tmp_path / "ck", {"x": x})
    spec = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=s2.extended.replica_sharding)
    out = checkpoint.restore(tmp_path / "ck", {"x": spec})
    assert out["x"].sharding == s2.extended.replica_sharding
    assert out["x"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_four_replicas_to_plain_single_device_code_and_back(tmp_path, s4):
    mean = sync_on_read(s4, "mean")
    state = {"w": variable(s4, [1.0, 2.0]), "total": sync_on_read(s4, "sum"), "mean": mean}
    checkpoint.save(tmp_path / "four", state)

    # Plain single-device arrays (JAX's default device), as code without a strategy holds them.
    plain = {"w": jnp.zeros(2), "total": jnp.float32(0), "mean": jnp.float32(0)}
    restored = checkpoint.restore(tmp_path / "four", plain)
    assert restored["w"].tolist() == [1.0, 2.0]
    assert float(restored["total"]) == 10.0 and float(restored["mean"]) == 2.5
    assert restored["w"].sharding == plain["w"].sharding

    # Plain code trains on and saves; a 4-replica strategy picks it up.
    trained = jax.tree.map(lambda x: x + 1.0, restored)
    checkpoint.save(tmp_path / "plain", trained)
    back = {"w": variable(s4, [0.0, 0.0]), "total": sync_on_read(s4, "sum", lambda i: i * 0.0),
            "mean": sync_on_read(s4, "mean", lambda i: i * 0.0)}
    checkpoint.restore(tmp_path / "plain", back)
    assert comps(back["w"]) == [[2.0, 3.0]] * 4
    assert comps(back["total"]) == [2.75] * 4 and float(back["total"].numpy()) == 11.0
    assert comps(back["mean"]) == [3.5] * 4


def test_plain_variables_round_trip_into_distributed_ones(tmp_path, s4):
    checkpoint.save(tmp_path / "ck", {"w": variable(None, [[1.0, 2.0]]), "n": variable(None, 3)})
    w, n = variable(s4, [[0.0, 0.0]]), variable(s4, 0)
    out = checkpoint.restore(tmp_path / "ck", {"w": w, "n": n})
    assert out["w"] is w and comps(w) == [[[1.0, 2.0]]] * 4
    assert comps(n) == [3] * 4 and n.dtype == jnp.int32


def test_to_saveable_and_restore_into_with_an_orbax_checkpoint_manager(tmp_path, s4, s2):
    state = {"w": variable(s4, [1.0, 2.0]), "total": sync_on_read(s4, "sum")}
    saveable = checkpoint.to_saveable(state)
    assert saveable["w"].tolist() == [1.0, 2.0] and float(saveable["total"]) == 10.0
    with ocp.CheckpointManager(str(tmp_path / "run")) as manager:
        manager.save(1, args=ocp.args.StandardSave(saveable))
        manager.wait_until_finished()
        restored = manager.restore(1)
    w, total = variable(s2, [0.0, 0.0]), sync_on_read(s2, "sum", lambda i: i * 0.0)
    out = checkpoint.restore_into({"w": w, "total": total}, restored)
    assert out["w"] is w and comps(w) == [[1.0, 2.0]] * 2
    assert comps(total) == [5.0, 5.0]


def test_restore_into_copies_variables_across_strategies(s4, s2):
    src = {"w": variable(s4, [4.0]), "total": sync_on_read(s4, "sum")}
    dst = {"w": variable(s2, [0.0]), "total": sync_on_read(s2, "sum", lambda i: i * 0.0)}
    checkpoint.restore_into(dst, src)
    assert comps(dst["w"]) == [[4.0]] * 2 and comps(dst["total"]) == [5.0, 5.0]


def test_directory_may_be_relative(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    checkpoint.save("ck", {"x": np.arange(3)})
    assert checkpoint.restore("ck", {"x": np.zeros(3, np.int64)})["x"].tolist() == [0, 1, 2]


# -- errors ---------------------------------------------------------------------------------------
def test_existing_checkpoint_needs_force(tmp_path):
    checkpoint.save(tmp_path / "ck", {"x": 1.0})
    with pytest.raises(FileExistsError, match="already exists.*force=True"):
        checkpoint.save(tmp_path / "ck", {"x": 2.0})
    checkpoint.save(tmp_path / "ck", {"x": 2.0}, force=True)
    assert checkpoint.restore(tmp_path / "ck", {"x": 0.0}) == {"x": 2.0}


def test_empty_directory_is_used_and_other_directories_are_never_replaced(tmp_path):
    checkpoint.save(tmp_path, {"x": 1.0})  # pytest's tmp_path exists and is empty
    assert checkpoint.restore(tmp_path, {"x": 0.0}) == {"x": 1.0}
    other = tmp_path.parent / (tmp_path.name + "_other")
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="holds no orbax checkpoint"):
        checkpoint.save(other, {"x": 1.0}, force=True)
    assert (other / "notes.txt").read_text() == "keep me"


def test_per_replica_values_are_refused(tmp_path, s4):
    pr = s4.experimental_distribute_values_from_function(
        lambda c: float(c.replica_id_in_sync_group))
    with pytest.raises(ValueError, match=r"tree\['loss'\].*PerReplica.*[Rr]educe.*gather"):
        checkpoint.save(tmp_path / "ck", {"loss": pr})
    assert not os.path.exists(tmp_path / "ck")
    checkpoint.save(tmp_path / "ck", {"loss": 1.0})
    with pytest.raises(ValueError, match=r"tree\['loss'\].*PerReplica"):
        checkpoint.restore(tmp_path / "ck", {"loss": pr})


def test_structure_mismatch_names_the_leaves_and_assigns_nothing(tmp_path, s2):
    checkpoint.save(tmp_path / "ck", {"a": 1.0, "b": {"c": 2.0}})
    a = variable(s2, 0.0)
    with pytest.raises(ValueError, match=r"not in checkpoint: tree\['b'\]\['d'\].*"
                                         r"not in target: tree\['b'\]\['c'\]"):
        checkpoint.restore(tmp_path / "ck", {"a": a, "b": {"d": 0.0}})
    with pytest.raises(ValueError, match=r"in checkpoint but not in target: tree\['b'\]\['c'\]"):
        checkpoint.restore(tmp_path / "ck", {"a": a})
    assert comps(a) == [0.0, 0.0]
    with pytest.raises(ValueError, match="structure"):
        checkpoint.restore_into({"a": a}, {"a": 1.0, "z": 2.0})


def test_shape_mismatch_is_refused_before_any_assignment(tmp_path, s2):
    checkpoint.save(tmp_path / "ck", {"a": 1.0, "b": np.zeros(3, np.float32)})
    a, b = variable(s2, 0.0), variable(s2, np.zeros(2, np.float32))
    with pytest.raises(ValueError, match=r"tree\['b'\].*shape \(3,\).*target has shape \(2,\)"):
        checkpoint.restore(tmp_path / "ck", {"a": a, "b": b})
    assert comps(a) == [0.0, 0.0]
    with pytest.raises(ValueError, match=r"tree\['b'\].*shape"):
        checkpoint.restore(tmp_path / "ck", {"a": 0.0, "b": jnp.zeros(2)})


def test_a_failed_assignment_rolls_back_the_others(s2):
    a, n = variable(s2, 0.0), variable(s2, 0)
    with pytest.raises(TypeError, match="float32"):  # float into an int variable
        checkpoint.restore_into({"a": a, "n": n}, {"a": np.float32(1), "n": np.float32(2.5)})
    assert comps(a) == [0.0, 0.0] and comps(n) == [0, 0]


def test_bad_arguments(tmp_path, s2):
    with pytest.raises(TypeError, match="`directory` must be a str or os.PathLike, got int 3"):
        checkpoint.save(3, {"x": 1.0})
    with pytest.raises(TypeError, match="`force` must be a bool"):
        checkpoint.save(tmp_path / "ck", {"x": 1.0}, force="yes")
    with pytest.raises(TypeError, match=r"tree\['x'\].*str.*expected"):
        checkpoint.save(tmp_path / "ck", {"x": "text"})
    with pytest.raises(ValueError, match="no leaves"):
        checkpoint.save(tmp_path / "ck", {"x": {}})
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        checkpoint.restore(tmp_path / "missing", {"x": 0.0})
    with pytest.raises(ValueError, match="not an orbax checkpoint"):
        checkpoint.restore(tmp_path, {"x": 0.0})
    with ocp.PyTreeCheckpointer() as orbax_checkpointer:  # orbax itself saves strings
        orbax_checkpointer.save(tmp_path / "text", args=ocp.args.PyTreeSave({"x": "text"}))
    with pytest.raises(ValueError, match=r"tree\['x'\].*StringMetadata"):
        checkpoint.restore(tmp_path / "text", {"x": 0.0})
    checkpoint.save(tmp_path / "ck", {"x": 1.0})
    with pytest.raises(TypeError, match=r"tree\['x'\].*object"):
        checkpoint.restore(tmp_path / "ck", {"x": object()})
    with pytest.raises(RuntimeError, match="inside `run`"):
        s2.run(lambda: checkpoint.save(tmp_path / "in_run", {"x": 1.0}))
    with pytest.raises(ValueError, match="traced"):
        jax.jit(lambda x: checkpoint.to_saveable({"x": x}))(1.0)
