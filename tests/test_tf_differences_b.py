"""Issue 29 (part b): places where jaxmirror did differently from TF 2.21 without saying so.

Each test pins TF's behaviour (checked on TF 2.21), or, where jaxmirror keeps differing on
purpose, the difference and the error that says why.
"""

import numpy as np
import pytest

import jaxmirror as jm
from conftest import local, strategy


def rid():
    return jm.get_replica_context().replica_id_in_sync_group


# -- 11: ON_READ with trainable=True (TF 2 allows it; only TF 1's get_variable refuses) --------
@pytest.mark.parametrize("where", ["none", "one", 2])
def test_on_read_trainable_true_is_allowed(where):
    kwargs = dict(trainable=True, synchronization="on_read", aggregation="sum")
    if where == "none":
        v = jm.Variable(3.0, **kwargs)
    else:
        s = jm.OneDeviceStrategy("CPU:0") if where == "one" else strategy(where)
        with s.scope():
            v = jm.Variable(3.0, **kwargs)
    assert v.trainable is True
    assert v.synchronization is jm.VariableSynchronization.ON_READ
    if where == 2:
        assert isinstance(v, jm.SyncOnReadVariable)
        # A read in cross-replica context sums the components, as TF's SUM aggregation does.
        assert float(v.read_value()) == 6.0
    else:
        assert float(v.read_value()) == 3.0


# -- 15: get_cross_replica_context outside every scope is None (TF's default replica context) --
def test_get_cross_replica_context_is_none_outside_scopes():
    assert jm.get_cross_replica_context() is None
    assert jm.in_cross_replica_context() is False
    assert jm.get_replica_context().replica_id_in_sync_group == 0
    with jm.get_strategy().scope():  # the default strategy's scope changes none of this
        assert jm.get_cross_replica_context() is None
        assert jm.in_cross_replica_context() is False
        assert jm.get_replica_context() is not None
    s = strategy(2)
    with s.scope():
        assert jm.get_cross_replica_context() is s
    seen = {}

    def merge_fn(st):
        seen["merge"] = jm.get_cross_replica_context()

    def step():
        seen["run"] = jm.get_cross_replica_context()
        jm.get_replica_context().merge_call(merge_fn)
        return 0.0

    s.run(step)
    assert seen == {"run": None, "merge": s}
    # The default replica context's merge_call runs merge_fn in the default strategy's
    # cross-replica context.
    default = jm.get_strategy()
    assert jm.get_replica_context().merge_call(lambda st: jm.get_cross_replica_context()) is default


# -- 16: another strategy's scope inside the default strategy's scope -------------------------
def test_variable_in_other_scope_inside_default_scope_raises_mixing():
    s = strategy(2)
    default = jm.get_strategy()
    with default.scope():
        with s.scope():
            with pytest.raises(RuntimeError, match="Mixing different") as info:
                jm.Variable(1.0)
        message = str(info.value)
        # TF's order: the current strategy is not the default strategy whose scope is entered.
        assert message.index(repr(s)) < message.index(" is not ") < message.index(repr(default))
        v = jm.Variable(2.0)  # back in the default scope only: a plain variable
        assert v.distribute_strategy is default and float(v.numpy()) == 2.0
    with s.scope():  # outside the default scope: a mirrored variable, as before
        w = jm.Variable(3.0)
    assert isinstance(w, jm.MirroredVariable)
    assert [float(x) for x in local(s, w)] == [3.0, 3.0]


# -- 12: call_for_each_replica inside a merge_fn ----------------------------------------------
def test_call_for_each_replica_inside_merge_fn():
    s = strategy(2)
    seen = {}

    def per_replica(x):
        seen["cross"] = jm.in_cross_replica_context()
        return x * 2.0, rid()

    def merge_fn(st, x):
        doubled, ids = st.extended.call_for_each_replica(per_replica, args=(x,))
        assert jm.in_cross_replica_context()
        return st.reduce("sum", doubled, axis=None), ids

    def step():
        x = (rid() + 1).astype(np.float32)
        return jm.get_replica_context().merge_call(merge_fn, args=(x,))

    total, ids = s.run(step)
    assert seen["cross"] is False  # fn ran in a replica context
    assert [float(t) for t in local(s, total)] == [6.0, 6.0]  # (1 + 2) * 2
    assert [int(i) for i in local(s, ids)] == [0, 1]


def test_call_for_each_replica_inside_merge_fn_lets_exceptions_through():
    s = strategy(2)

    def boom(x):
        raise ValueError("boom from the replica function")

    def step():
        return jm.get_replica_context().merge_call(
            lambda st, x: st.extended.call_for_each_replica(boom, args=(x,)), args=(1.0,))

    with pytest.raises(ValueError, match="boom from the replica function"):
        s.run(step)
    assert not jm.has_strategy() and not jm.in_cross_replica_context()


def test_merge_call_inside_call_for_each_replica_inside_merge_fn():
    s = strategy(2)

    def inner(x):
        return jm.get_replica_context().merge_call(
            lambda st, y: st.reduce("sum", y, axis=None), args=(x,))

    def step():
        x = (rid() + 1).astype(np.float32)
        return jm.get_replica_context().merge_call(
            lambda st, y: st.extended.call_for_each_replica(inner, args=(y,)), args=(x,))

    assert [float(t) for t in local(s, s.run(step))] == [3.0, 3.0]


