"""What the multi-worker tests run: in worker processes (``jaxmirror.launch.run``) and, for the
one-process reference, in the test process with a 4-device ``MirroredStrategy``.

Not a test module and free of ``conftest`` imports: workers import it to find these functions,
and they have their own device counts.
"""

import numpy as np


def _local(strategy, value):
    return [np.asarray(c) for c in strategy.experimental_local_results(value)]


def _mlp_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 6)).astype(np.float32)
    y = (x @ rng.normal(size=(6, 3))).argmax(1).astype(np.int32)
    return x, y


def _init_params():
    rng = np.random.default_rng(1)
    return {"w1": (rng.normal(size=(6, 8)) * 0.5).astype(np.float32),
            "b1": np.zeros(8, np.float32),
            "w2": (rng.normal(size=(8, 3)) * 0.5).astype(np.float32),
            "b2": np.zeros(3, np.float32)}


def train_mlp(strategy, epochs=2, batch=16):
    """TF's custom-training loop: global batches of 16 (the last of each epoch has 2 rows),
    ``compute_average_loss``, all-reduced gradients, SGD. Returns per-step losses and params."""
    import jax
    import jax.numpy as jnp
    import optax

    import jaxmirror as jm

    x, y = _mlp_data()
    batches = [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(x), batch)]
    dataset = strategy.experimental_distribute_dataset(batches)
    params = strategy.experimental_replicate(jax.tree.map(jnp.asarray, _init_params()))

    def loss_fn(p, xb, yb):
        h = jax.nn.relu(xb @ p["w1"] + p["b1"])
        logits = h @ p["w2"] + p["b2"]
        per_example = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
        return jm.compute_average_loss(per_example, global_batch_size=batch)

    @strategy.run
    def step(p, xb, yb):
        loss, grads = jax.value_and_grad(loss_fn)(p, xb, yb)
        grads = jm.get_replica_context().all_reduce("SUM", grads)
        return jax.tree.map(lambda a, g: a - 0.5 * g, p, grads), loss

    losses = []
    for _ in range(epochs):
        for xb, yb in dataset:
            params, loss = step(params, xb, yb)
            losses.append(float(strategy.reduce("SUM", loss, axis=None)))
    return {"losses": np.asarray(losses),
            "params": {k: np.asarray(v) for k, v in params.items()}}


def collectives(strategy):
    """run, local results, reduce, gather, all_reduce/all_gather, merge_call, variables,
    the input pipeline (uneven and partial batches), extended.*: numbers to compare."""
    import jax
    import jax.numpy as jnp

    import jaxmirror as jm

    ctx = jm.get_replica_context
    out = {"num_replicas": strategy.num_replicas_in_sync,
           "worker_devices": len(strategy.extended.worker_devices),
           "should_checkpoint": strategy.extended.should_checkpoint}
    v = strategy.run(lambda: (ctx().replica_id_in_sync_group + 1.0) * jnp.arange(1.0, 3.0))
    out["local"] = _local(strategy, v)
    out["reduce_sum"] = np.asarray(strategy.reduce("SUM", v, axis=None))
    out["reduce_mean_axis0"] = np.asarray(strategy.reduce("MEAN", v, axis=0))
    out["gather"] = np.asarray(strategy.gather(v, axis=0))
    out["all_reduce"] = _local(strategy, strategy.run(
        lambda: ctx().all_reduce("SUM", ctx().replica_id_in_sync_group * 1.0)))
    out["all_gather"] = _local(strategy, strategy.run(
        lambda: ctx().all_gather(jnp.full((1,), ctx().replica_id_in_sync_group * 1.0), 0)))

    out["all_reduce_mean_nest"] = jax.tree.map(np.asarray, strategy.run(lambda: ctx().all_reduce(
        "MEAN", {"int": ctx().replica_id_in_sync_group,
                 "vec": jnp.arange(3.0) * ctx().replica_id_in_sync_group,
                 "half": jnp.float16(ctx().replica_id_in_sync_group)})))
    out["all_reduce_sum_nest"] = jax.tree.map(np.asarray, strategy.run(lambda: ctx().all_reduce(
        "SUM", [ctx().replica_id_in_sync_group, jnp.ones((2, 2)) * ctx().replica_id_in_sync_group])))

    def merge_fn(s, x):
        return s.reduce("SUM", x, axis=None)

    out["merge_call"] = np.asarray(strategy.run(
        lambda: ctx().merge_call(merge_fn, args=(ctx().replica_id_in_sync_group * 2.0,))))
    with strategy.scope():
        mirrored = jm.Variable(jnp.arange(3.0))
        total = jm.Variable(0.0, synchronization="on_read", aggregation="sum")
        mean = jm.Variable(0.0, synchronization="on_read", aggregation="mean")

    def update():
        rid = ctx().replica_id_in_sync_group * 1.0
        mirrored.assign_add(ctx().all_reduce("SUM", jnp.ones(3) * rid))
        total.assign(rid + 1.0)
        mean.assign(rid * 3.0)

    strategy.run(update)
    out["mirrored"] = np.asarray(mirrored.read_value())
    out["sync_sum"] = float(total.read_value())
    out["sync_mean"] = float(mean.read_value())
    out["sync_local"] = _local(strategy, total)
    data = np.arange(54.0, dtype=np.float32).reshape(27, 2)
    batches = [data[:10], data[10:20], data[20:]]  # 10, 10 and 7 rows over 4 replicas
    seen, sums, local_rows = [], [], []
    for b in strategy.experimental_distribute_dataset(batches):
        seen.append(np.asarray(strategy.gather(b, axis=0)))
        sums.append(np.asarray(strategy.reduce("SUM", b, axis=0)))
        local_rows.append(_local(strategy, b))
    out["dataset_seen"], out["dataset_sums"], out["dataset_local"] = seen, sums, local_rows
    return out


