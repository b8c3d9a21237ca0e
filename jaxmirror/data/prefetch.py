"""A background thread that runs an iterator ahead of its consumer (prefetch to device)."""

from __future__ import annotations

import atexit
import queue
import threading
import time

_ITEM, _END, _ERROR = range(3)
_POLL_S = 0.05
_JOIN_AT_EXIT_S = 10.0

# Prefetch threads still running, with their stop flags. At interpreter exit each is stopped
# and joined: a daemon thread killed halfway through an XLA host-to-device copy aborts the
# process (SIGABRT). Threads, not Prefetchers: a dropped iterator's thread may still be copying.
_RUNNING: dict = {}
_RUNNING_LOCK = threading.Lock()


@atexit.register
def _stop_all() -> None:
    with _RUNNING_LOCK:
        running = list(_RUNNING.items())
    for _, stop in running:
        stop.set()
    deadline = time.monotonic() + _JOIN_AT_EXIT_S  # one wait for all, not one each
    for thread, _ in running:
        thread.join(max(0.0, deadline - time.monotonic()))


class Prefetcher:
    """Pull ``source`` on a daemon thread, keeping up to ``depth`` items ready.

    The thread blocks when ``depth`` items wait, so at most ``depth + 1`` items exist ahead of
    the consumer (the one being made included). An exception raised by ``source`` is raised by
    ``next`` in the consumer's thread, after the items made before it. ``close`` (also on
    garbage collection and at interpreter exit) stops the thread after the item it is making.

    Args:
        source: an iterator; it is only ever advanced by the prefetch thread.
        depth: how many finished items may wait.
        stop: the ``threading.Event`` that stops the thread (set by ``close``); the source may
            watch it too, to give up a long wait. A new one by default.

    Example:
        >>> p = Prefetcher(iter(range(3)), depth=1)
        >>> list(p)
        [0, 1, 2]
    """

    def __init__(self, source, depth: int, stop: threading.Event | None = None):
        self._queue = queue.Queue(maxsize=depth)
        self._stop = stop if stop is not None else threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, args=(source, self._queue, self._stop),
                                        name="jaxmirror-prefetch", daemon=True)
        with _RUNNING_LOCK:
            _RUNNING[self._thread] = self._stop
        self._thread.start()

    @staticmethod
    def _run(source, q, stop) -> None:
        # A static method holding no reference to the Prefetcher, so dropping the iterator
        # lets it be collected (and closed) while this thread waits.
        def put(item) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=_POLL_S)
                    return True
                except queue.Full:
                    continue
            return False

        try:
            for item in source:
                if not put((_ITEM, item)):
                    return
            put((_END, None))
        except BaseException as err:  # handed to the consumer, raised there
            put((_ERROR, err))
        finally:
            with _RUNNING_LOCK:
                _RUNNING.pop(threading.current_thread(), None)

    def __iter__(self):
        return self

    def __next__(self):
        while not self._done:
            try:
                kind, item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._stop.is_set():  # closed (by another thread) while we waited
                    self._done = True
                continue
            if kind == _ITEM:
                return item
            self._done = True
            self._stop.set()
            if kind == _ERROR:
                raise item
        raise StopIteration

    def close(self, timeout: float | None = 1.0) -> None:
        """End the iteration and stop the thread, waiting up to ``timeout`` s for it to finish.

        Args:
            timeout: how long to wait for the item being made (a host-to-device copy, or the
                source's ``next``); ``None`` waits for it whatever it takes.
        """
        self._done = True
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __del__(self):
        self._stop.set()


class Inline:
    """``Prefetcher``'s interface without the thread: each item is made when it is asked for.

    Args:
        source: an iterator (a generator: ``close`` closes it).

    Example:
        >>> it = Inline(iter(range(2)))
        >>> list(it)
        [0, 1]
    """

    def __init__(self, source):
        self._source = source

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._source)

    def close(self, timeout: float | None = None) -> None:
        """End the iteration (``timeout`` is accepted for ``Prefetcher``'s signature)."""
        del timeout
        close = getattr(self._source, "close", None)
        if close is not None:
            close()
        self._source = iter(())
