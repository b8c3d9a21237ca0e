"""Cross-device ops: what each implementation compiles to, that every cross-replica sum of a
strategy goes through its ops, packing, communication options, the bfloat16 wire, and the same
training under every ops (and CentralStorageStrategy) as on one device."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmirror as jm
from jaxmirror.experimental import CommunicationOptions

OPS = {
    "nccl": lambda: jm.NcclAllReduce(),
    "nccl-unpacked": lambda: jm.NcclAllReduce(num_packs=0),
    "nccl-3-packs": lambda: jm.NcclAllReduce(num_packs=3),
    "hierarchical": lambda: jm.HierarchicalCopyAllReduce(),
    "one-device": lambda: jm.ReductionToOneDevice(),
    "one-device-last": lambda: jm.ReductionToOneDevice(reduce_to_device="CPU:1"),
}


def _devices(n):
    return [f"CPU:{i}" for i in range(n)]


def _compiled(step, *args) -> str:
    return step.lower(*args).compile().as_text()


def _collectives(text: str) -> list:
    """The collectives XLA runs, in order (``-start`` forms counted once)."""
    return re.findall(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                      r"(?:-start)?\(", text)


def _replica_groups(line: str) -> list:
    """The replica groups of one collective in XLA's HLO text, in each of XLA's spellings:
    listed (``replica_groups={{0,1},{2,3}}``); an iota (``replica_groups=[2,2]<=[4]``:
    ``arange(4)`` reshaped to 2 groups of 2; ``[2,2]<=[2,2]T(1,0)``: transposed first); or, as
    JAX 0.11 emits a collective over whole mesh axes, the mesh and the axes it spans
    (``replica_groups=mesh['a'=2,'b'=4] {'b'}``: devices in mesh order, a group per ``a``)."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if mesh:
        axes = [(name, int(size)) for name, size in re.findall(r"'(\w+)'=(\d+)", mesh.group(1))]
        spanned = re.findall(r"'(\w+)'", mesh.group(2))
        ids = np.arange(int(np.prod([size for _, size in axes]))).reshape(
            [size for _, size in axes])
        kept = [i for i, (name, _) in enumerate(axes) if name not in spanned]
        ids = ids.transpose(kept + [i for i, (name, _) in enumerate(axes) if name in spanned])
        size = int(np.prod([size for name, size in axes if name in spanned]))
        return ids.reshape(-1, size).tolist()
    listed = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if listed:
        return [[int(i) for i in g.split(",") if i]
                for g in re.findall(r"\{([\d,]*)\}", listed.group(1))]
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    assert iota, f"no replica_groups in {line!r}"
    shape, dims = ([int(i) for i in g.split(",")] for g in iota.groups()[:2])
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if iota.group(3):
        ids = ids.transpose([int(i) for i in iota.group(3).split(",")])
    return ids.reshape(shape).tolist()


def test_replica_groups_are_read_in_each_of_xlas_spellings():
    assert _replica_groups("x = all-reduce(y), replica_groups={{0,1,2,3},{4,5,6,7}}") == [
        [0, 1, 2, 3], [4, 5, 6, 7]]
    assert _replica_groups("all-reduce(y), replica_groups=[1,8]<=[8], to_apply=") == [
        list(range(8))]
    assert _replica_groups("all-reduce(y), replica_groups=[4,2]<=[2,4]T(1,0)") == [
        [0, 4], [1, 5], [2, 6], [3, 7]]
    assert _replica_groups("all-reduce(y), replica_groups=mesh['replica'=8] {'replica'}, u") == [
        list(range(8))]
    assert _replica_groups("replica_groups=mesh['a'=2,'b'=4] {'b'}, x") == [
        [0, 1, 2, 3], [4, 5, 6, 7]]
    assert _replica_groups("replica_groups=mesh['a'=2,'b'=4] {'a'}, x") == [
        [0, 4], [1, 5], [2, 6], [3, 7]]


def _groups_of(text: str, op: str) -> list:
    """The replica groups of every ``op`` (``all-reduce``...) in the HLO text, one list each."""
    return [_replica_groups(line) for line in text.splitlines()
            if re.search(rf"\b{op}(-start)?\(", line)]


