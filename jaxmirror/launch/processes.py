"""Local worker processes: their cluster environment, their output, and stopping them.

The one implementation behind both ``python -m jaxmirror.launch`` and
``jaxmirror.launch.run``. Signals, and why:

- Every worker runs in its own session, so the launcher can signal its whole process group
  (whatever the worker started goes with it), and a terminal's Ctrl-C reaches only the
  launcher, which then decides what the workers get.
- Stopping is SIGINT to each group, then SIGKILL to every group after ``grace`` seconds.
  Never SIGTERM: a process that called ``jax.distributed.initialize`` catches SIGTERM
  (JAX's preemption notifier) and keeps running.

Example:
    >>> import io, sys
    >>> from jaxmirror.launch import processes
    >>> out = io.StringIO()
    >>> command = [sys.executable, "-c", "print('hi')"]
    >>> with processes.WorkerGroup([command], processes.worker_envs(1), stdout=out,
    ...                            stderr=sys.stderr, grace=1.0) as group:
    ...     print(group.wait(timeout=60))
    None
    >>> out.getvalue()
    '[worker 0] hi\\n'
"""

import collections
import json
import os
import queue
import signal
import socket
import subprocess
import threading
import time

LOG_PREFIX = "jaxmirror.launch: "
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count="
STDERR_TAIL_LINES = 20
# After a worker fails, how long the others get to stop on their own: a joined worker learns of
# a raised error within a second, and of a killed worker after the coordination service's
# heartbeat timeout (10 s by default), then ends itself naming it.
SETTLE_S = 20.0
# A worker's exit code after a preemption checkpoint (TF's, PreemptionCheckpointHandler's).
PREEMPTED_EXIT_CODE = 42


