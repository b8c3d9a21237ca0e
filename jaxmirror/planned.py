"""TF names jaxmirror has not built yet: using one says it is planned and what to use today.

A bare ``AttributeError`` on a TF name users reach for reads as a typo. Each name listed in
``PLANNED`` is a placeholder class whose construction raises ``NotImplementedError`` with the
plan and today's alternative; the real classes replace these entries as they land (every TF
name planned so far has landed, so the table is empty).

Example:
    >>> import jaxmirror
    >>> jaxmirror.experimental.NoSuchThing
    Traceback (most recent call last):
    ...
    AttributeError: module 'jaxmirror.experimental' has no attribute 'NoSuchThing'
"""

from __future__ import annotations

# namespace -> name -> (what it will be, what to use today)
PLANNED: dict = {}


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
        >>> planned_attribute("jaxmirror.experimental", "NoSuchThing")
        Traceback (most recent call last):
        ...
        AttributeError: module 'jaxmirror.experimental' has no attribute 'NoSuchThing'
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
        >>> hasattr(jaxmirror.cluster_resolver, "NoSuchResolver")
        False
    """
    def __getattr__(name):
        return planned_attribute(namespace, name)

    module.__getattr__ = __getattr__
