"""Two workers save checkpoints; one of them is killed at a chosen point of the second save.

``python -m jaxmirror.launch --workers 2 --devices-per-worker 1 multi_worker_saving.py HOOK
PATH``: every worker saves version 1 at PATH, then version 2 with ``force=True``; HOOK names
where the second save SIGKILLs a worker (``none``: nowhere). Every leaf of version k holds k:
a variable assigned in a step, one never assigned since it was made, an array placed by
``experimental_replicate``, a sync-on-read total. Not a test module.
"""

import os
import signal
import sys

import numpy as np
import orbax.checkpoint as ocp

import jaxmirror as jm
from jaxmirror.variables import checkpoint_files as files

hook, path = sys.argv[1], sys.argv[2]
strategy = jm.MultiWorkerMirroredStrategy()
me = int(os.environ["JAXMIRROR_LAUNCH_WORKER_INDEX"])
BIG = 2 ** 18
with strategy.scope():
    big = jm.Variable(np.zeros(BIG, np.float32))
    unassigned = jm.Variable(np.full((2, 3), 1.0, np.float32))
    total = jm.Variable(0.0, synchronization="on_read", aggregation="sum")


def tree(version):
    def step():
        big.assign(np.full(BIG, version, np.float32))
        total.assign(version / strategy.num_replicas_in_sync)

    strategy.run(step)
    return {"big": big, "unassigned": unassigned, "total": total,
            "replicated": strategy.experimental_replicate(np.full(4, version, np.float32)),
            "version": version}


def die(*args, **kwargs):
    print("dying at", hook, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


jm.checkpoint.save(path, tree(1))
print("saved 1", flush=True)
victim, point = hook.split(":") if ":" in hook else ("none", hook)
if victim != "none" and int(victim) == me:
    if point == "before-write":        # nothing of the new checkpoint written by this worker
        ocp.PyTreeCheckpointHandler.save = die
    elif point == "finalize":          # every part written; orbax has not renamed it yet
        ocp.PyTreeCheckpointHandler.finalize = die
    elif point == "before-swap":       # the new checkpoint is complete beside the old one
        files.replace = die
    elif point == "between-renames":   # no renameat2: old one moved aside, new one not in place
        files.exchange = lambda a, b: False
        rename = os.rename

        def rename_then_die(src, dst):
            rename(src, dst)
            if src == path:
                die()
        os.rename = rename_then_die
    elif point == "after-swap":        # the new one in place, the old one not yet deleted
        files.discard = die
jm.checkpoint.save(path, tree(2), force=True)
print("saved 2", flush=True)