def _emitted(step, *args, op="all_reduce") -> int:
    """How many collectives of one kind the step's program emits (before XLA combines any)."""
    return step.lower(*args).as_text().count(f"stablehlo.{op}")


def _tree_step(strategy, reduce_op="sum", options=None):
    @strategy.function
    def step(x):
        ctx = jm.get_replica_context()
        scale = ctx.replica_id_in_sync_group + 1
        tree = {"a": x * scale, "b": (x[:3] * scale, jnp.ones((2, 2)) * scale),
                "c": jnp.int32(1) * scale, "d": jnp.float32(2.0) * scale}
        return ctx.all_reduce(reduce_op, tree, options=options)
    return step


# -- values ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("n", [2, 4, 8])
def test_all_reduce_of_a_nest_sums_every_leaf(name, n):
    s = jm.MirroredStrategy(_devices(n), cross_device_ops=OPS[name]())
    x = jnp.arange(7.0)
    total = n * (n + 1) // 2
    out = _tree_step(s)(x)
    np.testing.assert_allclose(out["a"], np.arange(7.0) * total, rtol=1e-6)
    np.testing.assert_allclose(out["b"][0], np.arange(3.0) * total, rtol=1e-6)
    np.testing.assert_allclose(out["b"][1], np.full((2, 2), total))
    assert out["c"].dtype == jnp.int32 and int(out["c"]) == total
    assert float(out["d"]) == 2.0 * total
    mean = _tree_step(s, "mean")(x)
    np.testing.assert_allclose(mean["a"], np.arange(7.0) * total / n, rtol=1e-6)
    assert mean["c"].dtype == jnp.float32 and float(mean["c"]) == pytest.approx(total / n)


# -- what each implementation compiles to ----------------------------------------------------
def test_nccl_all_reduce_is_one_all_reduce_per_pack_and_dtype():
    s = jm.MirroredStrategy(_devices(8), cross_device_ops=jm.NcclAllReduce())
    text = _compiled(_tree_step(s), jnp.arange(7.0))
    assert set(_collectives(text)) == {"all-reduce"}
    assert _groups_of(text, "all-reduce") and all(
        groups == [list(range(8))] for groups in _groups_of(text, "all-reduce"))
    # one pack of float32 leaves, one of int32
    assert _emitted(_tree_step(s), jnp.arange(7.0)) == 2


@pytest.mark.parametrize("num_packs,expected", [(0, 5), (1, 2), (3, 4), (7, 8)])
def test_num_packs_sets_how_many_all_reduces(num_packs, expected):
    # 4 float32 leaves (7 + 3 + 4 + 1 = 15 floats) and one int32 leaf: num_packs float
    # packs + one int pack; 0 = every leaf on its own.
    s = jm.MirroredStrategy(_devices(4), cross_device_ops=jm.NcclAllReduce(num_packs=num_packs))
    assert _emitted(_tree_step(s), jnp.arange(7.0)) == expected


# The float32 leaves hold 28, 12, 16 and 4 bytes (in flattening order), the int32 one 4.
@pytest.mark.parametrize("bytes_per_pack,floats", [(8, 4), (20, 3), (30, 2), (1 << 20, 1)])
def test_bytes_per_pack_groups_whole_leaves_into_packs_of_about_that_size(bytes_per_pack,
                                                                          floats):
    s = jm.MirroredStrategy(_devices(4))
    options = CommunicationOptions(bytes_per_pack=bytes_per_pack)
    step = _tree_step(s, options=options)
    assert _emitted(step, jnp.arange(7.0)) == floats + 1
    assert float(step(jnp.arange(7.0))["d"]) == 20.0


