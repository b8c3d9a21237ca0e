"""What a worker does when the cluster breaks: tell the others, learn of theirs, end, never hang.

Every joined worker shares one key of the coordination service's key-value store, the cluster's
failure record: the first worker whose program ends with an exception, or that finds the
cluster broken, writes there who failed, how, and the error class (``report``); every other
worker learns of it within about a second (``runtime/watch.py`` waits on that key, and the waits
of ``runtime/ledger.py`` look at it too) and ends with that error, naming the worker
(``end_for``). A worker blocked in a collective cannot be interrupted from Python, so after a
short grace it prints the same error and exits with code 1.

A worker whose program failed exits with code 1 without ``jax.distributed``'s shutdown barrier,
which would wait for the others and then ``abort()``; one whose program ended normally says so
(``ended``), so that a worker still waiting for it in a call that every worker must make can
name it at once, and waits for the others to end too (``runtime/connect.py``).
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys
import threading
import time
import traceback

from jaxmirror.cluster_resolver.cluster_spec import parse_address
from jaxmirror.core import _compat, errors

FAILURE_KEY = "jaxmirror/failure"
ENDED_PREFIX = "jaxmirror/ended/"
_END_GRACE_S = 2.0  # how long a main thread may take to raise before the process just exits
# What a collective says when it lost its peers (gloo between CPU processes): only then does a
# worker wait to learn which peer is gone before it reports its own error.
_PEER_FAILURE_MARKS = ("gloo all-reduce failed", "gloo all-gather failed", "gloo ",
                       "connection closed by peer", "connection reset by peer")
_ERRORS = {cls.__name__: cls for cls in (errors.UnavailableError, errors.DeadlineExceededError,
                                         errors.CollectiveMismatchError)}
_state = {"layout": None, "failed": False, "installed": False, "ending": None, "reported": False,
          "waiting": 0, "heartbeat_s": 10, "planned_exit": False}
_lock = threading.Lock()


def address_answers(address: str, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections at ``address`` (``host:port``).

    Args:
        address: ``host:port`` (IPv6 hosts in brackets).
        timeout: seconds to wait for the connection.

    Returns:
        A bool.

    Example:
        >>> address_answers("127.0.0.1:1")
        False
    """
    try:
        with socket.create_connection(parse_address(address), timeout=timeout):
            return True
    except OSError:
        return False


def error_text(message: str, me) -> str:
    """Another worker's failure record as this worker's error message.

    Args:
        message: the record's text (who failed, how).
        me: this worker's ``Task``.

    Returns:
        The message, saying that this worker stops too and what to do.

    Example:
        >>> error_text("worker 1 (h:1) raised ValueError: boom.", "worker 0 (h:0)")[-67:]
        'stops too; fix that, then restart every worker (from a checkpoint).'
    """
    return (f"{message.rstrip('.')}; this worker, {me}, stops too; fix that, then restart every "
            f"worker (from a checkpoint).")


def describe(error: BaseException) -> str:
    """``"ValueError: boom (at train.py:12)"``: an exception's type, message and the last line
    of the user's code it came through, for the other workers' messages.

    Args:
        error: the exception.

    Returns:
        One line (the message's first line, shortened to 300 characters).

    Example:
        >>> describe(ValueError("boom"))
        'ValueError: boom'
    """
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > 300:
        first = first[:297] + "..."
    line = f"{type(error).__name__}: {first}" if first else type(error).__name__
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ else []
    own = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    user = [f for f in frames if not f.filename.startswith(own) and "site-packages" not in
            f.filename and not f.filename.startswith("<frozen")]
    if user:
        line += f" (at {os.path.basename(user[-1].filename)}:{user[-1].lineno})"
    return line


def install(layout) -> None:
    """Watch this joined worker's uncaught errors (once per process).

    Args:
        layout: the cluster's ``Layout``.
    """
    _state["layout"] = layout
    if _state["installed"]:
        return
    _state["installed"] = True
    previous = sys.excepthook

    def hook(kind, value, tb):
        if isinstance(value, BaseException):
            shown = note_and_report(value)
            if shown is not value:
                kind, value, tb = type(shown), shown, shown.__traceback__
        previous(kind, value, tb)

    sys.excepthook = hook


