"""``jaxmirror.launch.run``: call a function in N local worker processes, for notebooks and tests.

The function, its arguments and its results travel with cloudpickle through files in a
temporary folder; the processes are started, watched and stopped by
``jaxmirror.launch.processes``, as for the command line.

Example:
    >>> import jaxmirror.launch
    >>> jaxmirror.launch.run(pow, workers=2, args=(2, 10))
    [1024, 1024]
"""

import numbers
import os
import pickle
import sys
import tempfile
import time

import cloudpickle

from jaxmirror.launch import processes

WORKER_MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_main.py")


class WorkerError(RuntimeError):
    """A worker of ``jaxmirror.launch.run`` raised, or died without returning.

    The message names the worker and what happened: the exception's type and message and the
    worker's traceback, or the exit code (or signal) and the last lines of its stderr.

    Args:
        message: the message.
        worker_index: the worker's index (its ``TF_CONFIG`` task index).
        exit_code: its exit code; minus the signal number when a signal killed it.
        traceback: the worker's formatted traceback, when it raised (else None).

    Returns:
        The exception.

    Example:
        >>> import jaxmirror.launch
        >>> def fail():
        ...     raise ValueError("boom")
        >>> try:
        ...     jaxmirror.launch.run(fail, workers=1)
        ... except jaxmirror.launch.WorkerError as e:
        ...     print(e.worker_index, e.exit_code, str(e).splitlines()[0])
        0 1 worker 0 raised ValueError: boom
    """

    def __init__(self, message: str, worker_index: int | None = None,
                 exit_code: int | None = None, traceback: str | None = None):
        super().__init__(message)
        self.worker_index = worker_index
        self.exit_code = exit_code
        self.traceback = traceback


def _positive_int(name: str, value, optional: bool = False, least: int = 1) -> None:
    if optional and value is None:
        return
    expected = "an int >= 0" if least == 0 else "a positive int"
    expected = "None or " + expected if optional else expected
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"jaxmirror.launch.run: `{name}` must be {expected}; "
                        f"got {value!r} of type {type(value).__name__}.")
    if value < least:
        raise ValueError(f"jaxmirror.launch.run: `{name}` must be {expected}; got {value!r}.")


def _seconds(name: str, value, optional: bool, allow_zero: bool) -> None:
    if optional and value is None:
        return
    expected = ("None or " if optional else "") + ("a number >= 0" if allow_zero
                                                   else "a number > 0")
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"jaxmirror.launch.run: `{name}` must be {expected} (seconds); "
                        f"got {value!r} of type {type(value).__name__}.")
    if not (value >= 0 if allow_zero else value > 0):
        raise ValueError(f"jaxmirror.launch.run: `{name}` must be {expected} (seconds); "
                         f"got {value!r}.")