def test_hierarchical_reduces_within_groups_across_groups_and_gathers_back():
    s = jm.MirroredStrategy(_devices(8), cross_device_ops=jm.HierarchicalCopyAllReduce())
    text = _compiled(_tree_step(s), jnp.arange(7.0))
    groups = {op: _groups_of(text, op) for op in ("reduce-scatter", "all-reduce", "all-gather")}
    within, across = [[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["reduce-scatter"] and all(g == within for g in groups["reduce-scatter"])
    assert groups["all-reduce"] and all(g == across for g in groups["all-reduce"])
    assert groups["all-gather"] and all(g == within for g in groups["all-gather"])
    assert "collective-permute" not in _collectives(text)


def test_reduction_to_one_device_sends_to_it_and_broadcasts_back():
    s = jm.MirroredStrategy(_devices(8),
                            cross_device_ops=jm.ReductionToOneDevice(reduce_to_device="CPU:3"))

    @s.function
    def step(x):
        return jm.get_replica_context().all_reduce("sum", x)

    text = _compiled(step, jnp.arange(4.0))
    assert set(_collectives(text)) == {"collective-permute"}
    permutes = [[tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", group)]
                for group in re.findall(r"source_target_pairs=\{((?:\{\d+,\d+\},?)+)\}", text)]
    # 7 single sends into replica 3, then a doubling broadcast from it: 1, 2, 4 pairs.
    sends = [g[0] for g in permutes if len(g) == 1 and g[0][1] == 3]
    assert sorted(sends) == [(i, 3) for i in range(8) if i != 3]
    broadcast = [g for g in permutes if g not in [[p] for p in sends]]
    assert sorted(map(len, broadcast)) == [1, 2, 4]
    assert {dst for g in broadcast for _, dst in g} == set(range(8)) - {3}
    assert _emitted(step, jnp.arange(4.0), op="collective_permute") == 10
    assert step(jnp.arange(4.0)).tolist() == [0.0, 8.0, 16.0, 24.0]


def test_accumulation_fn_runs_on_the_reduction_device():
    seen = []

    def accumulate(values):
        seen.append(len(values))
        return sum(values) * 10  # visible in every result below

    ops = jm.ReductionToOneDevice(accumulation_fn=accumulate)
    s = jm.MirroredStrategy(_devices(4), cross_device_ops=ops)
    assert float(s.run(lambda: jm.get_replica_context().all_reduce("sum", 1.0))) == 40.0
    assert seen and set(seen) == {4}


# -- every cross-replica sum of the strategy goes through its ops -----------------------------
def _tenfold_strategy(n=4):
    """A strategy whose sums come out 10x: proof that a path went through its ops."""
    ops = jm.ReductionToOneDevice(accumulation_fn=lambda values: sum(values) * 10)
    return jm.MirroredStrategy(_devices(n), cross_device_ops=ops), ops


def test_reduce_reduce_to_batch_reduce_to_and_merge_fn_use_the_strategys_ops():
    s, ops = _tenfold_strategy()
    ids = s.run(lambda: jnp.float32(jm.get_replica_context().replica_id_in_sync_group + 1))
    assert float(s.reduce("sum", ids, axis=None)) == 100.0
    assert float(s.reduce("mean", ids, axis=None)) == 25.0
    assert float(s.extended.reduce_to("sum", ids, destinations="CPU:0")) == 100.0
    twice = jm.PerReplica(ids.stacked * 2)
    assert [float(v) for v in s.extended.batch_reduce_to("sum", [(ids, "CPU:0"),
                                                                  (twice, "CPU:1")])] == [
        100.0, 200.0]
    assert float(ops.reduce("sum", ids, destinations="CPU:2")) == 100.0
    assert [float(v) for v in ops.batch_reduce("mean", [(ids, "CPU:0")])] == [25.0]

    def merge_fn(strategy, value):
        return strategy.reduce("sum", value, axis=None)

    def step():
        ctx = jm.get_replica_context()
        return ctx.merge_call(merge_fn, args=(jnp.float32(ctx.replica_id_in_sync_group + 1),))

    assert float(s.run(step)) == 100.0


def test_reduce_with_an_axis_and_uneven_batches_uses_the_ops():
    s, _ = _tenfold_strategy(2)
    batch = next(iter(s.experimental_distribute_dataset([np.arange(3.0)])))  # rows 2 + 1
    assert float(s.reduce("sum", batch, axis=0)) == 30.0
    assert float(s.reduce("mean", batch, axis=0)) == pytest.approx(10.0)
    even = s.run(lambda: jnp.ones(3) * (jm.get_replica_context().replica_id_in_sync_group + 1))
    assert float(s.reduce("sum", even, axis=0)) == 90.0


def test_broadcast_places_at_the_destinations():
    ops = jm.NcclAllReduce()
    s = jm.MirroredStrategy(_devices(2), cross_device_ops=ops)
    with s.scope():
        v = jm.Variable(0.0)
    out = ops.broadcast(jnp.float32(3.0), v)
    assert out.sharding == s.extended.replicated_sharding and float(out) == 3.0
    assert set(ops.broadcast(1.0, "CPU:1").devices()) == {jax.devices()[1]}


def test_ops_used_by_no_strategy_say_so():
    with pytest.raises(ValueError, match="NcclAllReduce.reduce: no strategy uses"):
        jm.NcclAllReduce().reduce("sum", 1.0, "CPU:0")


def test_the_default_packs_small_leaves_and_leaves_big_ones_alone_within_one_process():
    s = jm.MirroredStrategy(_devices(4))
    ops = s.extended.cross_device_ops
    assert type(ops) is jm.NcclAllReduce
    assert (ops.num_packs, ops.pack_leaves_under) == (0, 65536)
    assert repr(ops) == "NcclAllReduce(num_packs=0, pack_leaves_under=65536)"
    # every leaf is small: one all-reduce per dtype (floats, ints), as XLA runs them
    step = _tree_step(s)
    assert _emitted(step, jnp.arange(7.0)) == 2
    assert _collectives(_compiled(step, jnp.arange(7.0))) == ["all-reduce"] * 2
    # a leaf of 64 KiB or more goes alone, never copied into a pack
    big = jnp.arange(16384.0)  # 64 KiB: "a"; x[:3] stays small
    assert _emitted(step, big) == 3
    packs = [line for line in step.lower(big).as_text().splitlines() if "concatenate" in line]
    assert len(packs) == 1 and packs[0].endswith("-> tensor<8xf32>")  # 3 + 4 + 1 floats
    out = step(big)
    want = {"a": big * 10, "b": (big[:3] * 10, jnp.ones((2, 2)) * 10), "c": 10, "d": 20.0}
    for got, expected in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_small_leaves_in_one_pack_sum_bit_for_bit_as_per_leaf_all_reduces():
    # the default's pack against NcclAllReduce(num_packs=0) (every leaf alone), same values
    rng = np.random.default_rng(0)
    leaves = [rng.standard_normal(shape).astype(np.float32)
              for shape in [(4, 7), (7,), (7, 3), (3,), (20000,)]]
    results = []
    for ops in (None, jm.NcclAllReduce(num_packs=0)):
        s = jm.MirroredStrategy(_devices(8), cross_device_ops=ops)

        @s.function
        def step(*xs):
            k = jm.get_replica_context().replica_id_in_sync_group
            return jm.get_replica_context().all_reduce(
                "sum", [x * (1.0 + 0.1 * k) / 3.0 for x in xs])
        results.append([np.asarray(x) for x in step(*leaves)])
    for packed, alone in zip(*results):
        np.testing.assert_array_equal(packed, alone)
    assert not np.array_equal(results[0][0], leaves[0] * 8)  # the replicas' scales counted


@pytest.mark.parametrize("n", [2, 8])
def test_default_ops_train_as_a_hand_written_per_leaf_psum_in_single_and_fused_steps(n):
    # The default packs the small leaves; the numbers stay those of a per-leaf lax.psum.
    rng = np.random.default_rng(1)
    params = {"w0": rng.standard_normal((8, 16)).astype(np.float32) / 3,
              "b0": np.zeros(16, np.float32), "w1": rng.standard_normal((16, 4)).astype(
                  np.float32) / 4, "b1": np.zeros(4, np.float32)}
    batches = [(rng.standard_normal((16, 8)).astype(np.float32),
                rng.integers(0, 4, 16).astype(np.int32)) for _ in range(6)]

    def loss_fn(p, x, y):
        logits = jnp.tanh(x @ p["w0"] + p["b0"]) @ p["w1"] + p["b1"]
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1)
        return -picked.sum() / 16

    def trained(k):
        s = jm.MirroredStrategy(_devices(n))
        with s.scope():
            v = {name: jm.Variable(value) for name, value in params.items()}

        def step_fn(batch):
            values = {name: var.read_value() for name, var in v.items()}
            loss, grads = jax.value_and_grad(loss_fn)(values, *batch)
            grads = jm.get_replica_context().all_reduce("sum", grads)
            for name, var in v.items():
                var.assign(values[name] - 0.5 * grads[name])
            return loss
        step = s.function(step_fn, steps_per_execution=k) if k else s.function(step_fn)
        it = iter(s.experimental_distribute_dataset(batches))
        losses = [np.asarray(s.reduce("sum", step(it) if k else step(next(it)), axis=None))
                  for _ in range(6 // (k or 1))]
        return np.concatenate([np.ravel(x) for x in losses]), {
            name: np.asarray(var.numpy()) for name, var in v.items()}

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("r",))
    P = jax.sharding.PartitionSpec

    def body(p, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        grads = {name: jax.lax.psum(g, "r") for name, g in grads.items()}  # leaf by leaf
        return {name: p[name] - 0.5 * grads[name] for name in p}, jax.lax.psum(loss, "r")

    hand = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("r"), P("r")),
                                 out_specs=(P(), P()), check_vma=False))
    p, hand_losses = params, []
    for x, y in batches:
        p, loss = hand(p, x, y)
        hand_losses.append(np.asarray(loss))
    for k in (None, 3):
        losses, final = trained(k)
        np.testing.assert_array_equal(losses, np.array(hand_losses))
        for name in params:
            np.testing.assert_array_equal(final[name], np.asarray(p[name]))
    assert not np.array_equal(np.asarray(p["w1"]), params["w1"])


# -- arguments --------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [jm.NcclAllReduce, jm.HierarchicalCopyAllReduce])
@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_bad_num_packs(cls, bad):
    with pytest.raises(ValueError, match="`num_packs` must be a non-negative int"):
        cls(num_packs=bad)
    with pytest.raises(ValueError, match=f"{cls.__name__}: `pack_leaves_under` must be a "
                                         f"non-negative int; got {bad!r}"):
        cls(num_packs=0, pack_leaves_under=bad)


def test_bad_reduction_device_and_accumulation_fn():
    with pytest.raises(ValueError, match="reduce_to_device"):
        jm.ReductionToOneDevice(reduce_to_device="TPU:9")
    with pytest.raises(ValueError, match="`accumulation_fn` must be callable"):
        jm.ReductionToOneDevice(accumulation_fn=3)
    with pytest.raises(ValueError, match="`reduce_to_device` 'CPU:5' .* runs no replica"):
        jm.MirroredStrategy(_devices(2),
                            cross_device_ops=jm.ReductionToOneDevice(reduce_to_device="CPU:5"))


def test_implementation_error_shows_what_was_given():
    with pytest.raises(ValueError, match="got 'foo'"):
        CommunicationOptions(implementation="foo")


def test_numpy_integers_are_accepted():
    assert jm.NcclAllReduce(num_packs=np.int64(2)).num_packs == 2
    assert CommunicationOptions(bytes_per_pack=np.int32(64)).bytes_per_pack == 64


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("wire", [None, "bfloat16"])
def test_zero_size_leaves(name, wire):
    s = jm.MirroredStrategy(_devices(4), cross_device_ops=OPS[name]())
    options = CommunicationOptions(wire_dtype=wire)

    @s.function
    def step(x):
        ctx = jm.get_replica_context()
        return ctx.all_reduce("sum", {"empty": jnp.zeros((0, 3)), "x": x,
                                      "empty_int": jnp.zeros((0,), jnp.int32)}, options=options)

    out = step(jnp.ones(2))
    assert out["empty"].shape == (0, 3) and out["empty_int"].shape == (0,)
    assert out["x"].tolist() == [4.0, 4.0]
    per_replica = s.run(lambda: jnp.zeros((0,)) + jm.get_replica_context().replica_id_in_sync_group)
    assert s.reduce("sum", per_replica, axis=None).shape == (0,)


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("n", [2, 4])
def test_booleans_sum_as_counts_under_every_ops(name, n):
    s = jm.MirroredStrategy(_devices(n), cross_device_ops=OPS[name]())
    out = s.run(lambda: jm.get_replica_context().all_reduce("sum", jnp.array([True, False])))
    assert out.dtype == jnp.int32 and out.tolist() == [n, 0]
    flags = s.run(lambda: jm.get_replica_context().replica_id_in_sync_group == 0)
    assert int(s.reduce("sum", flags, axis=None)) == 1


@pytest.mark.parametrize("name", ["nccl", "hierarchical", "one-device"])
def test_a_mean_that_fits_the_wire_does_not_overflow(name):
    s = jm.MirroredStrategy(_devices(8), cross_device_ops=OPS[name]())
    half = CommunicationOptions(wire_dtype="float16")
    out = s.run(lambda: jm.get_replica_context().all_reduce("mean", jnp.float32(1e4),
                                                           options=half))
    assert float(out) == 1e4


@pytest.mark.parametrize("name", ["nccl-unpacked", "one-device"])
def test_padded_rows_reaching_any_ops_warn(name):
    s = jm.MirroredStrategy(_devices(4), cross_device_ops=OPS[name]())
    batch = next(iter(s.experimental_distribute_dataset([np.arange(10.0)])))  # 3 3 2 2 rows
    with pytest.warns(jm.experimental.PaddedRowsWarning):
        s.run(lambda x: jm.get_replica_context().all_reduce("sum", jnp.sum(x)), args=(batch,))


@pytest.mark.parametrize("kwargs,arg", [
    ({"bytes_per_pack": -1}, "bytes_per_pack"), ({"bytes_per_pack": 1.5}, "bytes_per_pack"),
    ({"timeout_seconds": 0}, "timeout_seconds"), ({"implementation": "MPI"}, "implementation"),
    ({"wire_dtype": "int8"}, "wire_dtype"), ({"wire_dtype": "nope"}, "wire_dtype"),
    ({"wire_dtype": "float8_e4m3fn"}, "wire_dtype"), ({"wire_dtype": "float64"}, "wire_dtype"),
])
def test_bad_communication_options_name_the_argument(kwargs, arg):
    with pytest.raises(ValueError, match=f"`{arg}`"):
        CommunicationOptions(**kwargs)


def test_options_that_are_not_communication_options():
    s = jm.MirroredStrategy(_devices(2))
    with pytest.raises(ValueError, match="all_reduce: `options` must be"):
        s.run(lambda: jm.get_replica_context().all_reduce("sum", 1.0, options={"a": 1}))
    x = s.run(lambda: jm.get_replica_context().replica_id_in_sync_group)
    with pytest.raises(ValueError, match="reduce_to: `options` must be"):
        s.extended.reduce_to("sum", x, "CPU:0", options=4)
    with pytest.raises(ValueError, match="batch_reduce_to: `options` must be"):
        s.extended.batch_reduce_to("sum", [(x, "CPU:0")], options="fast")


def test_call_options_override_the_strategys():
    s = jm.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(bytes_per_pack=4))  # no cluster: local
    assert s.extended.communication_options.bytes_per_pack == 4
    step = _tree_step(s)
    assert _emitted(step, jnp.arange(7.0)) == 4 + 1  # every leaf its own pack
    wide = _tree_step(s, options=CommunicationOptions(bytes_per_pack=1 << 20))
    assert _emitted(wide, jnp.arange(7.0)) == 2
    merged = s.extended.options_for(CommunicationOptions(wire_dtype="bfloat16"), "all_reduce")
    assert merged.bytes_per_pack == 4 and merged.wire_dtype == jnp.bfloat16


