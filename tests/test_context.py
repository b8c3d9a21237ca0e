"""TF's context rules: which strategy and replica context are current where."""

import jax.numpy as jnp
import pytest

import jaxmirror as jm
from conftest import mirrored


def _observe():
    ctx = jm.get_replica_context()
    return (ctx, jm.in_cross_replica_context(), jm.has_strategy(), jm.get_strategy())


def test_outside_any_scope():
    ctx, cross, has, strategy = _observe()
    assert isinstance(ctx, jm.ReplicaContext)
    assert ctx.replica_id_in_sync_group == 0 and isinstance(ctx.replica_id_in_sync_group, int)
    assert ctx.num_replicas_in_sync == 1
    assert (cross, has) == (False, False)
    assert strategy.num_replicas_in_sync == 1
    assert strategy is jm.get_strategy()  # one default strategy
    assert jm.get_cross_replica_context() is None  # TF: the default replica context


def test_inside_scope():
    s = mirrored(2)
    with s.scope() as entered:
        assert entered is s
        ctx, cross, has, strategy = _observe()
        assert (ctx, cross, has, strategy) == (None, True, True, s)
        assert jm.get_cross_replica_context() is s
    assert not jm.has_strategy()


def test_inside_run():
    s = mirrored(4)
    seen = {}

    def fn():
        ctx, cross, has, strategy = _observe()
        seen.update(ctx=ctx, cross=cross, has=has, strategy=strategy,
                    crossctx=jm.get_cross_replica_context())
        return ctx.replica_id_in_sync_group

    ids = s.run(fn)
    assert seen["ctx"].strategy is s and seen["ctx"].num_replicas_in_sync == 4
    assert (seen["cross"], seen["has"], seen["strategy"], seen["crossctx"]) == (False, True, s, None)
    assert [int(i) for i in s.experimental_local_results(ids)] == [0, 1, 2, 3]
    # Context is restored after run, also after a failing run.
    assert not jm.has_strategy()
    with pytest.raises(ZeroDivisionError):
        s.run(lambda: 1 / 0)
    assert not jm.has_strategy() and not jm.in_cross_replica_context()


def test_replica_id_is_traced_int32_and_num_replicas_python_int():
    s = mirrored(2)
    kinds = {}

    def fn():
        ctx = jm.get_replica_context()
        kinds["id"] = ctx.replica_id_in_sync_group
        kinds["n"] = ctx.num_replicas_in_sync
        return ctx.replica_id_in_sync_group

    s.run(fn)
    assert kinds["id"].dtype == jnp.int32 and kinds["id"].shape == ()
    assert type(kinds["n"]) is int and kinds["n"] == 2


def test_reentering_same_scope_is_counted():
    s = mirrored(2)
    with s.scope():
        with s.scope():
            assert jm.get_strategy() is s
        assert jm.get_strategy() is s and jm.in_cross_replica_context()
    assert not jm.has_strategy()


def test_same_scope_inside_run_keeps_replica_context():
    s = mirrored(2)

    def fn():
        with s.scope():
            assert jm.get_replica_context() is not None
            return jm.get_replica_context().all_reduce("sum", 1.0)

    assert float(s.run(fn)) == 2.0


def test_mixing_scopes_raises():
    a, b = mirrored(2), mirrored(4)
    with a.scope():
        with pytest.raises(RuntimeError, match=r"Mixing different jaxmirror Strategy objects: .* is not "):
            with b.scope():
                pass
        assert jm.get_strategy() is a


def test_other_strategys_run_inside_scope_raises():
    a, b = mirrored(2), mirrored(4)
    with a.scope():
        with pytest.raises(RuntimeError, match="Mixing different jaxmirror Strategy objects"):
            b.run(lambda: 1.0)
        assert float(a.run(lambda: jm.get_replica_context().all_reduce("sum", 1.0))) == 2.0


def test_run_inside_run_raises():
    s = mirrored(2)
    with pytest.raises(RuntimeError, match="merge_call"):
        s.run(lambda: s.run(lambda: 1.0))
    other = mirrored(4)
    with pytest.raises(RuntimeError):
        s.run(lambda: other.run(lambda: 1.0))


def test_default_strategy_scope_inside_scope_raises():
    s = mirrored(2)
    default = jm.get_strategy()
    with s.scope():
        with pytest.raises(RuntimeError, match="Must not nest"):
            with default.scope():
                pass


def test_experimental_set_strategy():
    s = mirrored(2)
    jm.experimental_set_strategy(s)
    try:
        assert jm.get_strategy() is s and jm.in_cross_replica_context() and jm.has_strategy()
        jm.experimental_set_strategy(s)  # setting again is fine
        assert jm.get_strategy() is s
    finally:
        jm.experimental_set_strategy(None)
    assert not jm.has_strategy() and jm.get_replica_context() is not None


def test_experimental_set_strategy_inside_scope_raises():
    s = mirrored(2)
    with s.scope():
        with pytest.raises(RuntimeError, match="Must not be called inside"):
            jm.experimental_set_strategy(s)
    assert not jm.has_strategy()


def test_contexts_are_per_thread():
    import threading

    s = mirrored(2)
    seen = []
    with s.scope():
        t = threading.Thread(target=lambda: seen.append(jm.has_strategy()))
        t.start()
        t.join()
    assert seen == [False]


def test_default_replica_context_collectives_return_input():
    ctx = jm.get_replica_context()
    value = {"a": jnp.arange(3), "b": 2}
    assert ctx.all_reduce("mean", value) is value
    assert ctx.all_reduce(jm.ReduceOp.SUM, 7) == 7
    x = jnp.ones((2, 3))
    assert ctx.all_gather(x, axis=1) is x
    with pytest.raises(ValueError, match="'MAX' is not a valid ReduceOp"):
        ctx.all_reduce("MAX", 1.0)
    with pytest.raises(ValueError, match="rank >= 1"):
        ctx.all_gather(jnp.float32(1), axis=0)


def test_experimental_set_strategy_to_the_default_and_back():
    # TF: setting the default strategy enters its scope (its variable creator refuses another
    # strategy's variables) and `experimental_set_strategy(None)` leaves it again.
    s, default = mirrored(2), jm.get_strategy()
    jm.experimental_set_strategy(default)
    try:
        assert jm.get_strategy() is default and not jm.has_strategy()
        jm.experimental_set_strategy(default)  # setting again is fine
        with pytest.raises(RuntimeError, match="Mixing different"):
            with s.scope():
                jm.Variable(1.0)
    finally:
        jm.experimental_set_strategy(None)
    with s.scope():
        v = jm.Variable(1.0)
    assert [float(x) for x in s.experimental_local_results(v)] == [1.0, 1.0]
    jm.experimental_set_strategy(default)
    jm.experimental_set_strategy(s)  # from the default straight to another strategy
    try:
        assert jm.get_strategy() is s and jm.has_strategy()
    finally:
        jm.experimental_set_strategy(None)
    assert not jm.has_strategy()


def test_default_scope_left_from_another_thread():
    # a default scope whose generator is finished elsewhere (the garbage collector's thread,
    # or at interpreter exit) still leaves the scope of the thread that entered it
    import threading

    s, scope = mirrored(2), jm.get_strategy().scope()
    scope.__enter__()
    errors = []

    def leave():
        try:
            scope.__exit__(None, None, None)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=leave)
    t.start()
    t.join()
    assert errors == []
    with s.scope():
        v = jm.Variable(2.0)
    assert [float(x) for x in s.experimental_local_results(v)] == [2.0, 2.0]