def _check(fn, workers, devices_per_worker, args, kwargs, timeout, grace, env,
           max_restarts) -> None:
    if not callable(fn):
        raise TypeError(f"jaxmirror.launch.run: `fn` must be callable; got {fn!r} of type "
                        f"{type(fn).__name__}.")
    _positive_int("workers", workers)
    _positive_int("devices_per_worker", devices_per_worker, optional=True)
    _seconds("timeout", timeout, optional=True, allow_zero=False)
    _seconds("grace", grace, optional=False, allow_zero=True)
    _positive_int("max_restarts", max_restarts, least=0)
    if isinstance(args, (str, bytes)) or not hasattr(args, "__iter__"):
        raise TypeError(f"jaxmirror.launch.run: `args` must be a tuple or list of positional "
                        f"arguments; got {args!r}.")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"jaxmirror.launch.run: `kwargs` must be None or a dict; got {kwargs!r}.")
    if env is not None and not (hasattr(env, "items") and all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise TypeError(f"jaxmirror.launch.run: `env` must be None or a mapping of str to str; "
                        f"got {env!r}.")


def _host_arrays(tree):
    """``tree`` with its ``jax.Array`` leaves as NumPy arrays: unpickling a ``jax.Array`` starts
    JAX in the worker, after which its ``MultiWorkerMirroredStrategy`` could not join the
    cluster (only plain containers are searched)."""
    import jax  # only a call that ships arguments needs it
    import numpy as np

    def host(x):
        # A typed PRNG key has no NumPy form: it travels as it is.
        if isinstance(x, jax.Array) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return np.asarray(x)
        return x

    return jax.tree.map(host, tree, is_leaf=lambda x: not isinstance(x, (dict, list, tuple)))


def _payload(fn, args, kwargs) -> bytes:
    args, kwargs = _host_arrays((tuple(args), dict(kwargs or {})))
    try:
        call = cloudpickle.dumps((fn, tuple(args), dict(kwargs)))
    except Exception as e:  # noqa: BLE001 - whatever pickling the user's objects raises
        raise TypeError(f"jaxmirror.launch.run: cannot pickle `fn`, `args` and `kwargs` for the "
                        f"workers: {type(e).__name__}: {e}") from e
    return pickle.dumps({"sys_path": list(sys.path), "call": call})


def _read(group: processes.WorkerGroup, index: int, path: str):
    """Worker ``index``'s outcome (worker_main.py), None when it wrote none."""
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - e.g. the value's class is not importable here
        raise WorkerError(f"worker {index}'s result cannot be unpickled in this process: "
                          f"{type(e).__name__}: {e}", worker_index=index,
                          exit_code=group.returncode(index)) from e


def _failure(group: processes.WorkerGroup, index: int, result_path: str) -> WorkerError:
    code = group.returncode(index)
    outcome = _read(group, index, result_path)
    if outcome is not None and outcome[0] == "raised":
        _, type_name, message, tb = outcome
        return WorkerError(f"worker {index} raised {type_name}: {message}\n\n{tb}",
                           worker_index=index, exit_code=code, traceback=tb)
    tail = group.stderr_tail(index)
    tail = (f"; the last lines of its stderr:\n{tail}" if tail.strip()
            else "; it wrote nothing to stderr")
    # A worker can fail after its function returned, e.g. in JAX's shutdown at exit.
    returned = "after returning its result" if outcome else "without returning a result"
    return WorkerError(f"worker {index} {processes.describe_exit(code)} {returned}{tail}",
                       worker_index=index, exit_code=code)


def _ended_by_another(group: processes.WorkerGroup, index: int, path: str) -> bool:
    """Whether worker ``index`` failed because another one did: a joined worker ends itself
    with ``UnavailableError`` naming the failed one (printed, when it was blocked in a
    collective)."""
    try:
        outcome = _read(group, index, path)
    except WorkerError:
        return False
    if outcome is not None:
        return outcome[0] == "raised" and outcome[1].endswith("UnavailableError")
    return "UnavailableError" in group.stderr_tail(index)


def _first_cause(group: processes.WorkerGroup, failed: int, results: list,
                 running: list) -> int:
    """The worker where a joined group's failure started. The first to exit is not always it:
    a joined worker can hear of a failure (from the coordination service) and exit before the
    failed worker's own exit is seen. Among the workers that exited on their own (not
    ``running``, so not stopped by the launcher), the first in exit-then-index order that did
    not fail because of another; ``failed`` when each of them did."""
    exited = [failed] + [i for i in range(len(results)) if i != failed and i not in running
                         and group.returncode(i) not in (0, None)]
    return next((i for i in exited if not _ended_by_another(group, i, results[i])), failed)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _attempt(commands, envs, results, grace, deadline, timeout):
    """Run the group once: (the group, the first failed worker or None, the return values)."""
    # The streams of the moment of the call: a notebook swaps sys.stdout per cell.
    with processes.WorkerGroup(commands, envs, stdout=sys.stdout, stderr=sys.stderr,
                               grace=grace) as group:
        try:
            failed = group.wait(_left(deadline))
        except processes.GroupTimeout as e:
            raise TimeoutError(
                f"jaxmirror.launch.run: timed out after {timeout:g} s (timeout={timeout!r}); "
                f"worker(s) {', '.join(map(str, e.running))} were still running and have "
                "been stopped") from None
        if failed is not None and group.joined_a_cluster():
            # The others end themselves, naming the failure (within the run's own time).
            settle = max(grace, processes.SETTLE_S)
            if deadline is not None:
                settle = min(settle, _left(deadline))
            failed = _first_cause(group, failed, results, group.settle(settle))
    values = []
    if failed is None:  # a worker that exited 0 without its result failed all the same
        for i, path in enumerate(results):
            outcome = _read(group, i, path)
            if outcome is None or outcome[0] != "returned":
                return group, i, None
            values.append(outcome[1])
    return group, failed, values


def _reason(error: WorkerError) -> str:
    """The restart line's account of ``error``."""
    if error.traceback is not None:
        return str(error).splitlines()[0]  # "worker 1 raised ValueError: ..."
    reason = processes.restart_reason(error.worker_index, error.exit_code)
    return reason + (" without returning a result" if error.exit_code == 0 else "")


def run(fn, workers: int, devices_per_worker: int | None = None, args=(), kwargs=None,
        timeout: float | None = None, grace: float = 10.0, env=None,
        max_restarts: int = 0) -> list:
    """Call ``fn(*args, **kwargs)`` in ``workers`` new local processes; their return values.

    Each worker gets ``TF_CONFIG`` for a local cluster (``127.0.0.1`` ports), as
    ``python -m jaxmirror.launch`` gives a script, so a ``MultiWorkerMirroredStrategy`` made
    inside ``fn`` joins the others. The workers' output appears here, each line prefixed
    with ``[worker i] `` (in a notebook, under the cell). ``fn`` may be a function of a module
    (the workers import it by name, with this process's ``sys.path``), or a lambda, closure
    or function defined in a notebook or ``__main__`` (shipped by value with cloudpickle).

    When a worker fails, workers that joined a multi-worker cluster get 20 s (or ``grace``, if
    longer) to stop on their own (a joined worker ends itself with an error naming the failed
    one); then the others get SIGINT, and SIGKILL ``grace`` seconds later; on ``timeout`` and
    on Ctrl-C (KeyboardInterrupt, re-raised) they get SIGINT at once. With ``max_restarts``,
    a failed attempt is followed, once its workers are gone, by a new one (fresh ports,
    ``JAXMIRROR_LAUNCH_RESTART`` one more), as with ``--max-restarts``.

    Args:
        fn: the function each worker calls.
        workers: how many worker processes (a positive int).
        devices_per_worker: give each worker's JAX this many simulated CPU devices; None
            leaves the device settings inherited from this process's environment.
        args: positional arguments for ``fn``, pickled with cloudpickle.
        kwargs: keyword arguments for ``fn``.
        timeout: seconds the workers may take altogether, restarts included; None waits
            for ever.
        grace: seconds between SIGINT and SIGKILL when workers are stopped.
        env: environment variables to add for the workers (``TF_CONFIG`` and the
            ``JAXMIRROR_LAUNCH_*`` variables are always the launcher's).
        max_restarts: how many times a failed group may be started again (an int >= 0).

    Returns:
        The workers' return values, a list in worker order (of the attempt that succeeded).

    Raises:
        WorkerError: a worker raised or died; the first one to fail (of the last attempt) is
            reported.
        TimeoutError: ``timeout`` passed; the message names the workers still running.
        TypeError, ValueError: a bad argument (nothing is started).

    Example:
        >>> import os, jaxmirror.launch
        >>> jaxmirror.launch.run(lambda: 2 + 2, workers=2)
        [4, 4]
        >>> jaxmirror.launch.run(lambda: os.environ["JAXMIRROR_LAUNCH_WORKER_INDEX"], workers=2)
        ['0', '1']
        >>> def preempted_at_first():  # exits 42 in attempt 0, returns in attempt 1
        ...     restart = int(os.environ["JAXMIRROR_LAUNCH_RESTART"])
        ...     return restart if restart else os._exit(42)
        >>> jaxmirror.launch.run(preempted_at_first, workers=2, max_restarts=1)
        [1, 1]
    """
    _check(fn, workers, devices_per_worker, args, kwargs, timeout, grace, env, max_restarts)
    deadline = None if timeout is None else time.monotonic() + timeout
    payload = _payload(fn, args, kwargs)
    used_ports: set[int] = set()
    with tempfile.TemporaryDirectory(prefix="jaxmirror-launch-") as folder:
        payload_path = os.path.join(folder, "payload.pkl")
        with open(payload_path, "wb") as f:
            f.write(payload)
        for restart in range(max_restarts + 1):
            envs = processes.worker_envs(workers, devices_per_worker, dict(env or {}),
                                         restart=restart, avoid_ports=used_ports)
            used_ports |= processes.cluster_ports(envs)
            # Each attempt its own files: an earlier attempt's result is no answer.
            results = [os.path.join(folder, f"result-{restart}-{i}.pkl") for i in range(workers)]
            commands = [[sys.executable, "-P", WORKER_MAIN, payload_path, r] for r in results]
            group, failed, values = _attempt(commands, envs, results, grace, deadline, timeout)
            if failed is None:
                return values
            error = _failure(group, failed, results[failed])
            if restart == max_restarts:
                raise error
            while group.running() and _left(deadline) != 0:  # SIGKILL sent: they go
                group.settle(1.0 if deadline is None else min(1.0, _left(deadline)))
            if group.running() or _left(deadline) == 0:
                raise TimeoutError(f"jaxmirror.launch.run: timed out after {timeout:g} s "
                                   f"(timeout={timeout!r}) before restart {restart + 1}; "
                                   f"the last attempt failed: {_reason(error)}") from error
            group.log(f"restarting the group (restart {restart + 1} of {max_restarts}): "
                      f"{_reason(error)}")
