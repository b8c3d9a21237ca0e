"""The errors jaxmirror raises for failures between processes (TF's ``tf.errors`` names).

A multi-worker run raises these on every worker when the cluster breaks: ``UnavailableError``
when a worker failed or is gone, ``DeadlineExceededError`` when a call that communicates between
workers ran past ``CommunicationOptions(timeout_seconds)``, ``CollectiveMismatchError`` when
the workers made different calls where the same one was due. Parameter-server training adds
``CancelledError`` and ``OutOfRangeError``.

Example:
    >>> from jaxmirror import errors
    >>> issubclass(errors.UnavailableError, RuntimeError)
    True
"""

from __future__ import annotations

import concurrent.futures


class UnavailableError(RuntimeError):
    """A worker or parameter server failed or is gone (TF's ``tf.errors.UnavailableError``).

    In a multi-worker run every other worker raises it (or, when it is blocked in a
    collective, prints it and exits with code 1) naming the worker and what it raised.
    Training cannot go on without it: restart the cluster and restore from a checkpoint.

    Example:
        >>> from jaxmirror.errors import UnavailableError
        >>> str(UnavailableError("worker 1 (127.0.0.1:2222) raised ValueError: boom"))
        'worker 1 (127.0.0.1:2222) raised ValueError: boom'
    """


class DeadlineExceededError(TimeoutError):
    """A call between workers did not finish within ``CommunicationOptions(timeout_seconds)``
    (TF's ``tf.errors.DeadlineExceededError``).

    Example:
        >>> from jaxmirror.errors import DeadlineExceededError
        >>> issubclass(DeadlineExceededError, TimeoutError)
        True
    """


class CollectiveMismatchError(RuntimeError):
    """Workers made different calls where every worker must make the same one.

    Steps, ``strategy.reduce``/``gather``, metric results, ``checkpoint.save``/``restore`` and
    iterating a distributed dataset communicate between the workers, so every worker must make
    them, in the same order, with the same shapes (TF requires it too and hangs otherwise).
    Raised on every worker, naming what each one called.

    Example:
        >>> from jaxmirror.errors import CollectiveMismatchError
        >>> issubclass(CollectiveMismatchError, RuntimeError)
        True
    """


class CancelledError(concurrent.futures.CancelledError):
    """A scheduled function that never ran: an earlier one failed and the queue was cancelled
    (TF's ``tf.errors.CancelledError``). Schedule it again.

    Example:
        >>> from jaxmirror.errors import CancelledError
        >>> import concurrent.futures
        >>> issubclass(CancelledError, concurrent.futures.CancelledError)
        True
    """


class OutOfRangeError(Exception):
    """A scheduled function's ``next(iterator)`` found its per-worker dataset exhausted (TF's
    ``tf.errors.OutOfRangeError``; the function raised ``StopIteration``).

    Repeat the dataset, or schedule no more steps than it has batches.

    Example:
        >>> from jaxmirror.errors import OutOfRangeError
        >>> issubclass(OutOfRangeError, StopIteration)
        False
    """


for _error in (UnavailableError, DeadlineExceededError, CollectiveMismatchError, CancelledError,
               OutOfRangeError):
    _error.__module__ = "jaxmirror.errors"  # as users import and see them
del _error

__all__ = ["CancelledError", "CollectiveMismatchError", "DeadlineExceededError",
           "OutOfRangeError", "UnavailableError"]