def pipelines(strategy):
    """``distribute_datasets_from_function``: each input pipeline's own data, uneven lengths
    and a partial last step; what every step gathered, and the contexts seen."""
    contexts = []

    def dataset_fn(context):
        contexts.append((context.num_input_pipelines, context.input_pipeline_id,
                         context.num_replicas_in_sync))
        pid = context.input_pipeline_id
        rows = np.arange(7.0 + 2 * pid, dtype=np.float32) + 100.0 * pid
        per_replica = context.get_per_replica_batch_size(8)
        return [rows[i:i + per_replica] for i in range(0, len(rows), per_replica)]

    dataset = strategy.distribute_datasets_from_function(dataset_fn)
    steps = [np.asarray(strategy.gather(b, axis=0)) for b in dataset]
    return {"contexts": contexts, "steps": steps}


def save_trained(strategy, path):
    """Train, then save the params (as mirrored variables) and the loss history."""
    import jaxmirror as jm

    result = train_mlp(strategy, epochs=1)
    with strategy.scope():
        variables = {k: jm.Variable(v) for k, v in result["params"].items()}
    jm.checkpoint.save(path, {"params": variables, "losses": result["losses"]})
    return result


def restore_params(strategy, path):
    """Restore saved params into this strategy's variables; their values."""
    import jax.numpy as jnp

    import jaxmirror as jm

    shapes = {k: v.shape for k, v in _init_params().items()}
    with strategy.scope():
        target = {k: jm.Variable(jnp.zeros(s)) for k, s in shapes.items()}
    jm.checkpoint.restore(path, {"params": target, "losses": jnp.zeros(4)})
    return {k: np.asarray(v.read_value()) for k, v in target.items()}


def communication_options(strategy):
    """``all_reduce`` and ``reduce_to`` with ``CommunicationOptions``: packs of 16 bytes, a
    bfloat16 wire, and the defaults; the sums as lists."""
    import jax.numpy as jnp

    import jaxmirror as jm

    options = {"default": None,
               "packs": jm.experimental.CommunicationOptions(bytes_per_pack=16),
               "bfloat16": jm.experimental.CommunicationOptions(wire_dtype="bfloat16")}
    out = {}
    for name, option in options.items():
        @strategy.function
        def step():
            ctx = jm.get_replica_context()
            i = ctx.replica_id_in_sync_group + 1.0
            return ctx.all_reduce("sum", {"a": jnp.arange(10.0) / 3 * i, "b": i, "c": jnp.int32(2)},
                                  options=option)
        result = step()
        out[name] = [np.asarray(result[k]).tolist() for k in "abc"]
    ids = strategy.run(lambda: jm.get_replica_context().replica_id_in_sync_group + 1.0)
    out["reduce_to"] = float(strategy.extended.reduce_to("mean", ids, "CPU:0",
                                                         options=options["packs"]))
    return out


def in_worker(name, *args):
    """Run scenario ``name`` on a ``MultiWorkerMirroredStrategy`` made from this worker's
    ``TF_CONFIG``; returns the worker's index and the scenario's result."""
    import jax

    import jaxmirror as jm

    strategy = jm.MultiWorkerMirroredStrategy(
        communication_options=jm.experimental.CommunicationOptions(timeout_seconds=60))
    result = globals()[name](strategy, *args)
    return jax.process_index(), result


def joined_by_hand():
    """``jax.distributed`` started by the user: a matching strategy reuses it, a resolver that
    disagrees gets a clear error; then ``Server`` joins the cluster and ``join()`` shuts it down."""
    import json
    import os

    import jax

    import jaxmirror as jm

    config = json.loads(os.environ["TF_CONFIG"])
    workers, index = config["cluster"]["worker"], config["task"]["index"]
    jax.distributed.initialize(workers[0], len(workers), index)
    spec = jm.cluster_resolver.ClusterSpec({"worker": workers})
    wrong = jm.cluster_resolver.SimpleClusterResolver(spec, task_type="worker",
                                                      task_id=len(workers) - 1 - index)
    try:
        jm.MultiWorkerMirroredStrategy(wrong)
        mismatch = None
    except RuntimeError as error:
        mismatch = str(error)
    server = jm.Server(jm.cluster_resolver.TFConfigClusterResolver())
    strategy = jm.MultiWorkerMirroredStrategy()
    strategy.experimental_initialize()
    total = float(strategy.reduce("SUM", strategy.run(lambda: jax.numpy.float32(1.0)),
                                  axis=None))
    server.join()  # every task arrives, then the runtime shuts down
    return {"mismatch": mismatch, "total": total, "target": server.target,
            "initialized_after": jax.distributed.is_initialized()}


def file_sharded(strategy, paths, policy):
    """A ``FileDataset`` over ``paths`` (files of 5, 3, 6 and 2 rows), global batch 8: what every
    step gathered, per-step sums of a step's real rows, and this worker's files."""
    import jax.numpy as jnp

    import jaxmirror as jm

    dataset = jm.experimental.FileDataset(paths, np.load, batch_size=8)
    options = jm.InputOptions(auto_shard_policy=getattr(jm.experimental.AutoShardPolicy, policy))
    steps, totals = [], []
    for batch in strategy.experimental_distribute_dataset(dataset, options):
        steps.append(np.asarray(strategy.gather(batch, axis=0)))
        total = strategy.run(lambda x: jnp.sum(x * jm.get_replica_context().batch_mask),
                             args=(batch,))
        totals.append(float(strategy.reduce("SUM", total, axis=None)))
    return {"steps": steps, "totals": totals}
