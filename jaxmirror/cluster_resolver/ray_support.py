"""Ray is an optional dependency (``pip install 'jaxmirror[ray]'``): import it on first use."""

from __future__ import annotations


def ray_module():
    """The ``ray`` module, imported now.

    Returns:
        The module.

    Raises:
        ImportError: when Ray is not installed, saying how to install it.

    Example:
        >>> ray_module().__name__
        'ray'
    """
    try:
        import ray
    except ImportError as e:
        raise ImportError("jaxmirror's parameter-server training runs on Ray, which is not "
                          "installed; install it with: pip install 'jaxmirror[ray]'") from e
    return ray


def actor_died_errors() -> tuple:
    """The exception types Ray raises for a call on an actor whose process died.

    Returns:
        A tuple of exception classes.

    Example:
        >>> all(issubclass(t, Exception) for t in actor_died_errors())
        True
    """
    exceptions = ray_module().exceptions
    return (exceptions.RayActorError, exceptions.ActorUnavailableError)
