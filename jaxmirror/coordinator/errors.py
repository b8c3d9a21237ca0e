"""The errors parameter-server training raises (TF's ``tf.errors`` names, from ``core.errors``)."""

from __future__ import annotations

from jaxmirror.core.errors import CancelledError, OutOfRangeError, UnavailableError


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


__all__ = ["CancelledError", "OutOfRangeError", "UnavailableError", "with_remote_traceback"]
