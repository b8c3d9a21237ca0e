"""Variables: Mirrored, SyncOnRead and plain ones (TF's rules for variables).

Checkpoints, ``extended.update`` and ``reduce_to`` are covered in test_extended.py. Every rule
about what ``run`` does to a variable is checked with the variable passed as an argument and
captured by closure (``how``): both must give the same results.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmirror as jm
from conftest import mirrored

NS = [2, 4]
HOW = ["arg", "closure"]

_STRATEGIES = {}


def S(n):
    """One MirroredStrategy over CPU:0..n-1 per n for the whole module (they cache programs)."""
    if n not in _STRATEGIES:
        _STRATEGIES[n] = mirrored(n)
    return _STRATEGIES[n]


def one_device():
    if "one" not in _STRATEGIES:
        _STRATEGIES["one"] = jm.OneDeviceStrategy("CPU:0")
    return _STRATEGIES["one"]


def rid():
    return jm.get_replica_context().replica_id_in_sync_group


def tri(n):
    """1 + 2 + ... + n: what the replicas offer, summed, when replica i offers i + 1."""
    return n * (n + 1) / 2


def comps(v):
    """The components of a variable (or distributed value), as Python values."""
    return [np.asarray(c).tolist() for c in v.values]


def local(s, x):
    return [np.asarray(c).tolist() for c in s.experimental_local_results(x)]


def make(s, init=0.0, **kwargs):
    with s.scope():
        return jm.Variable(init, **kwargs)


def call(s, how, fn, *variables):
    """Run ``fn(*variables)`` on every replica, the variables passed or captured by closure."""
    if how == "arg":
        return s.run(fn, args=variables)
    return s.run(lambda: fn(*variables))


def per_replica(s, fn):
    return s.experimental_distribute_values_from_function(lambda c: fn(c.replica_id_in_sync_group))


class Boom(Exception):
    pass


# -- creation --------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1] + NS)
@pytest.mark.parametrize("sync, cls", [(None, jm.MirroredVariable),
                                       (jm.VariableSynchronization.AUTO, jm.MirroredVariable),
                                       (jm.VariableSynchronization.ON_WRITE, jm.MirroredVariable),
                                       (jm.VariableSynchronization.ON_READ, jm.SyncOnReadVariable)])
def test_created_in_scope_is_distributed(n, sync, cls):
    s = S(n)
    kwargs = {} if sync is None else {"synchronization": sync}
    v = make(s, 1.5, **kwargs)
    assert type(v) is cls
    assert isinstance(v, jm.Variable) and isinstance(v, jm.DistributedValues)
    assert s.extended.variable_created_in_scope(v)
    assert comps(v) == [1.5] * n
    assert local(s, v) == [1.5] * n


def test_created_outside_scope_is_plain():
    for sync in ["auto", "on_write", "on_read", "none"]:
        v = jm.Variable(2.0, synchronization=sync)
        assert type(v) is jm.Variable and not isinstance(v, jm.DistributedValues)
        assert float(v.numpy()) == 2.0
        assert not S(2).extended.variable_created_in_scope(v)
    assert not jm.has_strategy()


@pytest.mark.parametrize("sync", ["auto", "on_write", "on_read"])
def test_one_device_strategy_makes_plain_variables_in_its_scope(sync):
    s = one_device()
    v = make(s, 3.0, synchronization=sync)
    assert type(v) is jm.Variable
    assert s.extended.variable_created_in_scope(v)
    assert not S(2).extended.variable_created_in_scope(v)
    assert float(v.numpy()) == 3.0
    assert s.experimental_local_results(v)[0].tolist() == 3.0


@pytest.mark.parametrize("n", [1] + NS)
@pytest.mark.parametrize("sync", [jm.VariableSynchronization.NONE, "none", "NONE"])
def test_synchronization_none_in_scope_raises(n, sync):
    with pytest.raises(ValueError, match="NONE"):
        make(S(n), 1.0, synchronization=sync)


@pytest.mark.parametrize("where", ["none", "one", 1, 2, 4])
def test_trainable_with_on_read_allowed(where):
    # TF 2's tf.Variable keeps trainable=True with ON_READ (only TF 1's get_variable refuses).
    kwargs = dict(trainable=True, synchronization="on_read", aggregation="sum")
    if where == "none":
        v = jm.Variable(1.0, **kwargs)
    else:
        v = make(one_device() if where == "one" else S(where), 1.0, **kwargs)
    assert v.trainable is True and v.synchronization is jm.VariableSynchronization.ON_READ


@pytest.mark.parametrize("where", ["none", "one", 1, 2, 4])
def test_trainable_default(where):
    def mk(**kwargs):
        if where == "none":
            return jm.Variable(1.0, **kwargs)
        return make(one_device() if where == "one" else S(where), 1.0, **kwargs)

    assert mk().trainable is True
    assert mk(synchronization="on_write").trainable is True
    assert mk(synchronization="on_read").trainable is False
    assert mk(synchronization="on_read", trainable=False).trainable is False
    assert mk(trainable=False).trainable is False


@pytest.mark.parametrize("n", NS)
def test_strings_accepted_for_synchronization_and_aggregation_in_any_case(n):
    s = S(n)
    for sync, cls, expect in [("on_read", jm.SyncOnReadVariable, jm.VariableSynchronization.ON_READ),
                              ("On_Read", jm.SyncOnReadVariable, jm.VariableSynchronization.ON_READ),
                              ("ON_WRITE", jm.MirroredVariable, jm.VariableSynchronization.ON_WRITE),
                              ("auto", jm.MirroredVariable, jm.VariableSynchronization.AUTO)]:
        v = make(s, 1.0, synchronization=sync)
        assert type(v) is cls and v.synchronization is expect
    for agg, expect in [("sum", jm.VariableAggregation.SUM), ("Mean", jm.VariableAggregation.MEAN),
                        ("ONLY_FIRST_REPLICA", jm.VariableAggregation.ONLY_FIRST_REPLICA),
                        ("only_first_replica", jm.VariableAggregation.ONLY_FIRST_REPLICA),
                        ("none", jm.VariableAggregation.NONE)]:
        assert make(s, 1.0, aggregation=agg).aggregation is expect
        assert jm.Variable(1.0, aggregation=agg).aggregation is expect


@pytest.mark.parametrize("where", ["none", 2])
def test_bad_aggregation_or_synchronization_raises(where):
    def mk(**kwargs):
        return jm.Variable(1.0, **kwargs) if where == "none" else make(S(where), 1.0, **kwargs)

    for bad in ["max", "bogus", 17]:
        with pytest.raises(ValueError):
            mk(aggregation=bad)
    with pytest.raises(ValueError):
        mk(synchronization="sometimes")


@pytest.mark.parametrize("where", ["none", "one", 2, 4])
def test_initial_value_none_raises(where):
    with pytest.raises(ValueError, match="initial_value"):
        if where == "none":
            jm.Variable(None)
        else:
            make(one_device() if where == "one" else S(where), None)
    with pytest.raises(ValueError):
        jm.Variable()


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("sync", ["on_write", "on_read"])
def test_callable_initial_value_and_dtype(n, sync):
    s = S(n)
    v = make(s, lambda: jnp.arange(3.0), synchronization=sync)
    assert v.shape == (3,) and v.dtype == jnp.float32
    assert comps(v) == [[0.0, 1.0, 2.0]] * n
    w = make(s, 1, dtype=jnp.float32, synchronization=sync)
    assert w.dtype == jnp.float32
    assert all(np.asarray(c).dtype == np.float32 for c in w.values)
    assert comps(w) == [1.0] * n
    i = make(s, [1, 2], synchronization=sync)
    assert i.dtype == jnp.int32 and comps(i) == [[1, 2]] * n
    p = jm.Variable(lambda: np.ones((2, 2), np.float32), dtype="float32")
    assert p.shape == (2, 2) and p.dtype == jnp.float32 and p.numpy().tolist() == [[1.0, 1.0]] * 2


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("sync", ["on_write", "on_read"])
def test_every_component_starts_from_the_initial_value(n, sync):
    s = S(n)
    v = make(s, jnp.array([1.0, -2.0]), synchronization=sync, aggregation="mean")
    assert comps(v) == [[1.0, -2.0]] * n
    assert v.numpy().tolist() == [1.0, -2.0]  # MEAN of identical components (on_read) or the value
    # A sync-on-read SUM variable's cross-replica read is the sum of N equal components.
    t = make(s, 1.5, synchronization="on_read", aggregation="sum")
    assert float(t.numpy()) == 1.5 * n and comps(t) == [1.5] * n
    # A PerReplica initial value: every component starts from replica 0's value.
    pr = per_replica(s, lambda i: np.float32(i + 7))
    u = make(s, pr, synchronization=sync)
    assert comps(u) == [7.0] * n
    # Another variable as the initial value: its (cross-replica) value.
    w = make(s, v, synchronization=sync)
    assert comps(w) == [[1.0, -2.0]] * n


@pytest.mark.parametrize("n", [1] + NS)
def test_creating_a_variable_inside_run_raises(n):
    s = S(n)
    with pytest.raises(RuntimeError):
        s.run(lambda: jm.Variable(1.0).read_value())
    with s.scope():
        with pytest.raises(RuntimeError):
            s.run(lambda: jm.Variable(2.0).read_value())
    # Nothing was left half-done: the contexts are back and a new run works.
    assert not jm.in_cross_replica_context() and not jm.has_strategy()
    out = s.run(lambda: rid() * 1.0)
    assert [float(x) for x in s.experimental_local_results(out)] == [float(i) for i in range(n)]


def test_creating_a_variable_inside_one_device_run_raises():
    with pytest.raises(RuntimeError):
        one_device().run(lambda: jm.Variable(1.0).read_value())


@pytest.mark.parametrize("where", ["none", "one", 1, 2, 4])
def test_properties(where):
    kwargs = dict(synchronization="on_write", aggregation="mean", name="weights")
    if where == "none":
        v = jm.Variable(jnp.zeros((2, 3)), **kwargs)
    else:
        v = make(one_device() if where == "one" else S(where), jnp.zeros((2, 3)), **kwargs)
    assert v.name == "weights"
    assert v.shape == (2, 3)
    assert v.dtype == jnp.float32
    assert v.trainable is True
    assert v.aggregation is jm.VariableAggregation.MEAN
    assert v.synchronization is jm.VariableSynchronization.ON_WRITE
    d = jm.Variable(1) if where == "none" else make(
        one_device() if where == "one" else S(where), 1)
    assert d.name == "Variable" and d.shape == () and d.dtype == jnp.int32
    assert d.aggregation is jm.VariableAggregation.NONE
    assert d.synchronization is jm.VariableSynchronization.AUTO


@pytest.mark.parametrize("n", NS)
def test_sync_on_read_properties(n):
    r = make(S(n), jnp.ones(4), synchronization="on_read", aggregation="sum", name="count")
    assert r.name == "count" and r.shape == (4,) and r.dtype == jnp.float32
    assert r.trainable is False
    assert r.aggregation is jm.VariableAggregation.SUM
    assert r.synchronization is jm.VariableSynchronization.ON_READ


# -- MirroredVariable in replica context -------------------------------------------------------
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("agg", ["sum", "mean", "only_first_replica"])
def test_mirrored_assign_in_replica_context_aggregates(n, how, agg):
    s = S(n)
    v = make(s, 0.0, aggregation=agg)
    expect = {"sum": tri(n), "mean": (n + 1) / 2, "only_first_replica": 1.0}[agg]

    def fn(x):
        x.assign(rid() + 1.0)

    assert call(s, how, fn, v) is None
    assert comps(v) == [expect] * n
    assert local(s, v) == [expect] * n
    assert float(v.numpy()) == expect and float(v.read_value()) == expect


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("n", NS)
def test_mirrored_none_aggregation_each_replica_writes_its_own_component(n, how):
    s = S(n)
    v = make(s, 0.0)  # aggregation NONE by default
    call(s, how, lambda x: x.assign(rid() + 1.0, read_value=False), v)
    assert comps(v) == [i + 1.0 for i in range(n)]
    assert local(s, v) == [i + 1.0 for i in range(n)]
    # A cross-replica read gives component 0.
    assert float(v.numpy()) == 1.0
    assert float(v.read_value()) == 1.0
    assert float(v) == 1.0
    with s.scope():
        assert float(v.numpy()) == 1.0
    # Later replica-context writes keep going per component.
    call(s, how, lambda x: x.assign_add(10.0 * rid(), read_value=False), v)
    assert comps(v) == [11.0 * i + 1.0 for i in range(n)]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("agg", ["sum", "mean", "only_first_replica", "none"])
def test_mirrored_assign_add_and_sub_are_old_plus_aggregate(n, how, agg):
    s = S(n)
    v = make(s, 100.0, aggregation=agg)
    agg_of = {"sum": lambda xs: sum(xs), "mean": lambda xs: sum(xs) / len(xs),
              "only_first_replica": lambda xs: xs[0]}

    def fn(x):
        x.assign_add(rid() + 1.0)
        x.assign_sub(2.0 * rid() + 0.5)

    call(s, how, fn, v)
    adds = [i + 1.0 for i in range(n)]
    subs = [2.0 * i + 0.5 for i in range(n)]
    if agg == "none":
        expect = [100.0 + a - b for a, b in zip(adds, subs)]
    else:
        expect = [100.0 + agg_of[agg](adds) - agg_of[agg](subs)] * n
    assert comps(v) == expect
    assert float(v.numpy()) == expect[0]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("const", [1.0, 1, np.float32(1.0), np.ones(()), np.array(1.0, np.float32)],
                         ids=["float", "int", "np_scalar", "np_array", "np_f32_array"])
@pytest.mark.parametrize("method", ["assign", "assign_add", "assign_sub"])
def test_mirrored_sum_with_a_constant_raises(n, how, const, method):
    s = S(n)
    v = make(s, 5.0, aggregation="sum")

    def fn(x):
        getattr(x, method)(const)

    with pytest.raises(ValueError, match="non-DistributedValues"):
        call(s, how, fn, v)
    assert comps(v) == [5.0] * n


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("n", NS)
def test_mirrored_sum_with_an_array_made_in_the_replica(n, how):
    s = S(n)
    v = make(s, 5.0, aggregation="sum")
    call(s, how, lambda x: x.assign(jnp.asarray(1.0), read_value=False), v)
    assert comps(v) == [float(n)] * n
    call(s, how, lambda x: x.assign_add(jnp.ones(()), read_value=False), v)
    assert comps(v) == [2.0 * n] * n


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("agg, expect", [("mean", 3.0), ("only_first_replica", 3.0)])
def test_mirrored_mean_and_only_first_accept_python_constants(n, how, agg, expect):
    s = S(n)
    v = make(s, 0.0, aggregation=agg)
    call(s, how, lambda x: x.assign(3.0, read_value=False), v)
    assert comps(v) == [expect] * n
    call(s, how, lambda x: x.assign_add(np.float32(2.0), read_value=False), v)
    assert comps(v) == [expect + 2.0] * n


@pytest.mark.parametrize("how", HOW)
def test_one_replica_mirrored_variable_takes_the_replicas_value(how):
    s = S(1)
    for agg in ["sum", "mean", "only_first_replica", "none"]:
        v = make(s, 0.0, aggregation=agg)
        assert type(v) is jm.MirroredVariable
        call(s, how, lambda x: x.assign(rid() + 4.0, read_value=False), v)
        assert comps(v) == [4.0] and float(v.numpy()) == 4.0
        # One replica: a constant is the replica's only contribution (reduce returns it as is).
        call(s, how, lambda x: x.assign_add(1.0, read_value=False), v)
        assert comps(v) == [5.0]


@pytest.mark.parametrize("how", HOW)
def test_one_device_strategy_variable_in_run(how):
    s = one_device()
    v = make(s, 1.0, aggregation="sum")
    out = call(s, how, lambda x: x.assign_add(2.0).read_value(), v)
    assert isinstance(out, jax.Array) and float(out) == 3.0
    assert float(v.numpy()) == 3.0


def test_no_strategy_variable_in_default_run():
    v = jm.Variable(1.0, aggregation="sum")
    out = jm.get_strategy().run(lambda x: x.assign_add(2.0).read_value(), args=(v,))
    assert float(out) == 3.0 and float(v.numpy()) == 3.0
    jm.get_strategy().run(lambda: v.assign_sub(0.5))
    assert float(v.numpy()) == 2.5


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("n", NS)
def test_assignments_inside_run_are_seen_by_later_reads_in_the_same_run(n, how):
    s = S(n)
    v = make(s, 1.0, aggregation="mean")
    w = make(s, 0.0)  # NONE

    def fn(x, y):
        before = x.read_value()
        x.assign_add(rid() + 1.0)
        y.assign(x * 10.0 + rid())
        return before, x.read_value(), y.read_value(), x.value()

    before, after, y, xv = call(s, how, fn, v, w)
    m = 1.0 + (n + 1) / 2
    assert float(before) == 1.0
    assert local(s, after) == [m] * n and local(s, xv) == [m] * n
    assert local(s, y) == [m * 10 + i for i in range(n)]
    assert comps(v) == [m] * n and comps(w) == [m * 10 + i for i in range(n)]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("n", NS)
def test_returning_the_assigned_variable_gives_its_new_value(n, how):
    # `return v.assign_add(d)` is the TF idiom: the step's result is the updated value, on every call.
    s = S(n)
    v = make(s, 0.0, aggregation="mean")
    step = s.function(lambda x: x.assign_add(1.0)) if how == "arg" else s.function(
        lambda: v.assign_add(1.0))
    for k in range(1, 4):
        out = step(v) if how == "arg" else step()
        assert comps(v) == [float(k)] * n
        assert local(s, out) == [float(k)] * n


@pytest.mark.parametrize("n", NS)
def test_same_variable_passed_and_captured_is_one_variable(n):
    s = S(n)
    v = make(s, 1.0, aggregation="sum")

    def fn(x, y):
        x.assign_add(jnp.asarray(1.0))
        y.assign_add(jnp.asarray(1.0))
        v.assign_add(jnp.asarray(1.0))
        return x.read_value()

    out = s.run(fn, args=(v, v))
    assert comps(v) == [1.0 + 3 * n] * n
    assert local(s, out) == [1.0 + 3 * n] * n


# -- cross-replica assign (eager) ----------------------------------------------------------------
@pytest.mark.parametrize("n", [1] + NS)
@pytest.mark.parametrize("in_scope", [False, True])
@pytest.mark.parametrize("agg", ["none", "sum", "mean", "only_first_replica"])
def test_mirrored_cross_replica_assign_writes_every_component(n, in_scope, agg):
    s = S(n)
    v = make(s, jnp.zeros(2), aggregation=agg)

    def do():
        assert v.assign([1.0, 2.0]) is v
        assert comps(v) == [[1.0, 2.0]] * n
        v.assign_add(jnp.array([1.0, 1.0]))  # a Python constant is fine in cross-replica context
        assert comps(v) == [[2.0, 3.0]] * n
        assert v.assign_sub(np.array([0.5, 0.5]), read_value=False) is None
        assert comps(v) == [[1.5, 2.5]] * n
        assert v.numpy().tolist() == [1.5, 2.5]

    if in_scope:
        with s.scope():
            do()
    else:
        do()


@pytest.mark.parametrize("n", NS)
def test_cross_replica_writes_after_divergence(n):
    s = S(n)
    v = make(s, 0.0)
    s.run(lambda: v.assign(rid() * 1.0, read_value=False))
    assert comps(v) == [float(i) for i in range(n)]
    v.assign_add(10.0)  # every component gets it
    assert comps(v) == [10.0 + i for i in range(n)]
    v.assign(3.0)  # every component is written
    assert comps(v) == [3.0] * n
    assert float(v.numpy()) == 3.0


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("in_scope", [False, True])
def test_mirrored_cross_replica_assign_of_per_replica_raises(n, in_scope):
    s = S(n)
    v = make(s, 0.0, aggregation="sum")
    pr = per_replica(s, lambda i: np.float32(i))
    for method in ["assign", "assign_add"]:
        with pytest.raises(ValueError):
            if in_scope:
                with s.scope():
                    getattr(v, method)(pr)
            else:
                getattr(v, method)(pr)
    assert comps(v) == [0.0] * n


@pytest.mark.parametrize("n", NS)
def test_mirrored_cross_replica_assign_of_a_mirrored_value(n):
    s = S(n)
    v = make(s, 0.0)
    m = s.run(lambda: jm.get_replica_context().all_reduce("sum", 1.0))  # a Mirrored result
    v.assign(m)
    assert comps(v) == [float(n)] * n
    v.assign(jm.Mirrored(jnp.float32(2.0), n))
    assert comps(v) == [2.0] * n


# -- SyncOnReadVariable --------------------------------------------------------------------------
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("agg", ["sum", "mean", "only_first_replica", "none"])
def test_sync_on_read_replica_context_touches_local_component_only(n, how, agg):
    s = S(n)
    r = make(s, 0.0, synchronization="on_read", aggregation=agg)

    def fn(x):
        first = x.read_value()
        x.assign_add(rid() + 1.0)
        return first, x.read_value(), x + 0.0

    first, after, plus = call(s, how, fn, r)
    assert local(s, first) == [0.0] * n
    assert local(s, after) == [i + 1.0 for i in range(n)]
    assert local(s, plus) == [i + 1.0 for i in range(n)]
    assert comps(r) == [i + 1.0 for i in range(n)]
    assert local(s, r) == [i + 1.0 for i in range(n)]
    # Python constants are fine too (each replica writes its own component, whatever the aggregation).
    call(s, how, lambda x: x.assign_add(1.0, read_value=False), r)
    assert comps(r) == [i + 2.0 for i in range(n)]
    call(s, how, lambda x: x.assign(rid() * 3.0, read_value=False), r)
    assert comps(r) == [3.0 * i for i in range(n)]
    call(s, how, lambda x: x.assign_sub(np.float32(1.0), read_value=False), r)
    assert comps(r) == [3.0 * i - 1 for i in range(n)]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("n", NS)
def test_sync_on_read_takes_per_replica_arguments(n, how):
    s = S(n)
    r = make(s, jnp.zeros(2), synchronization="on_read", aggregation="sum")
    pr = per_replica(s, lambda i: np.full((2,), i * 2.0, np.float32))
    if how == "arg":
        s.run(lambda x, p: x.assign(p, read_value=False), args=(r, pr))
    else:
        s.run(lambda p: r.assign(p, read_value=False), args=(pr,))
    assert comps(r) == [[i * 2.0] * 2 for i in range(n)]
    assert r.numpy().tolist() == [2.0 * sum(range(n))] * 2


@pytest.mark.parametrize("n", [1] + NS)
@pytest.mark.parametrize("agg", ["sum", "mean", "only_first_replica"])
def test_sync_on_read_cross_replica_read_aggregates(n, agg):
    s = S(n)
    r = make(s, 0.0, synchronization="on_read", aggregation=agg)
    s.run(lambda: r.assign(rid() + 1.0, read_value=False))
    vals = [i + 1.0 for i in range(n)]
    assert comps(r) == vals
    expect = {"sum": sum(vals), "mean": sum(vals) / n, "only_first_replica": vals[0]}[agg]
    assert float(r.numpy()) == expect
    assert float(r.read_value()) == expect
    assert float(r.value()) == expect
    assert float(r) == expect
    with s.scope():
        assert float(r.numpy()) == expect


@pytest.mark.parametrize("n", NS)
def test_sync_on_read_none_cross_replica_read_raises(n):
    s = S(n)
    r = make(s, 0.0, synchronization="on_read", aggregation="none")
    s.run(lambda: r.assign(rid() + 1.0, read_value=False))
    assert comps(r) == [i + 1.0 for i in range(n)]  # the components are still there
    with pytest.raises(ValueError):
        r.numpy()
    with pytest.raises(ValueError):
        r.read_value()
    with s.scope(), pytest.raises(ValueError):
        r.read_value()


@pytest.mark.parametrize("n", [1] + NS)
@pytest.mark.parametrize("in_scope", [False, True])
@pytest.mark.parametrize("agg", ["sum", "mean", "only_first_replica", "none"])
def test_sync_on_read_cross_replica_assign(n, in_scope, agg):
    s = S(n)
    r = make(s, jnp.zeros(2), synchronization="on_read", aggregation=agg)

    def do():
        r.assign(jnp.array([4.0, 8.0]))
        stored = [4.0 / n, 8.0 / n] if agg == "sum" else [4.0, 8.0]
        assert comps(r) == [stored] * n
        if agg != "none":
            assert r.numpy().tolist() == [4.0, 8.0]

    if in_scope:
        with s.scope():
            do()
    else:
        do()


@pytest.mark.parametrize("n", [1] + NS)
def test_sync_on_read_sum_cross_replica_assign_add_raises(n):
    s = S(n)
    r = make(s, 2.0, synchronization="on_read", aggregation="sum")
    for method in ["assign_add", "assign_sub"]:
        with pytest.raises(ValueError, match="SUM"):
            getattr(r, method)(1.0)
        with s.scope(), pytest.raises(ValueError, match="SUM"):
            getattr(r, method)(1.0)
    assert comps(r) == [2.0] * n


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("agg", ["mean", "only_first_replica", "none"])
def test_sync_on_read_cross_replica_assign_add_adds_to_every_component(n, agg):
    s = S(n)
    r = make(s, 0.0, synchronization="on_read", aggregation=agg)
    s.run(lambda: r.assign(rid() * 1.0, read_value=False))
    r.assign_add(10.0)
    assert comps(r) == [10.0 + i for i in range(n)]
    r.assign_sub(np.float32(1.0))
    assert comps(r) == [9.0 + i for i in range(n)]
    if agg == "mean":
        assert float(r.numpy()) == 9.0 + (n - 1) / 2


# -- merge_call ----------------------------------------------------------------------------------
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("agg", ["sum", "mean", "only_first_replica"])
def test_merge_fn_reads_sync_on_read_aggregate(n, how, agg):
    s = S(n)
    r = make(s, 0.0, synchronization="on_read", aggregation=agg)
    expect = {"sum": tri(n), "mean": tri(n) / n, "only_first_replica": 1.0}[agg]

    def fn(x):
        x.assign_add(rid() + 1.0)
        ctx = jm.get_replica_context()
        closed = ctx.merge_call(lambda strategy: x.read_value())
        passed = ctx.merge_call(lambda strategy, var: var.read_value(), args=(x,))
        return closed, passed, x.read_value()

    closed, passed, own = call(s, how, fn, r)
    assert local(s, closed) == [expect] * n
    assert local(s, passed) == [expect] * n
    assert local(s, own) == [i + 1.0 for i in range(n)]  # back in replica context: the local one
    assert comps(r) == [i + 1.0 for i in range(n)]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("agg", ["none", "sum", "mean"])
def test_merge_fn_assigning_a_mirrored_variable_writes_every_component(n, how, agg):
    s = S(n)
    v = make(s, 0.0, aggregation=agg)

    def fn(x):
        ctx = jm.get_replica_context()

        def merge_fn(strategy, value):
            x.assign(strategy.reduce("sum", value, axis=None) * 10.0)
            x.assign_add(1.0)  # a Python constant: fine in cross-replica context, even for SUM

        ctx.merge_call(merge_fn, args=(rid() + 1.0,))
        return x.read_value()

    out = call(s, how, fn, v)
    assert comps(v) == [tri(n) * 10.0 + 1.0] * n
    assert local(s, out) == [tri(n) * 10.0 + 1.0] * n


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("n", NS)
def test_merge_fn_reads_component_0_of_a_diverged_mirrored_variable(n, how):
    s = S(n)
    v = make(s, 0.0)

    def fn(x):
        x.assign(rid() + 1.0)
        return jm.get_replica_context().merge_call(lambda strategy: x.read_value())

    out = call(s, how, fn, v)
    assert local(s, out) == [1.0] * n
    assert comps(v) == [i + 1.0 for i in range(n)]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("n", NS)
def test_merge_fn_assigning_a_sync_on_read_variable_follows_cross_replica_rules(n, how):
    s = S(n)
    total = make(s, 0.0, synchronization="on_read", aggregation="sum")
    mean = make(s, 0.0, synchronization="on_read", aggregation="mean")

    def fn(t, m):
        def merge_fn(strategy):
            t.assign(8.0)  # SUM: 8 / N in each component
            m.assign(8.0)
            m.assign_add(1.0)  # MEAN: added to each component

        jm.get_replica_context().merge_call(merge_fn)
        return t.read_value(), m.read_value()

    t_out, m_out = call(s, how, fn, total, mean)
    assert comps(total) == [8.0 / n] * n and float(total.numpy()) == 8.0
    assert comps(mean) == [9.0] * n and float(mean.numpy()) == 9.0
    assert local(s, t_out) == [8.0 / n] * n
    assert local(s, m_out) == [9.0] * n


@pytest.mark.parametrize("n", NS)
def test_merge_fn_sync_on_read_sum_assign_add_raises(n):
    s = S(n)
    total = make(s, 0.0, synchronization="on_read", aggregation="sum")

    def fn():
        jm.get_replica_context().merge_call(lambda strategy: total.assign_add(1.0, read_value=False))

    with pytest.raises(ValueError, match="SUM"):
        s.run(fn)
    assert comps(total) == [0.0] * n


# -- failure atomicity ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", NS)
def test_a_failing_step_changes_no_variable(n):
    s = S(n)
    captured = make(s, 1.0, aggregation="sum")
    passed = make(s, 2.0, aggregation="mean")
    counts = make(s, 0.0, synchronization="on_read", aggregation="sum")
    diverged = make(s, 0.0)

    def fn(x):
        captured.assign_add(jnp.asarray(1.0))
        x.assign(5.0)
        counts.assign_add(rid() + 1.0)
        diverged.assign(rid() * 1.0)
        raise Boom("after the assignments")

    with pytest.raises(Boom):
        s.run(fn, args=(passed,))
    assert comps(captured) == [1.0] * n
    assert comps(passed) == [2.0] * n
    assert comps(counts) == [0.0] * n
    assert comps(diverged) == [0.0] * n
    assert not jm.in_cross_replica_context() and not jm.has_strategy()
    assert jm.get_replica_context().replica_id_in_sync_group == 0

    # The variables stay usable.
    def ok(x):
        captured.assign_add(jnp.asarray(1.0))
        x.assign(5.0)
        counts.assign_add(rid() + 1.0)

    s.run(ok, args=(passed,))
    assert comps(captured) == [1.0 + n] * n
    assert comps(passed) == [5.0] * n
    assert comps(counts) == [i + 1.0 for i in range(n)]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("n", NS)
def test_a_step_failing_on_bad_input_changes_nothing(n, how):
    s = S(n)
    v = make(s, 1.0, aggregation="mean")
    w = make(s, jnp.zeros(3), aggregation="mean")

    def fn(x, y, new):
        x.assign_add(1.0)
        y.assign(new)  # a shape mismatch for some inputs

    if how == "arg":
        step = s.function(fn)
        run = lambda new: step(v, w, new)  # noqa: E731
    else:
        step = s.function(lambda new: fn(v, w, new))
        run = step
    run(jnp.ones(3))  # compiled and working
    assert comps(v) == [2.0] * n and comps(w) == [[1.0] * 3] * n
    with pytest.raises(ValueError, match="[Ss]hape"):
        run(jnp.ones(4))
    assert comps(v) == [2.0] * n and comps(w) == [[1.0] * 3] * n
    run(jnp.full(3, 7.0))  # still usable
    assert comps(v) == [3.0] * n and comps(w) == [[7.0] * 3] * n


@pytest.mark.parametrize("n", NS)
def test_failure_in_a_later_call_of_a_compiled_step_changes_nothing(n):
    s = S(n)
    v = make(s, 0.0, aggregation="sum")
    r = make(s, 0.0, synchronization="on_read", aggregation="sum")

    @s.function
    def step(x):
        v.assign_add(jnp.asarray(1.0))
        r.assign_add(jnp.sum(x))
        if x.ndim:  # a new input signature retraces, and this one fails
            raise Boom
        return v.read_value()

    step(jnp.float32(1))
    step(jnp.float32(1))
    assert comps(v) == [2.0 * n] * n and comps(r) == [2.0] * n
    with pytest.raises(Boom):
        step(jnp.ones(1))
    assert comps(v) == [2.0 * n] * n and comps(r) == [2.0] * n
    assert local(s, step(jnp.float32(1))) == [3.0 * n] * n


# -- tracing -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("agg", ["sum", "mean", "only_first_replica", "none"])
def test_no_extra_tracing_on_later_calls(n, agg):
    s = S(n)
    v = make(s, 0.0, aggregation=agg)
    r = make(s, 0.0, synchronization="on_read", aggregation="sum")

    def step():
        v.assign_add(jnp.asarray(1.0) if agg == "sum" else 1.0)
        r.assign_add(rid() + 1.0)
        return v.read_value(), r.read_value()

    f = s.function(step)
    per_step = {"sum": n, "mean": 1.0, "only_first_replica": 1.0, "none": 1.0}[agg]
    f()
    traces = f.trace_count
    for k in range(2, 7):
        out_v, out_r = f()
        assert comps(v) == [per_step * k] * n
        assert local(s, out_v) == [per_step * k] * n
        assert comps(r) == [k * (i + 1.0) for i in range(n)]
        assert local(s, out_r) == [k * (i + 1.0) for i in range(n)]
    assert f.trace_count == traces
    assert float(r.numpy()) == 6 * tri(n)


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("n", NS)
def test_no_extra_tracing_when_replicas_diverge_a_none_variable(n, how):
    # Each replica writes its own component (aggregation NONE): the components differ after the
    # first call, yet later calls must not trace the step again.
    s = S(n)
    v = make(s, 0.0)
    f = s.function(lambda x: x.assign_add(rid() + 1.0, read_value=False)) if how == "arg" else (
        s.function(lambda: v.assign_add(rid() + 1.0, read_value=False)))
    f(v) if how == "arg" else f()
    traces = f.trace_count
    for k in range(2, 7):
        f(v) if how == "arg" else f()
        assert comps(v) == [k * (i + 1.0) for i in range(n)]
    assert f.trace_count == traces


@pytest.mark.parametrize("n", NS)
def test_no_extra_tracing_with_variables_passed_as_arguments(n):
    s = S(n)
    v = make(s, 0.0, aggregation="mean")
    r = make(s, 0.0, synchronization="on_read", aggregation="sum")

    @s.function
    def step(x, y):
        x.assign_add(1.0)
        y.assign_add(rid() + 1.0)
        return x.read_value()

    step(v, r)
    traces = step.trace_count
    for k in range(2, 7):
        assert local(s, step(v, r)) == [float(k)] * n
    assert step.trace_count == traces
    assert comps(r) == [6.0 * (i + 1) for i in range(n)]


@pytest.mark.parametrize("n", NS)
def test_step_using_variables_inside_jax_jit_raises(n):
    s = S(n)
    v = make(s, 0.0, aggregation="mean")
    fresh = s.function(lambda: v.assign_add(1.0, read_value=False))
    with pytest.raises(RuntimeError):
        jax.jit(lambda: fresh())()
    fresh()  # called directly it works
    assert comps(v) == [1.0] * n
    with pytest.raises(RuntimeError):
        jax.jit(lambda: fresh())()  # an already compiled step too
    passed = s.function(lambda x: x.assign_add(1.0, read_value=False))
    with pytest.raises(RuntimeError):
        jax.jit(lambda: passed(v))()
    assert comps(v) == [1.0] * n


# -- operators and conversions -------------------------------------------------------------------
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("n", NS)
def test_operators_inside_run(n, how):
    s = S(n)
    v = make(s, jnp.array([2.0, 3.0]))
    w = make(s, jnp.array([10.0, 20.0]))

    def fn(x, y):
        return {"add": x + 1, "radd": 1 + x, "mul": x * y, "neg": -x, "item": x[0],
                "jnp": jnp.asarray(x) * rid(), "sub": y - x, "rsub": 1.0 - x, "div": y / x,
                "pow": x ** 2, "matmul": x @ y, "sin": jnp.sin(x.value())}

    out = call(s, how, fn, v, w)
    assert out["add"].tolist() == [3.0, 4.0] and out["radd"].tolist() == [3.0, 4.0]
    assert out["mul"].tolist() == [20.0, 60.0] and out["neg"].tolist() == [-2.0, -3.0]
    assert float(out["item"]) == 2.0
    assert local(s, out["jnp"]) == [[2.0 * i, 3.0 * i] for i in range(n)]
    assert out["sub"].tolist() == [8.0, 17.0] and out["rsub"].tolist() == [-1.0, -2.0]
    np.testing.assert_allclose(out["div"], [5.0, 20.0 / 3.0], rtol=1e-6)
    assert out["pow"].tolist() == [4.0, 9.0] and float(out["matmul"]) == 80.0
    np.testing.assert_allclose(out["sin"], np.sin([2.0, 3.0]), rtol=1e-6)


@pytest.mark.parametrize("where", ["none", "one", 2, 4])
def test_operators_and_conversions_outside_run(where):
    if where == "none":
        v, w = jm.Variable(jnp.array([2.0, 3.0])), jm.Variable(jnp.array([10.0, 20.0]))
    else:
        s = one_device() if where == "one" else S(where)
        v, w = make(s, jnp.array([2.0, 3.0])), make(s, jnp.array([10.0, 20.0]))
    assert (v + 1).tolist() == [3.0, 4.0]
    assert (1 + v).tolist() == [3.0, 4.0]
    assert (v * w).tolist() == [20.0, 60.0]
    assert (-v).tolist() == [-2.0, -3.0]
    assert float(v[0]) == 2.0
    assert float(v @ w) == 80.0
    assert (v < 2.5).tolist() == [True, False]
    assert np.asarray(v).tolist() == [2.0, 3.0] and isinstance(np.asarray(v), np.ndarray)
    assert jnp.asarray(v).tolist() == [2.0, 3.0] and isinstance(jnp.asarray(v), jax.Array)
    assert (np.ones(2) + v).tolist() == [3.0, 4.0]
    assert len(v) == 2 and [float(x) for x in v] == [2.0, 3.0]
    s0 = jm.Variable(1.5) if where == "none" else make(s, 1.5)
    assert float(s0) == 1.5 and int(s0) == 1 and bool(s0)


@pytest.mark.parametrize("n", NS)
def test_sync_on_read_operators_use_the_aggregate_outside_run(n):
    s = S(n)
    r = make(s, 0.0, synchronization="on_read", aggregation="sum")
    s.run(lambda: r.assign(rid() + 1.0, read_value=False))
    assert float(r + 1) == tri(n) + 1
    assert float(np.asarray(r)) == tri(n) and float(jnp.asarray(r)) == tri(n) and float(r) == tri(n)


# -- shapes and dtypes ---------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["none", "one", 2, 4])
def test_shape_mismatch_assign_raises(where):
    v = jm.Variable(jnp.zeros(3)) if where == "none" else make(
        one_device() if where == "one" else S(where), jnp.zeros(3), aggregation="mean")
    for bad in [jnp.zeros(4), np.zeros((3, 1)), 1.0, [1.0, 2.0]]:
        with pytest.raises(ValueError, match="[Ss]hape"):
            v.assign(bad)
        with pytest.raises(ValueError, match="[Ss]hape"):
            v.assign_add(bad)
    assert v.numpy().tolist() == [0.0] * 3


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("sync", ["on_write", "on_read"])
def test_shape_mismatch_assign_inside_run_raises(n, how, sync):
    s = S(n)
    v = make(s, jnp.zeros(3), synchronization=sync, aggregation="mean")
    with pytest.raises(ValueError, match="[Ss]hape"):
        call(s, how, lambda x: x.assign(jnp.zeros(2), read_value=False), v)
    assert comps(v) == [[0.0] * 3] * n


@pytest.mark.parametrize("where", ["none", "one", 2, 4])
def test_dtype_casts(where):
    mk = (lambda x, **kw: jm.Variable(x, **kw)) if where == "none" else (
        lambda x, **kw: make(one_device() if where == "one" else S(where), x, **kw))
    f = mk(jnp.zeros(2))
    f.assign(np.array([1, 2]))  # an int value into a float variable: fine
    assert f.dtype == jnp.float32 and f.numpy().dtype == np.float32
    assert f.numpy().tolist() == [1.0, 2.0]
    g = mk(0.0)
    g.assign(3)
    assert g.numpy().dtype == np.float32 and float(g) == 3.0
    i = mk(jnp.zeros(2, jnp.int32))
    with pytest.raises(TypeError):
        i.assign(jnp.array([1.5, 2.5]))
    with pytest.raises(TypeError):
        i.assign(np.array([1.5, 2.5], np.float32))
    with pytest.raises(TypeError):
        i.assign_add(jnp.array([1.0, 1.0]))
    assert i.numpy().tolist() == [0, 0] and i.dtype == jnp.int32


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("n", NS)
def test_dtype_casts_inside_run(n, how):
    s = S(n)
    f = make(s, 0.0, aggregation="mean")
    call(s, how, lambda x: x.assign(rid() + 1, read_value=False), f)  # int32 traced value
    assert f.dtype == jnp.float32 and comps(f) == [(n + 1) / 2] * n
    assert all(np.asarray(c).dtype == np.float32 for c in f.values)
    i = make(s, 0, aggregation="mean")
    with pytest.raises(TypeError):
        call(s, how, lambda x: x.assign(jnp.asarray(1.5), read_value=False), i)
    assert comps(i) == [0] * n


# -- strategies must match -----------------------------------------------------------------------
@pytest.mark.parametrize("how", HOW)
def test_variable_of_another_strategy_in_run_raises(how):
    a, b = S(2), S(4)
    v = make(a, 1.0, aggregation="mean")
    r = make(a, 1.0, synchronization="on_read", aggregation="sum")
    for var in (v, r):
        with pytest.raises(ValueError):
            call(b, how, lambda x: x.read_value(), var)
        with pytest.raises(ValueError):
            call(b, how, lambda x: x.assign_add(1.0, read_value=False), var)
    other2 = mirrored(2)  # same devices, another strategy object
    with pytest.raises(ValueError):
        call(other2, how, lambda x: x + 1, v)
    with pytest.raises(ValueError):
        call(one_device(), how, lambda x: x + 1, v)
    assert comps(v) == [1.0] * 2 and comps(r) == [1.0] * 2


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("n", NS)
def test_plain_variable_readable_but_not_assignable_in_a_multi_replica_run(n, how):
    s = S(n)
    p = jm.Variable(jnp.array([1.0, 2.0]))
    out = call(s, how, lambda x: x * (rid() + 1.0), p)
    assert local(s, out) == [[i + 1.0, 2.0 * (i + 1)] for i in range(n)]
    for method in ["assign", "assign_add", "assign_sub"]:
        with pytest.raises(ValueError):
            call(s, how, lambda x: getattr(x, method)(jnp.ones(2), read_value=False), p)
    assert p.numpy().tolist() == [1.0, 2.0]


@pytest.mark.parametrize("how", HOW)
def test_plain_variable_assignable_in_one_device_run(how):
    p = jm.Variable(1.0)
    out = call(one_device(), how, lambda x: x.assign_add(2.0).read_value(), p)
    assert float(out) == 3.0 and float(p.numpy()) == 3.0


# -- repr ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", NS)
def test_repr(n):
    s = S(n)
    v = make(s, 1.0)
    text = repr(v)
    assert text.startswith("MirroredVariable:{")
    assert "'Variable:0'" in text and "Variable/replica_1:0" in text
    assert f"Variable/replica_{n - 1}:0" in text and f"Variable/replica_{n}:0" not in text
    r = make(s, 2.0, synchronization="on_read", aggregation="sum", name="total")
    assert repr(r).startswith("SyncOnReadVariable:{") and "total/replica_1:0" in repr(r)
    assert repr(jm.Variable(1.0)).startswith("<jaxmirror.Variable 'Variable:0'")


# -- read_values / assign_values -----------------------------------------------------------------
@pytest.mark.parametrize("where", ["none", "one", 2, 4])
def test_read_and_assign_values_eagerly(where):
    if where == "none":
        w = jm.Variable(jnp.array([1.0, 2.0]))
    else:
        s = one_device() if where == "one" else S(where)
        w = make(s, jnp.array([1.0, 2.0]), aggregation="mean")
    params = {"w": w, "b": jnp.float32(0.5), "nested": [np.float32(3.0)]}
    vals = jm.read_values(params)
    assert isinstance(vals["w"], jax.Array) and vals["w"].tolist() == [1.0, 2.0]
    assert float(vals["b"]) == 0.5 and float(vals["nested"][0]) == 3.0
    new = jax.tree.map(lambda x: x * 2, vals)
    out = jm.assign_values(params, new)
    assert out["w"] is w
    assert w.numpy().tolist() == [2.0, 4.0]
    if where not in ("none", "one"):
        assert comps(w) == [[2.0, 4.0]] * where
    assert float(out["b"]) == 1.0 and float(out["nested"][0]) == 6.0
    assert float(params["b"]) == 0.5  # arrays are replaced in the returned tree, not in place


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("n", NS)
def test_read_and_assign_values_inside_run(n, how):
    s = S(n)
    w = make(s, jnp.array([1.0, 2.0]), aggregation="mean")
    r = make(s, 0.0, synchronization="on_read", aggregation="sum")
    params = {"w": w, "r": r, "b": jnp.float32(0.5)}

    def fn(tree):
        vals = jm.read_values(tree)
        new = {"w": vals["w"] * (rid() + 1.0), "r": vals["r"] + rid() + 1.0, "b": vals["b"] + 1}
        out = jm.assign_values(tree, new)
        assert out["w"] is w and out["r"] is r
        return out["b"], jm.read_values(out)

    if how == "arg":
        b, after = s.run(fn, args=(params,))
    else:
        b, after = s.run(lambda: fn(params))
    mean = (n + 1) / 2
    assert float(b) == 1.5
    assert comps(w) == [[mean, 2 * mean]] * n
    assert comps(r) == [i + 1.0 for i in range(n)]
    assert local(s, after["w"]) == [[mean, 2 * mean]] * n
    assert local(s, after["r"]) == [i + 1.0 for i in range(n)]


# -- reduce and local results of variables -------------------------------------------------------
@pytest.mark.parametrize("n", NS)
def test_reduce_and_local_results_of_variables(n):
    s = S(n)
    v = make(s, jnp.array([1.0, 2.0]), aggregation="mean")
    assert s.reduce("sum", v, axis=None).tolist() == [n * 1.0, n * 2.0]
    assert s.reduce("mean", v, axis=None).tolist() == [1.0, 2.0]
    assert s.reduce("sum", v, axis=0).tolist() == n * 3.0
    results = s.experimental_local_results(v)
    assert isinstance(results, tuple) and len(results) == n
    assert [np.asarray(c).tolist() for c in results] == [[1.0, 2.0]] * n

    for agg in ["sum", "mean", "only_first_replica"]:
        r = make(s, 0.0, synchronization="on_read", aggregation=agg)
        s.run(lambda: r.assign(rid() + 1.0, read_value=False))
        assert float(s.reduce("sum", r, axis=None)) == tri(n)
        assert float(s.reduce("mean", r, axis=None)) == tri(n) / n
        results = s.experimental_local_results(r)
        assert isinstance(results, tuple) and local(s, r) == [i + 1.0 for i in range(n)]

    d = make(s, 0.0)  # diverged mirrored variable: its components
    s.run(lambda: d.assign(rid() + 1.0, read_value=False))
    assert local(s, d) == [i + 1.0 for i in range(n)]
    assert float(s.reduce("sum", d, axis=None)) == tri(n)


def test_reduce_of_variables_with_one_replica():
    for s in (S(1), one_device()):
        v = make(s, 2.0, aggregation="sum")
        assert float(s.reduce("sum", v, axis=None)) == 2.0
        assert float(s.reduce("mean", v, axis=None)) == 2.0
        assert len(s.experimental_local_results(v)) == 1
