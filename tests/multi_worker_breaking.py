"""A training script that breaks in one of many ways, for ``python -m jaxmirror.launch``.

``python -m jaxmirror.launch --workers N --devices-per-worker K multi_worker_breaking.py MODE
[TIMEOUT]``: every worker trains a small all-reduce step in TF's loop; at step 3 the worker
named by MODE breaks. It prints ``BREAKING <unix time>`` just before, so that a test can time
how long the others take to end. Not a test module (the launcher runs it as a script).

Modes: ``raise-in-step`` (worker 1's step raises while it is traced for a new shape),
``raise-between`` (worker 1 raises between steps), ``raise-before`` (worker 1 raises before
its first collective), ``kill`` / ``kill-chief`` (worker 1 / the chief SIGKILLs itself),
``mismatch`` (worker 1 all-reduces 6 floats where the others all-reduce 4),
``chief-result`` / ``chief-save`` / ``chief-reduce`` (the chief alone reads a metric's result,
saves a checkpoint, or reduces a value a program must reduce, as TF users print or save on the
chief), ``chief-result-at-end`` (the same after the loop), ``busy`` (worker 1 sleeps 60 s
between steps while the others wait in the next step: only ``timeout_seconds`` ends that),
``ok`` (nothing breaks).
"""

import os
import signal
import sys
import tempfile
import time

import jax.numpy as jnp
import numpy as np

import jaxmirror as jm

mode = sys.argv[1]
timeout = float(sys.argv[2]) if len(sys.argv) > 2 else None
me = int(os.environ["JAXMIRROR_LAUNCH_WORKER_INDEX"])


def breaking(worker: int) -> bool:
    if me == worker:
        print("BREAKING", time.time(), flush=True)
        return True
    return False


options = jm.experimental.CommunicationOptions(timeout_seconds=timeout)
strategy = jm.MultiWorkerMirroredStrategy(communication_options=options)
if mode == "raise-before" and breaking(1):
    raise ValueError("bad configuration on this worker")
with strategy.scope():
    mean = jm.metrics.Mean()
    weights = jm.Variable(np.ones(3, np.float32))
ctx = jm.get_replica_context


@strategy.run
def step(x):
    if mode == "raise-in-step" and x.shape[0] == 2 and breaking(1):
        raise ValueError("this step cannot take 2 rows")
    mean.update_state(x)
    n = 6 if mode == "mismatch" and me == 1 else 4
    return ctx().all_reduce("SUM", jnp.ones(n) * x.sum())


for i in range(200):
    if i == 3:
        if mode == "raise-between" and breaking(1):
            raise RuntimeError("lost the data file")
        if mode == "kill" and breaking(1):
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "kill-chief" and breaking(0):
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "busy" and breaking(1):
            time.sleep(60)
        if mode == "chief-result" and breaking(0):
            print("mean", float(mean.result()), flush=True)
        if mode == "chief-save" and breaking(0):
            jm.checkpoint.save(os.path.join(tempfile.mkdtemp(), "ckpt"), {"w": weights})
        if mode == "chief-reduce" and breaking(0):
            values = strategy.experimental_distribute_values_from_function(
                lambda c: jnp.full((2,), c.replica_id_in_sync_group, jnp.float32))
            print("sum", strategy.reduce("SUM", values, axis=0), flush=True)
    if mode == "mismatch" and i == 0:
        print("BREAKING", time.time(), flush=True)
    rows = 2 if mode == "raise-in-step" and i >= 3 else 1
    total = step(jnp.ones(rows, jnp.float32))
    float(strategy.reduce("SUM", total, axis=None)[0])
if mode == "chief-result-at-end" and breaking(0):
    print("mean", float(mean.result()), flush=True)
print("finished", flush=True)