# -- the bfloat16 wire ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["nccl", "hierarchical", "one-device"])
def test_bfloat16_wire_error_against_float32(name):
    n = 8
    s = jm.MirroredStrategy(_devices(n), cross_device_ops=OPS[name]())
    grads = np.random.default_rng(0).normal(size=(n, 1000)).astype(np.float32)
    per_replica = s.experimental_distribute_values_from_function(
        lambda ctx: jnp.asarray(grads[ctx.replica_id_in_sync_group]))
    wire = CommunicationOptions(wire_dtype="bfloat16")

    @s.function
    def step(g):
        ctx = jm.get_replica_context()
        return ctx.all_reduce("mean", g), ctx.all_reduce("mean", g, options=wire)

    exact, narrow = step(per_replica)
    assert narrow.dtype == jnp.float32
    want = grads.astype(np.float64).mean(0)
    np.testing.assert_allclose(exact, want, rtol=1e-5, atol=1e-6)
    # Each input is rounded to bfloat16 (8 significant bits: unit roundoff 2**-8) once, and the
    # mean once more: at most 2**-8 of the inputs' magnitude plus 2**-8 of the result's, per
    # element. A sum accumulated in bfloat16 would add a rounding per addition.
    scale = np.abs(grads).mean(0) + np.abs(want)
    error = np.abs(np.asarray(narrow) - want) / scale
    print(f"{name}: bfloat16 wire vs float32, error relative to the values' magnitude: "
          f"max {error.max():.2e}, mean {error.mean():.2e}")
    assert 0 < error.max() <= 2 ** -8 and error.mean() < 2 ** -10
    # What the step emits sends bfloat16 (XLA's CPU backend then widens collectives to float32;
    # GPUs send bfloat16), and never sums in it.
    emitted = [l for l in step.lower(per_replica).as_text().splitlines()
               if re.search(r"stablehlo\.(all_to_all|all_gather|collective_permute)", l)]
    assert emitted and any("bf16" in l for l in emitted)
    assert not any("stablehlo.all_reduce" in l and "bf16" in l
                   for l in step.lower(per_replica).as_text().splitlines())


