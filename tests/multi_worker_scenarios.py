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


def init_params():
    """The MLP's initial parameters (NumPy arrays), the same in every process."""
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
    params = strategy.experimental_replicate(jax.tree.map(jnp.asarray, init_params()))

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

    shapes = {k: v.shape for k, v in init_params().items()}
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


# -- uneven input across workers (issue 27) ------------------------------------------------------
def worker_batches(worker, count, rows=8):
    """Worker ``worker``'s own data: ``count`` global batches of ``rows`` rows."""
    rng = np.random.default_rng(10 + worker)
    return [(rng.normal(size=(rows, 6)).astype(np.float32),
             rng.integers(0, 3, size=rows).astype(np.int32)) for _ in range(count)]


def _forward(p, x):
    import jax

    return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def train_variables(strategy, dataset, fused=False):
    """TF's custom-training loop on variables: ``compute_average_loss``, all-reduced
    gradients, SGD, an accuracy metric; single steps or fused ones (2 per call). Returns the
    per-step summed losses, the params, the accuracy and each step's local real rows."""
    import jax
    import optax

    import jaxmirror as jm

    with strategy.scope():
        params = {k: jm.Variable(v) for k, v in init_params().items()}
        accuracy = jm.metrics.SparseCategoricalAccuracy()

    def step(x, y):
        p = jm.read_values(params)

        def loss_fn(p):
            logits = _forward(p, x)
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
            return jm.compute_average_loss(per_example), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(p)
        grads = jm.get_replica_context().all_reduce("SUM", grads)
        jm.assign_values(params, jax.tree.map(lambda a, g: a - 0.5 * g, p, grads))
        accuracy.update_state(y, logits)
        return loss

    losses = []
    if fused:
        steps = strategy.function(lambda batch: step(*batch), steps_per_execution=2)
        iterator = iter(dataset)
        while True:
            try:
                loss = steps(iterator)
            except StopIteration:
                break
            losses += [float(v) for v in np.asarray(strategy.reduce("SUM", loss, axis=None))]
    else:
        run = strategy.function(step)
        for x, y in dataset:
            losses.append(float(strategy.reduce("SUM", run(x, y), axis=None)))
    kept = [(np.concatenate(_local(strategy, x)), np.concatenate(_local(strategy, y)))
            for x, y in dataset]  # a second pass: what each step gave this worker's replicas
    return {"losses": np.asarray(losses), "accuracy": float(accuracy.result()),
            "params": {k: np.asarray(v.read_value()) for k, v in params.items()}, "kept": kept}


def sync_batch_norm(strategy, dataset):
    """A pass of ``jaxmirror.nn.SyncBatchNorm`` over the batches' ``x``: its running mean and
    variance after it (one device's ``nnx.BatchNorm`` on the same rows gives them too)."""
    from flax import nnx

    import jaxmirror as jm

    graphdef, state = nnx.split(jm.nn.SyncBatchNorm(6, momentum=0.9, rngs=nnx.Rngs(0)))

    @strategy.run
    def step(state, x):
        model = nnx.merge(graphdef, state)
        model(x)
        return nnx.split(model)[1]

    for x, _ in dataset:
        state = step(state, x)
    return np.asarray(state["mean"][...]), np.asarray(state["var"][...])


def batch_norm_reference(batches):
    """``sync_batch_norm``'s numbers from flax's BatchNorm on one device."""
    import jax.numpy as jnp
    from flax import nnx

    model = nnx.BatchNorm(6, momentum=0.9, rngs=nnx.Rngs(0))
    for x, _ in batches:
        model(jnp.asarray(x))
    return np.asarray(model.mean[...]), np.asarray(model.var[...])


def uneven(strategy, counts, source="dataset", fused=False):
    """Worker ``w`` has ``counts[w]`` batches of its own: TF's loop over them, then an
    evaluation all-reduce; the loop's results (``train_variables``) and the evaluation's."""
    import jax

    import jaxmirror as jm

    mine = worker_batches(jax.process_index(), counts[jax.process_index()])
    if source == "dataset":
        dataset = strategy.experimental_distribute_dataset(mine)
    else:  # per-replica batches of 2 rows, from this worker's rows in order
        def dataset_fn(context):
            assert context.num_input_pipelines == jax.process_count()
            per = context.get_per_replica_batch_size(8)
            rows = [(x[i:i + per], y[i:i + per]) for x, y in mine for i in range(0, 8, per)]
            return rows
        dataset = strategy.distribute_datasets_from_function(dataset_fn)
    out = train_variables(strategy, dataset, fused)
    out["batch_norm"] = sync_batch_norm(strategy, dataset)
    ctx = jm.get_replica_context
    out["evaluation"] = float(strategy.reduce("SUM", strategy.run(
        lambda: ctx().all_reduce("SUM", ctx().replica_id_in_sync_group + 1.0)), axis=None))
    return out


def placed_values(strategy):
    """Values each worker gives differently (TF's habit: unseeded initial values), placed on
    every worker's devices: TF broadcasts the chief's, and so does jaxmirror."""
    import jax
    import jax.numpy as jnp

    import jaxmirror as jm

    me = jax.process_index()
    with strategy.scope():
        differs = jm.Variable(np.full(3, float(me), np.float32))
        same = jm.Variable(np.arange(3.0, dtype=np.float32))
    replicated = strategy.experimental_replicate({"a": np.full(2, 10.0 + me, np.float32),
                                                  "b": np.arange(2, dtype=np.int32)})
    scalar = strategy.extended.placement.replicate(1.5 + me)  # a number: weakly typed, as JAX
    total = strategy.run(lambda: jm.get_replica_context().all_reduce("SUM", differs.read_value()))
    # A host value of each worker, reduced: TF all-reduces it across the workers.
    host, ext = 1.0 + me, strategy.extended
    reduced = {"mean": float(strategy.reduce("MEAN", host, axis=None)),
               "mean_to": float(ext.reduce_to("MEAN", host, destinations=differs)),
               "sum_axis": float(strategy.reduce("SUM", np.array([host, 2 * host]), axis=0))}
    try:
        reduced["sum"] = float(strategy.reduce("SUM", host, axis=None))
        reduced["sum_to"] = float(ext.reduce_to("SUM", host, destinations=differs))
    except ValueError as e:  # several replicas on this worker: identical copies, as on one
        reduced["sum"] = str(e)
    return {"reduced": reduced,"differs": np.asarray(differs.read_value()), "same": np.asarray(same.read_value()),
            "a": np.asarray(replicated["a"]), "b": np.asarray(replicated["b"]),
            "scalar": float(scalar), "scalar_weak": bool(scalar.weak_type),
            "scalar_times_bf16": str((scalar * jnp.ones(1, jnp.bfloat16)).dtype),
            "total": np.asarray(total)}
