"""Local multi-worker launcher: N worker processes on this machine, one cluster, as with TF.

A ``MultiWorkerMirroredStrategy`` reads its cluster from TF's ``TF_CONFIG`` variable. This
package starts N local workers, each with a ``TF_CONFIG`` naming the same cluster (free
``127.0.0.1`` ports) and its own task index. It prints their output prefixed with
``[worker i] ``, and stops them all (SIGINT, then SIGKILL after a grace period) as soon as one
fails, on a timeout, or on Ctrl-C:

- ``python -m jaxmirror.launch --workers 2 [--devices-per-worker 4] train.py [args...]``
  runs a script (see ``main``);
- ``jaxmirror.launch.run(fn, workers=2)`` calls ``fn`` in each worker and returns their
  results, for notebooks and tests (see ``run``); a worker's exception comes back as a
  ``WorkerError``.

With ``--max-restarts N`` (``run(..., max_restarts=N)``), a failed attempt (a non-zero exit,
42 after a preemption checkpoint included, or a signal) starts the whole group again on fresh
ports, up to N times, as torchrun does; each worker sees ``JAXMIRROR_LAUNCH_RESTART`` (0, 1,
...). Ctrl-C and the timeout never restart.

It imports only the standard library and cloudpickle, so a notebook can use it before JAX
starts, and each worker's JAX starts fresh with its own device settings.

Modules:
    ``processes``: local worker processes: their cluster environment, output, and stopping.
    ``cli``: ``python -m jaxmirror.launch``: a script run as N local workers.
    ``script_main``: what each worker of the command line runs: the script.
    ``call``: ``jaxmirror.launch.run``: a function called in N local workers.
    ``worker_main``: what each worker of ``run`` runs: the call, its outcome written back.

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
