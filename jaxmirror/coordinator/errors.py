"""The errors parameter-server training raises (TF's ``tf.errors`` names)."""

from __future__ import annotations

import concurrent.futures


class UnavailableError(RuntimeError):
    """A parameter server (or the cluster) is gone (TF's ``tf.errors.UnavailableError``).

    Training cannot go on without a parameter server's variables: restart the cluster and
    restore them from a checkpoint (``jaxmirror.checkpoint``).

    Example:
        >>> from jaxmirror.coordinator.errors import UnavailableError
        >>> issubclass(UnavailableError, RuntimeError)
        True
    """


class CancelledError(concurrent.futures.CancelledError):
    """A scheduled function that never ran: an earlier one failed and the queue was cancelled
    (TF's ``tf.errors.CancelledError``). Schedule it again.

    Example:
        >>> from jaxmirror.coordinator.errors import CancelledError
        >>> import concurrent.futures
        >>> issubclass(CancelledError, concurrent.futures.CancelledError)
        True
    """


class OutOfRangeError(Exception):
    """A scheduled function's ``next(iterator)`` found its per-worker dataset exhausted (TF's
    ``tf.errors.OutOfRangeError``; the function raised ``StopIteration``).

    Repeat the dataset, or schedule no more steps than it has batches.

    Example:
        >>> from jaxmirror.coordinator.errors import OutOfRangeError
        >>> issubclass(OutOfRangeError, StopIteration)
        False
    """


def with_remote_traceback(error: BaseException, where: str, remote_traceback: str):
    """``error`` with a note holding the traceback it had on the worker.

    Args:
        error: the exception rebuilt here (its original type and message).
        where: which worker, for the note.
        remote_traceback: the formatted traceback from the worker.

    Returns:
        ``error``.

    Example:
        >>> e = with_remote_traceback(ValueError("bad"), "worker 0", "Traceback ...")
        >>> e.__notes__[0].splitlines()[0]
        'Remote traceback (raised on worker 0):'
    """
    error.add_note(f"Remote traceback (raised on {where}):\n{remote_traceback.rstrip()}")
    return error
