"""``CommunicationOptions(wire_dtype=...)``: each replica's values travel narrowed, but sums
are accumulated, sent back and returned in the values' own dtype, so a sum beyond float16's
range (65504), or one bfloat16 cannot hold exactly, comes out exact in float32 under every
cross-device ops, in a step and eagerly (issue 29)."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxmirror as jm
from jaxmirror.experimental import CommunicationOptions

OPS = {"nccl": jm.NcclAllReduce, "hierarchical": jm.HierarchicalCopyAllReduce,
       "one-device": jm.ReductionToOneDevice,
       "one-device-last": lambda: jm.ReductionToOneDevice(reduce_to_device="CPU:7")}
HALF, BF16 = CommunicationOptions(wire_dtype="float16"), CommunicationOptions(wire_dtype="bfloat16")
N = 8
# float16 holds 40000 exactly but not 8 * 40000. bfloat16 holds each 40960 + 256 * i (and
# each fifth of it) exactly, but neither their sum 334848 nor their mean 41856.
HALF_SUM, HALF_MEAN = 320000.0, 40000.0
BF16_SUM, BF16_MEAN = 8 * 40960.0 + 256 * 28, 40960.0 + 256 * 3.5


def _values(i, shape=(3,)):
    """Replica ``i``'s float32 values for the float16 and the bfloat16 wire."""
    return jnp.full(shape, 40000.0), jnp.full(shape, 40960.0) + 256.0 * i


def _strategy(name):
    return jm.MirroredStrategy([f"CPU:{i}" for i in range(N)], cross_device_ops=OPS[name]())


def _check(got, expected):
    assert got.dtype == jnp.float32, got.dtype
    np.testing.assert_array_equal(np.asarray(got), np.full(np.shape(got), expected))


@pytest.mark.parametrize("name", list(OPS))
def test_a_step_sum_beyond_the_wire_range_is_exact_in_float32(name):
    s = _strategy(name)

    def step():
        ctx = jm.get_replica_context()
        half, bf = _values(ctx.replica_id_in_sync_group)
        return (ctx.all_reduce("sum", half, options=HALF), ctx.all_reduce("mean", half, options=HALF),
                ctx.all_reduce("sum", bf, options=BF16), ctx.all_reduce("mean", bf, options=BF16))

    for got, expected in zip(s.run(step), (HALF_SUM, HALF_MEAN, BF16_SUM, BF16_MEAN)):
        _check(got, expected)


@pytest.mark.parametrize("name", list(OPS))
def test_an_eager_sum_beyond_the_wire_range_is_exact_in_float32(name):
    s = _strategy(name)
    halves, bfs = s.run(lambda: _values(jm.get_replica_context().replica_id_in_sync_group))
    ops = s.extended.cross_device_ops
    _check(s.extended.reduce_to("sum", halves, "CPU:0", options=HALF), HALF_SUM)
    _check(ops.reduce("mean", halves, "CPU:1", options=HALF), HALF_MEAN)
    bsum, bmean = s.extended.batch_reduce_to("sum", [(bfs, "CPU:0"), (bfs, "CPU:2")],
                                             options=BF16)
    _check(bsum, BF16_SUM)
    _check(bmean, BF16_SUM)
    _check(ops.batch_reduce("mean", [(bfs, "CPU:3")], options=BF16)[0], BF16_MEAN)


def test_the_strategys_default_wire_keeps_sums_exact():
    # MultiWorkerMirroredStrategy's communication_options are every reduction's defaults; with
    # no TF_CONFIG it runs on this machine's eight devices.
    s = jm.MultiWorkerMirroredStrategy(communication_options=HALF)

    def step():
        ctx = jm.get_replica_context()
        half, _ = _values(ctx.replica_id_in_sync_group, ())
        return ctx.all_reduce("sum", half), half

    total, per_replica = s.run(step)
    _check(total, HALF_SUM)
    _check(s.reduce("sum", per_replica, axis=None), HALF_SUM)  # summed in the step
    _check(s.reduce("mean", per_replica, axis=None), HALF_MEAN)


def test_a_value_beyond_float16_is_inf_on_the_wire():
    # Documented: each value is rounded to the wire dtype once, as any float16 cast rounds it;
    # 1e5 exceeds float16's 65504, so it arrives as inf and the sum is inf (never a wrong
    # finite number). bfloat16 has float32's range.
    s = _strategy("nccl")

    def step():
        x = jnp.float32(1e5)
        ctx = jm.get_replica_context()
        return ctx.all_reduce("sum", x, options=HALF), ctx.all_reduce("sum", x, options=BF16)

    half, bf = s.run(step)
    assert half.dtype == jnp.float32 and float(half) == np.inf
    assert bf.dtype == jnp.float32 and float(bf) == 8 * float(jnp.bfloat16(1e5))


@pytest.mark.parametrize("name", list(OPS))
def test_every_ops_rounds_each_replicas_value_once(name):
    # 1 + 2**-10 is not a bfloat16: each replica's (i + 1) * (1 + 2**-10) goes on the wire as
    # i + 1, its own included (the accumulating replica's too), so every ops gives the sum of
    # the rounded values: 36 (unrounded it would be 36 * (1 + 2**-10)).
    s = _strategy(name)

    def step():
        ctx = jm.get_replica_context()
        x = (1.0 + 2.0 ** -10) * (ctx.replica_id_in_sync_group + 1.0) * jnp.ones((3,))
        return ctx.all_reduce("sum", x, options=BF16), ctx.all_reduce("mean", x, options=BF16), x

    total, mean, per_replica = s.run(step)
    _check(total, 36.0)
    _check(mean, 4.5)
    _check(s.extended.reduce_to("sum", per_replica, "CPU:5", options=BF16), 36.0)


@pytest.mark.parametrize("wire", [HALF, BF16], ids=["float16", "bfloat16"])
def test_an_integer_mean_is_never_narrowed(wire):
    s = _strategy("nccl")  # 1000001 + i: neither float16 nor bfloat16 holds them
    ints = s.experimental_distribute_values_from_function(
        lambda ctx: jnp.int32(1000001 + ctx.replica_id_in_sync_group))
    exact = 1000001 + 3.5

    def step(x):
        ctx = jm.get_replica_context()
        return (ctx.all_reduce("mean", x, options=wire),
                ctx.all_reduce("mean", {"f": jnp.float32(40960.0), "i": x}, options=wire))

    mean, mixed = s.function(step)(ints)
    _check(mean, exact)
    _check(mixed["i"], exact)
    _check(mixed["f"], 40960.0)  # the float leaf of the same nest still goes narrowed
    _check(s.extended.reduce_to("mean", ints, "CPU:0", options=wire), exact)
    _check(s.extended.batch_reduce_to("mean", [(ints, "CPU:1")], options=wire)[0], exact)
    assert int(s.extended.reduce_to("sum", ints, "CPU:0", options=wire)) == 8 * 1000001 + 28
