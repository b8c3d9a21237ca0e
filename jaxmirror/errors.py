"""``jaxmirror.errors``: the errors raised when workers fail or disagree (TF's ``tf.errors``).

Example:
    >>> import jaxmirror
    >>> try:
    ...     raise jaxmirror.errors.UnavailableError("worker 1 (127.0.0.1:2222) raised ValueError")
    ... except jaxmirror.errors.UnavailableError as error:
    ...     print(type(error).__module__, error)
    jaxmirror.errors worker 1 (127.0.0.1:2222) raised ValueError
"""

from jaxmirror.core.errors import (
    CancelledError,
    CollectiveMismatchError,
    DeadlineExceededError,
    OutOfRangeError,
    UnavailableError,
)

__all__ = ["CancelledError", "CollectiveMismatchError", "DeadlineExceededError",
           "OutOfRangeError", "UnavailableError"]