# -- 13: variables created by call_for_each_replica from the cross-replica context -------------
def _model_fn():
    # TF's mirrored_variable_test.testSingleVariable: made once, the replicas' creators merged.
    v = jm.Variable(1.0, name="foo")
    jm.get_replica_context().merge_call(lambda _: _)
    return v


def test_call_for_each_replica_creates_one_mirrored_variable():
    s = strategy(2)
    with s.scope():
        result = s.extended.call_for_each_replica(_model_fn)
    assert isinstance(result, jm.MirroredVariable)
    assert s.extended.variable_created_in_scope(result)
    assert [float(x) for x in local(s, result)] == [1.0, 1.0]
    # Differs on purpose: TF's name is "foo:0" (its graph tensor's name); jaxmirror's is the
    # name given (checkpoints, metrics and parameter servers key variables by it).
    assert result.name == "foo"
    assert [float(x) for x in local(s, s.run(lambda: result * 2.0))] == [2.0, 2.0]


def test_call_for_each_replica_creation_uses_the_first_replica_value():
    s = strategy(2)
    per_replica = s.experimental_distribute_values_from_function(
        lambda c: np.float32(c.replica_id_in_sync_group + 7))

    def model_fn(x):
        a = jm.Variable(lambda: (rid() * 10 + 5) * np.float32(1), name="a")
        return a, jm.Variable(x, name="b")

    a, b = s.extended.call_for_each_replica(model_fn, args=(per_replica,))  # outside any scope
    assert isinstance(a, jm.MirroredVariable) and isinstance(b, jm.MirroredVariable)
    assert a.distribute_strategy is s and b.distribute_strategy is s
    assert [float(x) for x in local(s, a)] == [5.0, 5.0]  # replica 0's initial value
    assert [float(x) for x in local(s, b)] == [7.0, 7.0]
    assert not jm.has_strategy()


def test_call_for_each_replica_creating_variables_refuses_computed_results():
    s = strategy(2)

    def model_fn():
        v = jm.Variable(1.0)
        return v.read_value() + rid()

    with pytest.raises(ValueError, match="call_for_each_replica: .* created variables"):
        s.extended.call_for_each_replica(model_fn)


def _creating(collective):
    def model_fn():
        v = jm.Variable(1.0)
        collective(jm.get_replica_context())
        return v
    return model_fn


@pytest.mark.parametrize("collective", [
    lambda ctx: ctx.all_reduce("sum", 1.0),
    lambda ctx: ctx.all_gather(np.ones(2, np.float32), axis=0),
    lambda ctx: ctx.merge_call(lambda st, x: x, args=(np.float32(rid()),)),
], ids=["all_reduce", "all_gather", "merge_call"])
def test_call_for_each_replica_creating_variables_refuses_collectives(collective):
    # TF's all_reduce("sum", 1.0) there gives N (every replica runs `fn`); replica 0 alone
    # would give 1.0, so the replica-0 run refuses what would need the other replicas.
    s = strategy(2)
    with pytest.raises(RuntimeError, match=r"call_for_each_replica: `fn` creates variables, so "
                                           r"it runs once, as replica 0, where `\w+` cannot"):
        s.extended.call_for_each_replica(_creating(collective))
    assert not jm.has_strategy() and jm.get_replica_context() is not None
    one = strategy(1)  # one replica: replica 0 is every replica, so TF's numbers
    v = one.extended.call_for_each_replica(
        lambda: jm.Variable(jm.get_replica_context().all_reduce("sum", 3.0)))
    assert [float(x) for x in local(one, v)] == [3.0]


def test_call_for_each_replica_creating_variables_runs_the_code_before_them_twice():
    # Documented: `fn` is first traced in a step (`run`), abandoned at the first variable, then
    # run eagerly as replica 0; what the trace stored outside `fn` is a tracer of a dead trace.
    s, log = strategy(2), []

    def model_fn():
        log.append(np.float32(2) * jm.get_replica_context().all_reduce("sum", 1.0))
        return jm.Variable(1.0)

    with pytest.raises(RuntimeError, match="`all_reduce` cannot"):
        s.extended.call_for_each_replica(model_fn)
    assert len(log) == 1  # the traced run's entry; the eager run stopped at its all_reduce
    doc = s.extended.call_for_each_replica.__doc__
    assert "twice" in doc and "abandoned" in doc


def test_variable_created_inside_run_still_raises_with_why():
    s = strategy(2)
    with pytest.raises(RuntimeError, match="created inside `run`.*traced once"):
        s.run(lambda: jm.Variable(1.0).read_value())

    def step():
        return jm.get_replica_context().merge_call(
            lambda st: st.extended.call_for_each_replica(lambda: jm.Variable(1.0).read_value()))

    with pytest.raises(RuntimeError, match="created inside `run`"):
        s.run(step)


def test_run_inside_merge_fn_points_to_call_for_each_replica():
    s = strategy(2)

    def step():
        return jm.get_replica_context().merge_call(lambda st: st.run(lambda: 1.0))

    with pytest.raises(RuntimeError, match="already running.*call_for_each_replica"):
        s.run(step)
