"""``python -m jaxmirror.launch``: run a script (or ``-m module``) as N local workers.

Exit codes: 0 when every worker exited 0; the first failing worker's exit code (128 + the
signal number when a signal killed it); 124 on ``--timeout``; 130 on Ctrl-C (SIGINT), 143 on
SIGTERM and 129 on SIGHUP to the launcher; 2 for a bad command line. With
``--max-restarts N``, a failed attempt (a worker's non-zero exit, 42 after a preemption
checkpoint included, or a signal) restarts the whole group, up to N times: 0 as soon as an
attempt succeeds, else the last attempt's code.

Example:
    >>> import pathlib, tempfile
    >>> from jaxmirror.launch import cli
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     script = pathlib.Path(folder, "fail.py")
    ...     _ = script.write_text("import os, sys; "
    ...                           "sys.exit(int(os.environ['JAXMIRROR_LAUNCH_WORKER_INDEX']) * 3)")
    ...     cli.main(["--workers", "2", "--grace", "1", str(script)])
    3
"""

import argparse
import os
import signal
import sys
import threading
import time

from jaxmirror.launch import processes

EXIT_TIMEOUT = 124  # as coreutils' timeout(1)
SCRIPT_MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "script_main.py")


class _Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP to the launcher: stopped like Ctrl-C, the workers included."""

    def __init__(self, signum: int):
        super().__init__()
        self.signum = signum
        self.reason = f"received {signal.Signals(signum).name}"


def _raise_terminated(signum, frame):
    raise _Terminated(signum)


def _positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return value
    return parse


def _non_negative(text):
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _count(text):
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxmirror.launch",
        description="Run a Python script (or -m module) as N local worker processes of one "
                    "cluster: each gets TF_CONFIG with the cluster's 127.0.0.1 addresses and its "
                    "own task index, for MultiWorkerMirroredStrategy. Worker output is printed "
                    "with a '[worker i] ' prefix; when one worker fails, all are stopped.",
        epilog="Exit status: 0 when every worker exited 0 (in any attempt, with "
               "--max-restarts); else the first failing worker's exit code, of the last "
               "attempt (128+N when signal N killed it), 124 on --timeout, 130 on Ctrl-C, "
               "143 on SIGTERM.")
    parser.add_argument("--workers", type=_positive(int), required=True, metavar="N",
                        help="how many worker processes")
    parser.add_argument("--devices-per-worker", type=_positive(int), metavar="K",
                        help="give each worker's JAX K simulated CPU devices (sets "
                             "JAX_NUM_CPU_DEVICES and XLA's host device count flag)")
    parser.add_argument("--timeout", type=_positive(float), metavar="SECONDS",
                        help="stop every worker after this long and exit 124; it bounds "
                             "the whole launch, restarts included")
    parser.add_argument("--grace", type=_non_negative, default=10.0, metavar="SECONDS",
                        help="seconds between SIGINT and SIGKILL when stopping workers "
                             "(default 10)")
    parser.add_argument("--max-restarts", type=_count, default=0, metavar="N",
                        help="when a worker fails (a non-zero exit, 42 after a preemption "
                             "checkpoint included, or a signal), stop the others and start "
                             "the whole group again, on fresh ports, up to N times (default "
                             "0). Workers see JAXMIRROR_LAUNCH_RESTART=k, 0 at first. Ctrl-C, "
                             "SIGTERM and --timeout never restart")
    parser.add_argument("-m", dest="module", action="store_true",
                        help="TARGET is a module name, run as `python -m TARGET`")
    parser.add_argument("target", metavar="TARGET", help="the script (or, with -m, module)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    return parser


def _install(handler):
    """Set ``handler`` for SIGTERM and SIGHUP; the previous handlers (None off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None  # only the main thread may set handlers; a caller there owns them
    return {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}


def _log(message: str) -> None:
    print(processes.LOG_PREFIX + message, file=sys.stderr, flush=True)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _attempt(opts, command: list[str], envs: list[dict], deadline: float | None):
    """Run the group once: (launcher exit code, why it may be restarted or None, the group)."""
    with processes.WorkerGroup([command] * opts.workers, envs, stdout=sys.stdout,
                               stderr=sys.stderr, grace=opts.grace) as group:
        try:
            failed = group.wait(_left(deadline))
        except processes.GroupTimeout as e:
            running = ", ".join(map(str, e.running))
            group.log(f"timed out after {opts.timeout:g} s (--timeout) with worker(s) "
                      f"{running} still running; stopping the workers")
            return EXIT_TIMEOUT, None, group
        if failed is None:
            return 0, None, group
        code = group.returncode(failed)
        settle = max(opts.grace, processes.SETTLE_S)
        others = ""
        if opts.workers > 1:
            joined = group.joined_a_cluster()
            others = (f"; the others get {settle:g} s to stop on their own" if joined
                      else "; stopping the other workers")
        group.log(f"worker {failed} {processes.describe_exit(code)}{others}")
        if others.startswith("; the others"):
            if deadline is not None:  # not past the run's own time
                settle = min(settle, _left(deadline))
            running = group.settle(settle)
            if running:
                group.log(f"worker(s) {', '.join(map(str, running))} still running; "
                          f"stopping them")
    if opts.workers > 1:  # how each one ended, after the stop
        group.log("; ".join(f"worker {w.index} {processes.describe_exit(w.process.returncode)}"
                            for w in group.workers))
    return (code if code > 0 else 128 - code), processes.restart_reason(failed, code), group


def _gone(group: processes.WorkerGroup, deadline: float | None) -> bool:
    """Wait until every worker of ``group`` was reaped (stopping sent SIGKILL); whether all were
    before ``deadline``."""
    while group.running() and _left(deadline) != 0:
        group.settle(1.0 if deadline is None else min(1.0, _left(deadline)))
    return not group.running()


def main(argv: list[str] | None = None) -> int:
    """The command line ``python -m jaxmirror.launch``; its exit code.

    ``python -m jaxmirror.launch --workers N [--devices-per-worker K] [--timeout SECONDS]
    [--grace SECONDS] [--max-restarts R] script.py [args...]`` (or ``-m module [args...]``)
    starts N workers running the script with this Python, each with its own ``TF_CONFIG``
    (worker ``i`` of a cluster on free 127.0.0.1 ports) and ``JAXMIRROR_LAUNCH_WORKERS`` /
    ``JAXMIRROR_LAUNCH_WORKER_INDEX`` / ``JAXMIRROR_LAUNCH_RESTART``, and prints their output
    prefixed with ``[worker i] ``.
    When a worker fails, workers that joined a multi-worker cluster get 20 s (or ``--grace``,
    if longer) to stop on their own (a joined worker ends itself, naming the failed one), then
    SIGINT, and SIGKILL ``--grace`` seconds later; on ``--timeout`` and on Ctrl-C they get
    SIGINT at once. A worker whose script fails exits at once, skipping ``atexit`` handlers
    (JAX's shutdown barrier would hold it until the others finish; see
    ``jaxmirror.launch.script_main``). After a failure it says how each worker ended.
    With ``--max-restarts R``, once every worker of a failed attempt is gone the whole group
    starts again (fresh ports, ``JAXMIRROR_LAUNCH_RESTART`` one more), up to R times, as
    torchrun's ``--max-restarts``; ``--timeout`` bounds all attempts together.

    Args:
        argv: the arguments after ``python -m jaxmirror.launch`` (default ``sys.argv[1:]``).

    Returns:
        0 when every worker exited 0; else the first failing worker's exit code
        (128 + signal number when a signal killed it) of the last attempt, 124 on timeout,
        130 on Ctrl-C.

    Example:
        >>> import pathlib, tempfile, jaxmirror.launch
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     script = pathlib.Path(folder, "hello.py")
        ...     _ = script.write_text("import os; print('hi from', os.environ['TF_CONFIG'][:11])")
        ...     jaxmirror.launch.main(["--workers", "1", str(script)])
        [worker 0] hi from {"cluster":
        0
    """
    parser = _parser()
    opts = parser.parse_args(argv)
    if not opts.module and not os.path.exists(opts.target):
        parser.error(f"no such script: {opts.target}")
    command = [sys.executable, "-P", SCRIPT_MAIN, "-m" if opts.module else "--", opts.target,
               *opts.args]
    previous = _install(_raise_terminated)
    deadline = None if opts.timeout is None else time.monotonic() + opts.timeout
    used_ports: set[int] = set()
    restart = 0
    try:
        while True:
            envs = processes.worker_envs(opts.workers, opts.devices_per_worker,
                                         restart=restart, avoid_ports=used_ports)
            used_ports |= processes.cluster_ports(envs)
            code, reason, group = _attempt(opts, command, envs, deadline)
            if reason is None or restart >= opts.max_restarts:
                return code
            if not _gone(group, deadline) or _left(deadline) == 0:
                _log(f"timed out after {opts.timeout:g} s (--timeout) before restart "
                     f"{restart + 1} of {opts.max_restarts}; not restarting")
                return EXIT_TIMEOUT
            restart += 1
            _log(f"restarting the group (restart {restart} of {opts.max_restarts}): {reason}")
    except _Terminated as e:
        return 128 + e.signum
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    finally:
        if previous:
            for s, handler in previous.items():
                signal.signal(s, handler)
