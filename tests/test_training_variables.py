"""TF-style training with variables equals single-device training, step for step.

Variables are created in the strategy's scope and updated inside ``run`` in the three ways TF
users write it: the StrategyExtended recipe (merge_call + reduce_to + update), a SUM-aggregated
``assign_sub`` of local gradients, and optax on pytrees of variables.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmirror as jm
from conftest import mirrored
from test_training import batches, init_params, per_example_loss, single_device

LR = 0.1


def loss_and_local_grads(params, batch):
    def loss_fn(p):
        return jm.compute_average_loss(per_example_loss(p, batch["x"], batch["y"]))

    return jax.value_and_grad(loss_fn)(params)


def make_variables(strategy, tree, **kwargs):
    with strategy.scope():
        return jax.tree.map(lambda x: jm.Variable(x, **kwargs), tree)


def check_equal(strategy, variables, losses, ref_params, ref_losses):
    np.testing.assert_allclose(losses, ref_losses, atol=2e-5, rtol=0)
    for var, want in zip(jax.tree.leaves(variables), jax.tree.leaves(ref_params)):
        assert isinstance(var, jm.MirroredVariable if strategy.num_replicas_in_sync > 1
                          else jm.Variable)
        for component in (var.values if isinstance(var, jm.DistributedValues) else [var.numpy()]):
            np.testing.assert_allclose(component, want, atol=2e-5, rtol=0)


def train(strategy, step):
    losses, counts = [], []
    for batch in strategy.experimental_distribute_dataset(batches()):
        loss = step(batch)
        losses.append(float(strategy.reduce("sum", loss, axis=None)))
        counts.append(step.trace_count)
    # Traced on the first call only (variables found by closure included), never after.
    assert counts == [counts[0]] * len(counts)
    return losses


@pytest.mark.parametrize("make", [lambda: mirrored(2), lambda: mirrored(4),
                                  lambda: jm.OneDeviceStrategy("CPU:0")])
def test_strategy_extended_recipe_merge_call_reduce_to_update(make):
    strategy = make()
    ref_params, ref_losses = single_device(optax.sgd(LR))
    variables = make_variables(strategy, init_params(jax.random.key(1)))

    def merge_fn(strategy, grads_and_vars):
        for g, v in grads_and_vars:
            g = strategy.extended.reduce_to(jm.VariableAggregation.SUM, g, destinations=v)
            strategy.extended.update(v, lambda var, g: var.assign_sub(LR * g), args=(g,))

    @strategy.function
    def step(batch):
        loss, grads = loss_and_local_grads(jm.read_values(variables), batch)
        pairs = list(zip(jax.tree.leaves(grads), jax.tree.leaves(variables)))
        jm.get_replica_context().merge_call(merge_fn, args=(pairs,))
        return loss

    losses = train(strategy, step)
    check_equal(strategy, variables, losses, ref_params, ref_losses)


@pytest.mark.parametrize("n", [2, 4])
def test_sum_aggregated_variables_take_local_gradients(n):
    strategy = mirrored(n)
    ref_params, ref_losses = single_device(optax.sgd(LR))
    variables = make_variables(strategy, init_params(jax.random.key(1)), aggregation="sum")

    @strategy.function
    def step(batch):
        loss, grads = loss_and_local_grads(jm.read_values(variables), batch)
        # SUM aggregation: old - sum over replicas of each replica's LR * local gradient.
        jax.tree.map(lambda v, g: v.assign_sub(LR * g), variables, grads)
        return loss

    losses = train(strategy, step)
    check_equal(strategy, variables, losses, ref_params, ref_losses)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("passed", [False, True], ids=["closure", "argument"])
def test_optax_adam_on_pytrees_of_variables(n, passed):
    strategy = mirrored(n)
    tx = optax.adam(1e-2)
    ref_params, ref_losses = single_device(optax.adam(1e-2))
    params0 = init_params(jax.random.key(1))
    params = make_variables(strategy, params0)
    opt_state = make_variables(strategy, tx.init(params0))

    def update(params, opt_state, batch):
        p = jm.read_values(params)
        loss, grads = loss_and_local_grads(p, batch)
        grads = jm.get_replica_context().all_reduce("sum", grads)
        updates, new_state = tx.update(grads, jm.read_values(opt_state), p)
        jm.assign_values(params, optax.apply_updates(p, updates))
        jm.assign_values(opt_state, new_state)
        return loss

    if passed:
        run_step = strategy.function(update)
        step = lambda batch: run_step(params, opt_state, batch)  # noqa: E731
        step.trace_count = 0
        losses = []
        for batch in strategy.experimental_distribute_dataset(batches()):
            losses.append(float(strategy.reduce("sum", step(batch), axis=None)))
        assert run_step.trace_count == 1
    else:
        step = strategy.function(lambda batch: update(params, opt_state, batch))
        losses = train(strategy, step)
    check_equal(strategy, params, losses, ref_params, ref_losses)
    # The optimizer's step count is an int32 variable, mirrored like the rest.
    count = [v for v in jax.tree.leaves(opt_state) if v.dtype == jnp.int32][0]
    assert [int(c) for c in count.values] == [len(batches())] * n
