"""Local multi-worker launcher: N worker processes on this machine, one cluster, as with TF.

A ``MultiWorkerMirroredStrategy`` reads its cluster from TF's ``TF_CONFIG`` variable. This
package starts N local worker processes, each with ``TF_CONFIG`` naming the same cluster
(free ``127.0.0.1`` ports; worker 0's address is the coordinator's) and its own task index,
prints their output prefixed with ``[worker i] ``, and stops them all (SIGINT, then SIGKILL
after a grace period) as soon as one fails, on a timeout, or on Ctrl-C:

- ``python -m jaxmirror.launch --workers 2 [--devices-per-worker 4] train.py [args...]``
  (see ``main``) for scripts;
- ``jaxmirror.launch.run(fn, workers=2)`` for notebooks and tests: it calls ``fn`` in each
  worker and returns their return values (see ``run``); a worker's exception comes back as
  a ``WorkerError``.

With ``--max-restarts N`` (``run(..., max_restarts=N)``), a failed attempt (a worker's
non-zero exit, 42 after a preemption checkpoint included, or a signal) is stopped and the whole
group started again on fresh ports, up to N times, as torchrun's ``--max-restarts``; each worker
sees ``JAXMIRROR_LAUNCH_RESTART`` (0, then 1, ...). Ctrl-C and the timeout never restart.

It imports only the standard library and cloudpickle, so a notebook can use it before JAX
starts, and each worker's JAX starts fresh with its own device settings.

Example:
    >>> import json, os, jaxmirror.launch
    >>> configs = jaxmirror.launch.run(lambda: json.loads(os.environ["TF_CONFIG"]), workers=2)
    >>> [c["task"] for c in configs]
    [{'type': 'worker', 'index': 0}, {'type': 'worker', 'index': 1}]
    >>> configs[0]["cluster"] == configs[1]["cluster"]
    True
"""

from jaxmirror.launch.call import WorkerError, run
from jaxmirror.launch.cli import main

__all__ = ["WorkerError", "main", "run"]