# -- gradients through the collectives ---------------------------------------------------------
@pytest.mark.parametrize("name", ["hierarchical", "one-device", "nccl-3-packs"])
def test_gradients_through_all_reduce_match_the_default(name):
    def grads(strategy):
        @strategy.function
        def step(w):
            ctx = jm.get_replica_context()
            scale = ctx.replica_id_in_sync_group + 1.0

            def f(w):
                total = ctx.all_reduce("sum", {"u": w * scale, "v": w ** 2})
                return jnp.sum(total["u"] * total["v"])
            return ctx.all_reduce("sum", jax.grad(f)(w))
        return np.asarray(step(jnp.arange(1.0, 4.0)))

    base = grads(jm.MirroredStrategy(_devices(4)))
    np.testing.assert_allclose(
        grads(jm.MirroredStrategy(_devices(4), cross_device_ops=OPS[name]())), base, rtol=1e-6)


# -- the same training under every ops, and CentralStorageStrategy --------------------------------
def _data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 16, 5)).astype(np.float32)
    y = rng.normal(size=(3, 16, 2)).astype(np.float32)
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w1": jax.random.normal(k1, (5, 8)) * 0.3, "b1": jnp.zeros(8),
              "w2": jax.random.normal(k2, (8, 2)) * 0.3, "b2": jnp.zeros(2)}
    return x, y, params


