"""A worker of ``tests/test_preemption.py``: TF's preemption-tolerant custom training loop.

``python -m jaxmirror.launch --workers N [--max-restarts R] preemption_training.py CKPT OUT
STEPS SAVE_EVERY``: a linear model trained on 8-row global batches whose rows carry their
example ids, through a ``PreemptionCheckpointHandler`` over a ``CheckpointManager`` of the
variable and the distributed iterator. Each worker writes, under OUT: ``pid-<w>-<attempt>``,
``progress-<w>`` (calls made), ``seen-<w>-<attempt>`` (one line of example ids per step, this
worker's replicas' rows), ``exit-<w>-<attempt>`` (the run calls at a preemption exit) and, on
the chief, ``final-<attempt>.npy`` (the weights) when training ends.
"""

import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxmirror
from jaxmirror import checkpoint

CKPT, OUT, STEPS, SAVE_EVERY = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
SLEEP = float(os.environ.get("PREEMPTION_TEST_SLEEP", "0.3"))
GLOBAL = 8

strategy = jaxmirror.MultiWorkerMirroredStrategy()
me = jax.process_index()
attempt = os.environ.get("JAXMIRROR_LAUNCH_RESTART", "0")


def write(name, text, mode="w"):
    with open(os.path.join(OUT, name), mode) as f:
        f.write(text)


write(f"pid-{me}-{attempt}", str(os.getpid()))
rng = np.random.default_rng(0)
rows = STEPS * GLOBAL
x = rng.normal(size=(rows, 3)).astype(np.float32)
target = (x @ np.array([1.0, -2.0, 0.5], np.float32) + 0.1).astype(np.float32)
batches = [{"x": x[i:i + GLOBAL], "y": target[i:i + GLOBAL],
            "id": np.arange(i, i + GLOBAL, dtype=np.int32)} for i in range(0, rows, GLOBAL)]

with strategy.scope():
    w = jaxmirror.Variable(np.zeros(3, np.float32))
    b = jaxmirror.Variable(0.0)
iterator = iter(strategy.experimental_distribute_dataset(batches))


def replica_step(batch):
    def loss_fn(params):
        wv, bv = params
        per_example = (batch["x"] @ wv + bv - batch["y"]) ** 2
        return jaxmirror.compute_average_loss(per_example, global_batch_size=GLOBAL)

    grads = jax.grad(loss_fn)((w.read_value(), b.read_value()))
    grads = jaxmirror.get_replica_context().all_reduce("sum", grads)
    w.assign_sub(0.1 * grads[0])
    b.assign_sub(0.1 * grads[1])
    return batch["id"]


RAISE_AT = int(os.environ.get("PREEMPTION_TEST_RAISE_AT", "-1"))


def train_step(batch):
    if me == 1 and handler.total_run_calls == RAISE_AT:
        raise RuntimeError(f"worker 1 lost its disk at call {RAISE_AT}")
    return strategy.run(replica_step, args=(batch,))


def exit_fn():
    write(f"exit-{me}-{attempt}", str(handler.total_run_calls))
    sys.exit(42)


manager = checkpoint.CheckpointManager({"w": w, "b": b, "iterator": iterator}, CKPT,
                                       max_to_keep=2)
handler = jaxmirror.experimental.PreemptionCheckpointHandler(
    strategy.cluster_resolver, manager,
    termination_config=jaxmirror.experimental.TerminationConfig(exit_fn=exit_fn))
write(f"start-{me}-{attempt}", str(handler.total_run_calls))
if os.environ.get("PREEMPTION_TEST_EARLY_SIGTERM") == attempt:
    # The notice comes before this attempt's first step, while every worker still restores
    # (JAX's preemption service takes about a second to pass it on).
    if me == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(3)
while handler.total_run_calls < STEPS:
    ids = handler.run(train_step, next(iterator))
    local = [np.asarray(c).tolist() for c in strategy.experimental_local_results(ids)]
    write(f"seen-{me}-{attempt}", " ".join(str(i) for c in local for i in c) + "\n", "a")
    if SAVE_EVERY and handler.total_run_calls % SAVE_EVERY == 0:
        manager.save()
    write(f"progress-{me}", str(handler.total_run_calls))
    time.sleep(SLEEP)
final = np.concatenate([np.asarray(w.numpy()), np.asarray(b.numpy())[None]])
if me == 0:
    np.save(os.path.join(OUT, f"final-{attempt}.npy"), final)
print("trained", handler.total_run_calls, jnp.asarray(final).tolist(), flush=True)