def note_and_report(error: BaseException) -> BaseException:
    """This worker's program ended with ``error``: tell the other workers, unless ``error`` is
    the failure of another worker reaching this one; then return the error naming that worker
    (a collective that lost its peer becomes an ``errors.UnavailableError`` caused by it).

    Args:
        error: the exception that ended the program.

    Returns:
        The error to show: ``error``, or the one naming the worker that failed first.
    """
    layout = _state["layout"]
    if layout is None or (_state["planned_exit"] and isinstance(error, SystemExit)):
        return error  # alone, or leaving after a preemption checkpoint: not a failure
    mark_failed()
    if isinstance(error, tuple(_ERRORS.values())) and _state["reported"]:
        return error  # found by this worker's own wait, and recorded there (fail_here)
    ending = _state["ending"]
    if ending is None and looks_like_peer_failure(error):
        ending = _wait_for_peer_failure(layout)
    if ending is None:
        if isinstance(error, KeyboardInterrupt):
            report(f"{layout.me} was interrupted (KeyboardInterrupt)")
        else:
            report(f"{layout.me} raised {describe(error)}")
        return error
    if isinstance(error, ending[0]) and str(error) == ending[1]:
        return error
    shown = ending[0](ending[1])
    shown.__cause__ = error
    return shown


def looks_like_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing because a peer went away (gloo's words).

    Args:
        error: an exception.

    Returns:
        A bool.

    Example:
        >>> looks_like_peer_failure(ValueError("Gloo all-reduce failed: Connection closed by peer"))
        True
    """
    text = str(error).lower()
    return any(mark in text for mark in _PEER_FAILURE_MARKS)


def _wait_for_peer_failure(layout):
    """A collective failed under this worker: find out which worker is gone, so that the error
    can name it. A worker's own address stops answering as it dies (its presence socket; the
    chief's address is its service helper's, so the chief is named by the watch, after the
    heartbeat timeout); another worker may have recorded a failure; else the watch names the
    dead one."""
    deadline = time.monotonic() + heartbeat() + 8.0  # the watch names a silent one by then
    with waiting():
        while time.monotonic() < deadline:
            found = _state["ending"] or reported()
            if found is not None:
                return found
            gone = [t for i, t in enumerate(layout.tasks) if i not in (0, layout.process_id)
                    and not address_answers(t.address, timeout=0.5)]
            if gone:
                text = (f"{', '.join(map(str, gone))} stopped (its address no longer answers: "
                        f"killed, crashed, or its machine is gone)")
                report(text)
                return errors.UnavailableError, error_text(text, layout.me)
            time.sleep(0.2)
    return _state["ending"]


def report(text: str, error_class=errors.UnavailableError) -> None:
    """Record in the cluster's failure record that ``text`` happened (the first record stays).

    Args:
        text: who failed and how, e.g. ``"worker 1 (127.0.0.1:2222) raised ValueError: boom"``.
        error_class: what the other workers raise: ``errors.UnavailableError`` (a worker
            failed or is gone), ``DeadlineExceededError`` or ``CollectiveMismatchError``.
    """
    mark_failed()
    client = _compat.distributed_client()
    if client is None or _state["reported"]:
        return
    _state["reported"] = True
    record = {"process": _me(), "text": text, "kind": error_class.__name__}
    try:
        _compat.kv_set(client, FAILURE_KEY, json.dumps(record))
    except Exception:  # noqa: BLE001 - another worker's record came first, or the service is gone
        pass


def reported(client=None, timeout_ms: int = 0):
    """The failure another worker recorded, as this worker's error.

    Args:
        client: the distributed client (default: this process's).
        timeout_ms: how long to wait for a record (0: look once).

    Returns:
        ``(error class, message)``, or ``None`` (no record, or this worker's own).
    """
    client = client or _compat.distributed_client()
    layout = _state["layout"]
    if client is None or layout is None:
        return None
    text = (_compat.kv_get(client, FAILURE_KEY, timeout_ms) if timeout_ms
            else _compat.kv_try_get(client, FAILURE_KEY))
    if text is None:
        return None
    record = json.loads(text)
    if record["process"] == layout.process_id:
        return None  # this worker's own failure: it is ending already
    return (_ERRORS.get(record.get("kind"), errors.UnavailableError),
            error_text(record["text"], layout.me))


def ended(process: int) -> None:
    """Say that ``process``'s program ended normally (this worker's own, at exit).

    Args:
        process: the process index.
    """
    client = _compat.distributed_client()
    if client is not None:
        try:
            _compat.kv_set(client, f"{ENDED_PREFIX}{process}", "1", overwrite=True)
        except Exception:  # noqa: BLE001 - the service is gone: nobody left to tell
            pass


def has_ended(client, process: int) -> bool:
    """Whether worker ``process`` said its program ended normally.

    Args:
        client: the distributed client.
        process: the worker's process index.

    Returns:
        A bool.
    """
    return _compat.kv_try_get(client, f"{ENDED_PREFIX}{process}") is not None


def plan_exit(planned: bool = True) -> None:
    """This worker is about to exit on purpose, every worker at the same step (after a
    preemption checkpoint): its ``SystemExit`` is an end, not a failure to tell the others
    (``False``: the exit function returned; training goes on)."""
    _state["planned_exit"] = planned


def planned_exit() -> bool:
    """Whether an exit is planned: a ``SystemExit`` ends this worker as a finished program."""
    return _state["planned_exit"]


def joined():
    """This worker's ``Layout`` while it is joined to a cluster of several workers, else None."""
    return _state["layout"]


def left() -> None:
    """This worker left its cluster on purpose (``connect.leave``)."""
    _state["layout"] = None


def ending():
    """``(error class, message)`` when this worker is ending because the cluster broke."""
    return _state["ending"]


def check_not_ending(client=None) -> None:
    """Raise the error this worker ends with, if the cluster broke (found by the watch, or in
    the failure record now).

    Args:
        client: the distributed client, to look at the failure record too (else only what the
            watch found).

    Raises:
        errors.UnavailableError (or the error recorded): when it did.
    """
    found = _state["ending"]
    if found is None and client is not None:
        found = reported(client)
        if found is not None:
            with _lock:
                if _state["ending"] is None:
                    _state["ending"] = found
            mark_failed()
    if found is not None:
        raise found[0](found[1])


class waiting:
    """Marks the main thread as inside one of jaxmirror's own waits, which raise
    ``check_not_ending``'s error themselves (``end_for`` then does not raise into it)."""

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            _state["waiting"] += 1
        return self

    def __exit__(self, *exc):
        if threading.current_thread() is threading.main_thread():
            _state["waiting"] -= 1


def end_for(error_class, message: str) -> None:
    """End this worker because the cluster broke (called by the watch thread).

    The main thread gets ``error_class(message)`` raised into it (where it runs Python, or
    when it next does; jaxmirror's own waits raise it themselves); if the process still runs
    after a short grace (the main thread is blocked inside a collective, or caught the
    error), the message is printed as the error and the process exits with code 1.

    Args:
        error_class: the exception class (``errors.UnavailableError``, ...).
        message: what happened, naming the worker.
    """
    with _lock:
        if _state["ending"] is not None:
            return
        _state["ending"] = (error_class, message)
    mark_failed()
    if not _state["waiting"]:
        _raise_in_main_thread(error_class, message)
    time.sleep(_END_GRACE_S)
    exit_with(error_class, message)


def fail_here(error_class, message: str) -> BaseException:
    """This worker found the cluster broken (in one of jaxmirror's waits): record it for the
    others and return the error to raise (this worker's own finding, even when another
    worker's failure arrived meanwhile: both describe the same break).

    Args:
        error_class: the exception class.
        message: what happened, naming the workers and the call.

    Returns:
        ``error_class(message)``.
    """
    with _lock:
        if _state["ending"] is None:
            _state["ending"] = (error_class, message)
    report(message, error_class)
    return error_class(message)


def exit_with(error_class, message: str) -> None:
    """Print ``error_class: message`` as Python prints an uncaught error, and exit with code 1
    (without the shutdown barrier).

    Args:
        error_class: the exception class.
        message: its message.
    """
    _write_and_exit(f"jaxmirror.errors.{error_class.__name__}: {message}\n")


def _raise_in_main_thread(error_class, message: str) -> None:
    # An exception raised in another thread can only be given as a class: one that carries
    # the message, and shows as the public class.
    raised = type(error_class.__name__, (error_class,),
                  {"__init__": lambda self: error_class.__init__(self, message),
                   "__module__": "jaxmirror.errors"})
    ident = threading.main_thread().ident
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(raised))


def _write_and_exit(text: str) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing left to say
            pass
    try:
        os.write(2, text.encode("utf-8", "replace"))
    except OSError:
        pass
    os._exit(1)


def mark_failed() -> None:
    """Record that this worker failed, so its exit skips the coordinated shutdown."""
    _state["failed"] = True


def set_heartbeat(seconds: float) -> None:
    """How long a silent worker takes to be declared dead (seconds).

    Args:
        seconds: the heartbeat timeout this worker joined with.
    """
    _state["heartbeat_s"] = seconds


def heartbeat() -> float:
    """The heartbeat timeout this worker joined with (seconds)."""
    return _state["heartbeat_s"]


def _me():
    layout = _state["layout"]
    return None if layout is None else layout.process_id


def failed() -> bool:
    """Whether this worker failed (its program raised, or the cluster broke under it)."""
    return _state["failed"]


def exit_failed() -> None:
    """Exit with code 1 at once, skipping the shutdown barrier (this worker failed)."""
    _write_and_exit("")
