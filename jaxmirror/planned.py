"""TF names jaxmirror has not built yet: using one says it is planned and what to use today.

``jaxmirror.experimental.ParameterServerStrategy`` and
``jaxmirror.cluster_resolver.RayClusterResolver`` are what TF users reach for; a bare
``AttributeError`` would read as a typo. Each is a placeholder class whose construction raises
``NotImplementedError`` with the plan and today's alternative; the real classes replace these
entries as they land.

Example:
    >>> import jaxmirror
    >>> jaxmirror.experimental.ParameterServerStrategy(None)
    Traceback (most recent call last):
    ...
    NotImplementedError: jaxmirror.experimental.ParameterServerStrategy is planned but not built yet ...
"""

from __future__ import annotations

_SYNCHRONOUS = ("jaxmirror.MultiWorkerMirroredStrategy (synchronous training across workers) "
                "or jaxmirror.MirroredStrategy on one machine")

# namespace -> name -> (what it will be, what to use today)
PLANNED = {
    "jaxmirror.experimental": {
        "ParameterServerStrategy": (
            "asynchronous parameter-server training on Ray", _SYNCHRONOUS),
    },
    "jaxmirror.cluster_resolver": {
        "RayClusterResolver": (
            "a cluster of Ray actors for ParameterServerStrategy",
            "TFConfigClusterResolver, SimpleClusterResolver or SlurmClusterResolver with "
            + _SYNCHRONOUS),
    },
}


def _placeholder(qualname: str, what: str, instead: str) -> type:
    message = (f"{qualname} is planned but not built yet ({what}); today, use {instead}.")

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(message)

    return type(qualname.rsplit(".", 1)[1], (), {
        "__init__": __init__, "__doc__": f"Planned: {what}. Today: {instead}.",
        "__module__": qualname.rsplit(".", 1)[0]})


def planned_attribute(namespace: str, name: str):
    """The placeholder for ``namespace.name`` (for a module's ``__getattr__``).

    Args:
        namespace: ``"jaxmirror"``, ``"jaxmirror.experimental"`` or
            ``"jaxmirror.cluster_resolver"``.
        name: the attribute asked for.

    Returns:
        A placeholder class (constructing it raises ``NotImplementedError``).

    Raises:
        AttributeError: for names that are not planned.

    Example:
        >>> planned_attribute("jaxmirror.experimental", "ParameterServerStrategy").__name__
        'ParameterServerStrategy'
    """
    qualname = f"{namespace}.{name}"
    entry = PLANNED.get(namespace, {}).get(name)
    if entry is None:
        raise AttributeError(f"module {namespace!r} has no attribute {name!r}")
    return _placeholder(qualname, *entry)


def install_planned_names(module, namespace: str) -> None:
    """Make ``module``'s planned names (``PLANNED[namespace]``) placeholders, as a module
    ``__getattr__`` does: for a lower layer that cannot import this module itself.

    Args:
        module: the module object (e.g. ``jaxmirror.cluster_resolver``).
        namespace: its dotted name.

    Returns:
        None.

    Example:
        >>> import jaxmirror
        >>> jaxmirror.cluster_resolver.RayClusterResolver.__name__
        'RayClusterResolver'
    """
    def __getattr__(name):
        return planned_attribute(namespace, name)

    module.__getattr__ = __getattr__
