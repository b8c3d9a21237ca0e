"""``RemoteValue``: the result of a scheduled function, ready once a worker has run it."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp

from jaxmirror.coordinator.errors import CancelledError


class RemoteValue:
    """What ``ClusterCoordinator.schedule`` returns at once (``tf.distribute.experimental.
    coordinator.RemoteValue``): the function's result, once it has run.

    ``fetch()`` waits for it and returns it with arrays as NumPy arrays; ``get()`` as
    ``jax.Array``s. A function that raised re-raises its error; one cancelled because an earlier
    function failed raises ``CancelledError``.

    Example:
        >>> rv = RemoteValue()
        >>> rv.set_result({"loss": 1.5})
        >>> rv.fetch()
        {'loss': 1.5}
    """

    def __init__(self):
        self._done = threading.Event()
        self._value = None
        self._error = None

    def set_result(self, value) -> None:
        """Resolve with ``value`` (called by the coordinator).

        Args:
            value: the function's result, arrays as NumPy arrays.

        Returns:
            ``None``.
        """
        self._value = value
        self._done.set()

    def set_error(self, error: BaseException) -> None:
        """Resolve with an error (the function's, or a ``CancelledError``).

        Args:
            error: the exception ``fetch`` raises.

        Returns:
            ``None``.
        """
        self._error = error
        self._done.set()

    def cancel(self) -> None:
        """Resolve as cancelled: the function never ran.

        Returns:
            ``None``.
        """
        self.set_error(CancelledError(
            "ClusterCoordinator: this function was cancelled because an earlier scheduled "
            "function failed (its error was raised by join(), done() or schedule()); schedule "
            "it again."))

    def done(self) -> bool:
        """Whether the value is ready (or failed, or was cancelled)."""
        return self._done.is_set()

    def fetch(self, timeout: float | None = None):
        """Wait for the result and return it with NumPy arrays (``RemoteValue.fetch``).

        Args:
            timeout: seconds to wait at most; ``None`` waits as long as it takes.

        Returns:
            The scheduled function's result.

        Raises:
            The function's error; ``CancelledError`` if it was cancelled; ``TimeoutError``.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"RemoteValue.fetch: not ready after {timeout} s.")
        if self._error is not None:
            raise self._error
        return self._value

    def get(self, timeout: float | None = None):
        """Like ``fetch``, with arrays as ``jax.Array``s (``RemoteValue.get``).

        Args:
            timeout: seconds to wait at most.

        Returns:
            The scheduled function's result.
        """
        return jax.tree.map(jnp.asarray, self.fetch(timeout))

    def __repr__(self) -> str:
        state = ("failed" if self._error is not None else "ready") if self.done() else "pending"
        return f"<RemoteValue {state}>"

    def __reduce__(self):
        raise ValueError("ClusterCoordinator.schedule: a RemoteValue cannot be passed to a "
                         "scheduled function (TF does not allow it either); fetch() it first "
                         "and pass the value.")