def _per_example(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.sum((h @ params["w2"] + params["b2"] - y) ** 2, axis=-1)


def _single_device_training():
    x, y, params = _data()
    losses = []
    for i in range(3):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(_per_example(p, x[i], y[i])))(params)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, g)
        losses.append(float(loss))
    return params, losses


def _strategy_training(strategy):
    x, y, params = _data()
    params = strategy.experimental_replicate(params)

    @strategy.run
    def step(params, xb, yb):
        ctx = jm.get_replica_context()
        loss, g = jax.value_and_grad(
            lambda p: jm.compute_average_loss(_per_example(p, xb, yb)))(params)
        g = ctx.all_reduce("sum", g)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), loss

    dataset = strategy.experimental_distribute_dataset([(x[i], y[i]) for i in range(3)])
    losses = []
    for xb, yb in dataset:
        params, loss = step(params, xb, yb)
        losses.append(float(strategy.reduce("sum", loss, axis=None)))
    return params, losses


@pytest.mark.parametrize("name", ["nccl", "hierarchical", "one-device", "central"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_training_equals_single_device_training(name, n):
    if name == "central":
        strategy = jm.experimental.CentralStorageStrategy(_devices(n))
    else:
        strategy = jm.MirroredStrategy(_devices(n), cross_device_ops=OPS[name]())
    want_params, want_losses = _single_device_training()
    params, losses = _strategy_training(strategy)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for key in want_params:
        np.testing.assert_allclose(params[key], want_params[key], rtol=1e-5, atol=1e-6)
    if name == "central":  # the parameters stayed on the parameter device
        assert all(p.sharding == strategy.extended.placement.storage_sharding
                   for p in params.values())


# -- found in review ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["nccl", "hierarchical", "one-device"])
def test_a_mean_outside_a_step_is_divided_before_the_wire(name):
    s = jm.MirroredStrategy(_devices(4), cross_device_ops=OPS[name]())
    x = s.run(lambda: jnp.full((4,), 40000.0)
              + 0 * jm.get_replica_context().replica_id_in_sync_group)
    half = CommunicationOptions(wire_dtype="float16")
    assert s.extended.reduce_to("mean", x, "CPU:0", options=half).tolist() == [40000.0] * 4
    assert s.extended.batch_reduce_to("mean", [(x, "CPU:1")], options=half)[0].tolist() == [
        40000.0] * 4


def test_ops_shared_by_two_strategies_ask_which_one():
    ops = jm.NcclAllReduce()
    a = jm.MirroredStrategy(_devices(2), cross_device_ops=ops)
    with a.scope():
        v = jm.Variable(1.0)
    b = jm.MirroredStrategy(_devices(8), cross_device_ops=ops)
    with pytest.raises(ValueError, match="2 strategies use this CrossDeviceOps"):
        ops.reduce("sum", v, "CPU:0")
    with a.scope():
        assert float(ops.reduce("sum", v, "CPU:0")) == 2.0
    with b.scope():
        ids = b.run(lambda: jm.get_replica_context().replica_id_in_sync_group)
        assert int(ops.reduce("sum", ids, "CPU:0")) == 28


def test_a_merge_fn_reduces_a_per_replica_value_it_closed_over():
    s = jm.MirroredStrategy(_devices(4))
    captured = s.run(lambda: jnp.float32(jm.get_replica_context().replica_id_in_sync_group + 1))
    out = s.run(lambda: jm.get_replica_context().merge_call(
        lambda strategy: strategy.reduce("sum", captured, axis=None)))
    assert float(out) == 10.0


@pytest.mark.parametrize("dtype,want", [(jnp.int8, jnp.int32), (jnp.uint8, jnp.uint32),
                                        (jnp.bool_, jnp.int32), (jnp.int32, jnp.int32)])
def test_reduce_sums_small_integers_as_jnp_sum_does(dtype, want):
    s = jm.MirroredStrategy(_devices(4))
    x = s.run(lambda: jnp.asarray(100, dtype) + 0 * jm.get_replica_context().replica_id_in_sync_group.astype(dtype))
    total = s.reduce("sum", x, axis=None)
    assert total.dtype == want and int(total) == (4 if dtype == jnp.bool_ else 400)


@pytest.mark.parametrize("name", ["hierarchical", "one-device", "nccl-3-packs"])
def test_a_gradient_through_any_all_reduce_stays_mirrored(name):
    s = jm.MirroredStrategy(_devices(4), cross_device_ops=OPS[name]())
    w = s.experimental_replicate(jnp.arange(3.0))

    @s.function
    def step(w):
        ctx = jm.get_replica_context()
        g = jax.grad(lambda w: jnp.sum(ctx.all_reduce("sum", w * w)))(w)
        return w - 0.1 * g  # the same on every replica: Mirrored, no divergence warning

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = step(w)
    assert not isinstance(out, jm.PerReplica)
    np.testing.assert_allclose(out, np.arange(3.0) * 0.2, rtol=1e-6)