def free_ports(n: int, avoid=()) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (the kernel's choice for port 0).

    Args:
        n: how many ports.
        avoid: ports not to return (an earlier attempt's, perhaps still in TIME_WAIT).

    Returns:
        The port numbers.
    """
    # Every socket stays bound until all are, so the kernel cannot hand out one port twice
    # (an avoided one included: at most len(avoid) draws are refused). Another program may
    # still take a port before a worker binds it; jax.distributed then fails with "address
    # in use", and a new launch (or a restart) picks new ports.
    avoid = set(avoid)
    sockets, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port not in avoid:
                ports.append(port)
        return ports
    finally:
        for s in sockets:
            s.close()


def worker_envs(workers: int, devices_per_worker: int | None = None,
                extra: dict | None = None, restart: int = 0, avoid_ports=()) -> list[dict]:
    """One environment per worker: this process's, plus ``extra``, plus the launch variables.

    Args:
        workers: how many workers.
        devices_per_worker: when given, each worker's JAX gets this many simulated CPU
            devices (``JAX_NUM_CPU_DEVICES`` and XLA's host device count flag, replacing one
            inherited in ``XLA_FLAGS``); when None the device settings are inherited as they are.
        extra: variables to add; the launch variables (``TF_CONFIG``...) take precedence.
        restart: how many times the group was restarted before (``JAXMIRROR_LAUNCH_RESTART``).
        avoid_ports: ports the cluster must not use (those of earlier attempts).

    Returns:
        A list of ``workers`` dicts, worker ``i``'s with ``TF_CONFIG`` task index ``i``.
    """
    base = dict(os.environ)
    base.update(extra or {})
    if devices_per_worker is not None:
        kept = [f for f in base.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
        base["XLA_FLAGS"] = " ".join(kept + [f"{DEVICE_COUNT_FLAG}{devices_per_worker}"])
        base["JAX_NUM_CPU_DEVICES"] = str(devices_per_worker)
    # Output goes through pipes; unbuffered, it reaches the launcher line by line as printed.
    base["PYTHONUNBUFFERED"] = "1"
    base["JAXMIRROR_LAUNCH_WORKERS"] = str(workers)
    base["JAXMIRROR_LAUNCH_RESTART"] = str(restart)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in free_ports(workers, avoid_ports)]}
    envs = []
    for i in range(workers):
        env = dict(base)
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
        env["JAXMIRROR_LAUNCH_WORKER_INDEX"] = str(i)
        envs.append(env)
    return envs


def cluster_ports(envs: list[dict]) -> set[int]:
    """The ports of the ``TF_CONFIG`` clusters in ``envs`` (to avoid them on a restart).

    Args:
        envs: worker environments, as ``worker_envs`` makes them.

    Returns:
        A set of port numbers.
    """
    ports = set()
    for env in envs:
        try:
            addresses = json.loads(env.get("TF_CONFIG", "{}"))["cluster"]["worker"]
            ports.update(int(a.rpartition(":")[2]) for a in addresses)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return ports


def describe_exit(returncode: int) -> str:
    """``"exited with code 3"`` or ``"was killed by SIGKILL"`` for a ``Popen.returncode``.

    Args:
        returncode: the exit code, or minus the signal number that killed the process.

    Returns:
        The phrase.
    """
    if returncode is None:
        return "is still running"
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"was killed by {name}"


def restart_reason(index: int, returncode: int) -> str:
    """Why a group is restarted: ``"worker 1 exited with 42 (preempted)"``, ``"worker 0 was
    killed by SIGKILL"``.

    Args:
        index: the worker that ended its attempt.
        returncode: its ``Popen.returncode``.

    Returns:
        The phrase.

    Example:
        >>> from jaxmirror.launch import processes
        >>> processes.restart_reason(1, 42), processes.restart_reason(0, -9)
        ('worker 1 exited with 42 (preempted)', 'worker 0 was killed by SIGKILL')
    """
    if returncode is not None and returncode >= 0:
        preempted = " (preempted)" if returncode == PREEMPTED_EXIT_CODE else ""
        return f"worker {index} exited with {returncode}{preempted}"
    return f"worker {index} {describe_exit(returncode)}"


class GroupTimeout(TimeoutError):
    """``WorkerGroup.wait`` ran out of time; ``running`` lists the workers still running."""

    def __init__(self, timeout: float, running: list[int]):
        super().__init__(f"timed out after {timeout:g} s; worker(s) "
                         f"{', '.join(map(str, running))} still running")
        self.timeout = timeout
        self.running = running


class _Worker:
    """One worker process, the threads that forward its output, and the one that reaps it."""

    def __init__(self, group: "WorkerGroup", index: int, command: list[str], env: dict):
        self.index = index
        self.stderr_tail: collections.deque = collections.deque(maxlen=STDERR_TAIL_LINES)
        self.exited = threading.Event()
        # stdin is /dev/null: N workers reading one terminal would steal each other's input.
        self.process = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True)
        self.threads = [
            threading.Thread(target=group.forward, daemon=True,
                             args=(self.process.stdout, group.stdout, index, None)),
            threading.Thread(target=group.forward, daemon=True,
                             args=(self.process.stderr, group.stderr, index, self.stderr_tail)),
        ]
        # A thread per worker blocks in waitpid, so the first exit is seen at once, not by polling.
        waiter = threading.Thread(target=self._reap, args=(group.exits,), daemon=True)
        for thread in self.threads + [waiter]:
            thread.start()

    def _reap(self, exits: queue.Queue) -> None:
        self.process.wait()
        self.exited.set()
        exits.put(self.index)

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone already (PermissionError: macOS, for a zombie leader)

    def join_output(self, timeout: float) -> None:
        # Bounded: a grandchild that left the group may hold the pipe open for ever.
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))


class WorkerGroup:
    """Start commands as worker processes, forward their output, watch them, and stop them.

    Use it as a context manager: entering starts every worker, leaving stops whatever still
    runs (SIGINT to each process group, SIGKILL to every group after ``grace`` seconds), also
    when an exception, a timeout or Ctrl-C leaves the block.

    Args:
        commands: one argv list per worker.
        envs: one environment per worker.
        stdout: where the workers' stdout lines go, each prefixed with ``[worker i] ``.
        stderr: where their stderr lines and the group's own messages go.
        grace: seconds between SIGINT and SIGKILL when stopping.
        log: called with each of the group's own messages (default: written to ``stderr``).

    Returns:
        The group (from ``with``).
    """

    def __init__(self, commands, envs, *, stdout, stderr, grace: float, log=None):
        self.commands, self.envs = list(commands), list(envs)
        self.stdout, self.stderr, self.grace = stdout, stderr, grace
        self.log = log or (lambda message: self._write(stderr, LOG_PREFIX + message + "\n"))
        self.exits: queue.Queue = queue.Queue()
        self.workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._stopped = False

    def __enter__(self) -> "WorkerGroup":
        try:
            for i, (command, env) in enumerate(zip(self.commands, self.envs)):
                self.workers.append(_Worker(self, i, command, env))
        except BaseException:
            self.stop()  # those already started must not outlive a failed start
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if isinstance(exc, KeyboardInterrupt) and self.running():
            self.log(f"{getattr(exc, 'reason', 'interrupted')}; sending SIGINT to the workers")
        self.stop()

    def _write(self, stream, text: str) -> None:
        # One lock for both streams: lines from different workers never interleave mid-line.
        with self._lock:
            try:
                stream.write(text)
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not stop the draining,
                pass           # or the worker blocks on a full pipe

    def forward(self, pipe, stream, index: int, tail) -> None:
        """Copy ``pipe`` to ``stream`` line by line with the worker's prefix (a thread's body)."""
        prefix = f"[worker {index}] "
        with pipe:
            for raw in iter(pipe.readline, b""):
                line = raw.decode("utf-8", "replace")
                if not line.endswith("\n"):
                    line += "\n"
                if tail is not None:
                    tail.append(line)
                self._write(stream, prefix + line)

    def running(self) -> list[int]:
        """Indices of the workers still running."""
        return [w.index for w in self.workers if not w.exited.is_set()]

    def returncode(self, index: int) -> int | None:
        """Worker ``index``'s ``Popen.returncode`` (None while it runs)."""
        return self.workers[index].process.returncode

    def stderr_tail(self, index: int) -> str:
        """The last lines worker ``index`` wrote to stderr."""
        self.workers[index].join_output(1.0)
        return "".join(self.workers[index].stderr_tail)

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait until every worker exited 0 (None), or one failed (its index), whichever first.

        Raises:
            GroupTimeout: after ``timeout`` seconds with workers still running.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = {w.index for w in self.workers}
        while pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise GroupTimeout(timeout, sorted(pending))
            try:
                # Short waits keep Ctrl-C prompt however the platform treats blocked locks.
                index = self.exits.get(timeout=0.5 if left is None else min(left, 0.5))
            except queue.Empty:
                continue
            pending.discard(index)
            if self.returncode(index) != 0:
                # Its last output (a traceback) comes before whatever reports the failure.
                self.workers[index].join_output(1.0)
                return index
        return None

    def joined_a_cluster(self) -> bool:
        """Whether the workers joined a multi-worker cluster: something listens at a worker's
        ``TF_CONFIG`` address (the coordination service, or a joined worker's presence socket).
        Joined workers end themselves after another's failure, naming it (``settle``).

        Returns:
            A bool.
        """
        addresses = set()
        for env in self.envs:
            try:
                addresses.update(json.loads(env.get("TF_CONFIG", "{}"))["cluster"]["worker"])
            except (ValueError, KeyError, TypeError):
                continue
        for address in sorted(addresses):
            host, _, port = address.rpartition(":")
            try:
                with socket.create_connection((host, int(port)), timeout=0.5):
                    return True
            except (OSError, ValueError):
                continue
        return False

    def settle(self, timeout: float) -> list[int]:
        """Give the running workers up to ``timeout`` seconds to exit on their own (after one
        failed, a joined worker ends itself, naming the failure); those still running.

        Args:
            timeout: seconds.

        Returns:
            The indices of the workers still running.
        """
        deadline = time.monotonic() + timeout
        for w in self.workers:
            w.exited.wait(max(0.0, deadline - time.monotonic()))
        return self.running()

    def stop(self) -> None:
        """SIGINT to every running worker's group, SIGKILL to every group after ``grace``."""
        if self._stopped:
            return
        self._stopped = True
        alive = [w for w in self.workers if not w.exited.is_set()]
        interrupted = None
        try:
            for w in alive:
                w.signal_group(signal.SIGINT)
            deadline = time.monotonic() + self.grace
            for w in alive:
                w.exited.wait(max(0.0, deadline - time.monotonic()))
        except KeyboardInterrupt as e:  # Ctrl-C again while waiting: no more grace
            interrupted = e
        for w in self.workers:
            if not w.exited.is_set():
                waited = "interrupted again" if interrupted else f"{self.grace:g} s after SIGINT"
                self.log(f"worker {w.index} still running ({waited}); sending SIGKILL")
            # Also for workers that exited: whatever they started must not be left behind.
            w.signal_group(signal.SIGKILL)
        for w in self.workers:
            w.exited.wait(10.0)
            w.join_output(2.0)
        if interrupted is not None:
            raise interrupted
