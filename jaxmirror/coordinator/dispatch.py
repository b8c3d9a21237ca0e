"""The closure queue: hands scheduled closures to workers, collects results, survives deaths.

Each worker has up to ``max_in_flight`` calls submitted at once (Ray queues them on the actor),
so a worker never waits for the coordinator between calls. A call carries one closure, or, when
closures wait in the queue, up to ``max_per_call`` of them (shared fairly among the workers with
room), which the worker runs one after another: Ray's per-call costs are paid once for them all
(and, when not ``fresh``, the changes of all go out in one message per parameter server).

A thread watches the calls in flight. A call on a worker that died fails at once (Ray's
restarts are off); its closures go back to the front of the queue with the same ids, a
replacement worker is started, and the closures run there. Parameter servers apply each
closure's updates at most once, so a closure re-run after its updates landed changes nothing
twice.
"""

from __future__ import annotations

import collections
import heapq
import os
import threading

from jaxmirror.coordinator.errors import UnavailableError, with_remote_traceback
from jaxmirror.coordinator.ps_variables import coordinator_writes, ps_unavailable
from jaxmirror.coordinator.shipping import unpack
from jaxmirror.cluster_resolver import ray_support

MAX_ATTEMPTS = 5  # a function that kills its worker every time is an error, not a loop


class Closure:
    """One scheduled call: what to run, where its result goes, how often it was started.

    Attributes:
        closure_id: unique id (parameter servers deduplicate updates by it).
        fn_id: the function's id; ``fn_blob`` its pickle.
        fn_blob: see ``fn_id``.
        args_blob: the pickled ``(args, kwargs)``.
        var_ids: the parameter-server variables to pull, sorted.
        value: its ``RemoteValue``.
        attempts: how many times it was started.
    """

    __slots__ = ("closure_id", "fn_id", "fn_blob", "args_blob", "var_ids", "value", "attempts")

    def __init__(self, closure_id, fn_id, fn_blob, args_blob, var_ids, value):
        self.closure_id, self.fn_id, self.fn_blob = closure_id, fn_id, fn_blob
        self.args_blob, self.var_ids, self.value = args_blob, var_ids, value
        self.attempts = 0


class Dispatcher:
    """Runs closures on the cluster's workers.

    Args:
        cluster: the ``RayCluster``.
        max_in_flight: calls submitted to one worker at once.
        max_per_call: closures in one call at most.
        fresh: whether each closure of a call sends its changes and starts from the parameter
            servers' values (``closures.run_closures``).

    The workers' compiled loads (``closures``) are on unless the environment variable
    ``JAXMIRROR_PS_FAST_PATHS`` is ``0`` when the dispatcher is made: then one ``assign`` per
    loaded variable, the same values at several times the cost.
    """

    def __init__(self, cluster, max_in_flight: int = 2, max_per_call: int = 8,
                 fresh: bool = True):
        self._cluster = cluster
        self._fresh = fresh
        self._fast = os.environ.get("JAXMIRROR_PS_FAST_PATHS", "1").strip() != "0"
        self._max = max_in_flight
        self._per_call = max_per_call
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._in_flight: dict = {}  # object ref -> (closures, worker index, generation)
        self._pending: list = []  # a heap of (closure id, closure), finished ones popped lazily
        self._load = [0] * cluster.num_workers
        self._shipped = [set() for _ in range(cluster.num_workers)]
        self._error = None
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="jaxmirror-coordinator",
                                        daemon=True)
        self._thread.start()

    # -- called by the coordinator (any thread) -------------------------------------------------
    def put(self, closure: Closure) -> None:
        """Queue ``closure`` and start it if a worker has room.

        Raises:
            The pending error of an earlier closure (then cleared), as TF's ``schedule``.
        """
        with self._cond:
            self._raise_pending()
            self._queue.append(closure)
            heapq.heappush(self._pending, (closure.closure_id, closure))
            self._fill()
            self._cond.notify_all()

    def join(self) -> None:
        """Wait until every queued closure has run; raise the first error (then cleared)."""
        with self._cond:
            while self._queue or self._in_flight:
                self._cond.wait()
            self._raise_pending()

    def done(self) -> bool:
        """Whether every closure has run; raises the pending error (then cleared)."""
        with self._cond:
            self._raise_pending()
            return not self._queue and not self._in_flight

    def close(self) -> None:
        """Stop watching (the cluster's actors are closed by their owner)."""
        with self._cond:
            self._closed = True
            for closure in self._queue:
                closure.value.cancel()
            self._queue.clear()
            self._cond.notify_all()

    # -- internals (the lock is held) -----------------------------------------------------------
    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _fill(self) -> None:
        while self._queue and not self._closed:
            worker = min(range(len(self._load)), key=self._load.__getitem__)
            if self._load[worker] >= self._max:
                return
            room = sum(self._max - load for load in self._load)
            size = min(self._per_call, -(-len(self._queue) // room))
            if self._queue[0].attempts:  # re-run after a death: alone, so attempts are its own
                size = 1
            self._submit([self._queue.popleft() for _ in range(size)], worker)

    def _watermark(self) -> int:
        """The oldest closure id not finished: parameter servers may forget older ones."""
        while self._pending[0][1].value.done():
            heapq.heappop(self._pending)
        return self._pending[0][0]

    def _submit(self, closures: list, worker: int) -> None:
        shipped = self._shipped[worker]
        calls = []
        for closure in closures:
            blob = None if closure.fn_id in shipped else closure.fn_blob
            shipped.add(closure.fn_id)
            closure.attempts += 1
            calls.append((closure.closure_id, closure.fn_id, blob, closure.args_blob,
                          closure.var_ids))
        # ``follows``: the worker is busy, so it starts this call right after the one before
        # and the values that one brought back are fresh.
        ref = self._cluster.workers[worker].run.remote(calls, coordinator_writes(),
                                                        self._load[worker] > 0, self._fresh,
                                                        self._watermark(), self._fast)
        self._in_flight[ref] = (closures, worker, self._cluster.generation[worker])
        self._load[worker] += 1

    def _fail(self, error: BaseException) -> None:
        # TF: the first error cancels what is queued; closures running are waited out.
        if self._error is None:
            self._error = error
        for closure in self._queue:
            closure.value.cancel()
        self._queue.clear()

    # -- the watching thread ----------------------------------------------------------------------
    def _watch(self) -> None:
        ray = ray_support.ray_module()
        while True:
            with self._cond:
                while not self._in_flight and not self._closed:
                    self._cond.wait()
                if self._closed and not self._in_flight:
                    return
                refs = list(self._in_flight)
            try:
                # Short waits: closures submitted meanwhile are watched from the next round.
                ready, _ = ray.wait(refs, num_returns=1, timeout=0.01)
                for ref in ready:
                    self._finish(ray, ref)
            except Exception as e:  # noqa: BLE001 (Ray gone, a replacement that failed...)
                self._abandon(e)

    def _abandon(self, cause: BaseException) -> None:
        # The watcher cannot follow the calls in flight any more: their closures fail (join()
        # must not wait for them forever) and the queue is cancelled, as after any error.
        error = RuntimeError(f"ClusterCoordinator: lost track of the running functions "
                             f"({type(cause).__name__}: {cause}).")
        with self._cond:
            for closures, _, _ in self._in_flight.values():
                for closure in closures:
                    if not closure.value.done():
                        closure.value.set_error(error)
            self._in_flight.clear()
            self._load = [0] * len(self._load)
            self._fail(error)
            self._cond.notify_all()

    def _finish(self, ray, ref) -> None:
        try:
            outcomes = ray.get(ref)
        except ray_support.actor_died_errors() as e:
            outcomes = None
            died = str(e)
        except Exception as e:  # noqa: BLE001 (anything else Ray raises is the call's end)
            outcomes = [("error", None, f"{type(e).__name__}: {e}", str(e))]
        with self._cond:
            closures, worker, generation = self._in_flight.pop(ref)
            self._load[worker] -= 1
            if outcomes is None:
                self._worker_died(closures, worker, generation, died)
            else:
                outcomes = list(outcomes) + [("skipped",)] * (len(closures) - len(outcomes))
                again = []
                for closure, outcome in zip(closures, outcomes):
                    if outcome[0] == "missing":  # the worker lacks the function: resend it
                        self._shipped[worker].discard(closure.fn_id)
                        again.append(closure)
                    else:
                        self._resolve(closure, worker, outcome)
                for closure in reversed(again):
                    if self._error is not None:
                        closure.value.cancel()
                    else:
                        closure.attempts -= 1
                        self._queue.appendleft(closure)
            self._fill()
            self._cond.notify_all()

    def _resolve(self, closure, worker, outcome) -> None:
        kind = outcome[0]
        if kind == "ok":
            try:
                result = unpack(outcome[1])
            except Exception as e:  # noqa: BLE001 (a result this process cannot unpickle)
                error = RuntimeError(f"ClusterCoordinator: the result of a scheduled function "
                                     f"on worker {worker} cannot be unpickled here: "
                                     f"{type(e).__name__}: {e}")
                closure.value.set_error(error)
                self._fail(error)
                return
            closure.value.set_result(result)
        elif kind == "skipped":  # after a failed closure of the same call: never started
            closure.value.cancel()

        elif kind == "ps":
            error = UnavailableError(ps_unavailable(outcome[1], "running a scheduled function",
                                                    outcome[2]))
            closure.value.set_error(error)
            self._fail(error)
        else:
            _, error, text, remote_tb = outcome
            if error is None:
                error = RuntimeError(f"ClusterCoordinator: a scheduled function failed on "
                                     f"worker {worker}: {text}")
            error = with_remote_traceback(error, f"/job:worker/replica:0/task:{worker}",
                                          remote_tb)
            closure.value.set_error(error)
            self._fail(error)

    def _worker_died(self, closures, worker, generation, message) -> None:
        if self._cluster.closed:  # shut down: nothing to re-run on
            error = RuntimeError("ClusterCoordinator: the cluster was shut down "
                                 "(resolver.shutdown()) while functions were running.")
            for closure in closures:
                closure.value.set_error(error)
            self._fail(error)
            return
        if self._cluster.replace(worker, generation):
            self._shipped[worker] = set()
        # Back to the front of the queue, in order; re-sent one per call (``_fill``), so a
        # function that kills its worker each time is the one that reaches MAX_ATTEMPTS.
        for closure in reversed(closures):
            if self._error is not None:  # TF: no re-run once an error is pending
                closure.value.cancel()
            elif closure.attempts >= MAX_ATTEMPTS:
                error = RuntimeError(
                    f"ClusterCoordinator: a scheduled function was started {closure.attempts} "
                    f"times and each time its worker died (last: "
                    f"{message.splitlines()[0] if message else ''}).")
                closure.value.set_error(error)
                self._fail(error)
            else:
                self._queue.appendleft(closure)  # same id: its updates apply at most once
