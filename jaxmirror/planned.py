"""TF names jaxmirror has not built yet: using one says it is planned and what to use today.

``jaxmirror.MultiWorkerMirroredStrategy``, ``jaxmirror.cluster_resolver.*`` and
``jaxmirror.experimental.CentralStorageStrategy`` (and the rest below) are what TF users reach
for first; a bare ``AttributeError`` would read as a typo. Each is a placeholder class whose
construction raises ``NotImplementedError`` with the plan and today's alternative; the real
classes replace these entries as they land.

Example:
    >>> import jaxmirror
    >>> jaxmirror.MultiWorkerMirroredStrategy()
    Traceback (most recent call last):
    ...
    NotImplementedError: jaxmirror.MultiWorkerMirroredStrategy is planned but not built yet ...
"""

from __future__ import annotations

_ONE_MACHINE = "jaxmirror.MirroredStrategy over this machine's devices"
_RESOLVER = ("cluster resolvers (TF_CONFIG, Slurm, Ray) for multi-worker and parameter-server "
             "training",
             "a one-machine strategy (MirroredStrategy), which needs no cluster resolver")

# namespace -> name -> (what it will be, what to use today)
PLANNED = {
    "jaxmirror": {
        "MultiWorkerMirroredStrategy": (
            "synchronous training on many machines on jax.distributed", _ONE_MACHINE),
    },
    "jaxmirror.experimental": {
        "MultiWorkerMirroredStrategy": (
            "synchronous training on many machines on jax.distributed", _ONE_MACHINE),
        "CentralStorageStrategy": (
            "variables kept once on a parameter device, compute mirrored", _ONE_MACHINE),
        "ParameterServerStrategy": (
            "asynchronous parameter-server training on Ray", _ONE_MACHINE),
        "CommunicationOptions": (
            "all-reduce options (bytes_per_pack, timeout_seconds, implementation)",
            "the default: XLA picks the all-reduce algorithm for the devices"),
        "CommunicationImplementation": (
            "the all-reduce implementation enum (AUTO, RING, NCCL)",
            "the default: XLA picks the all-reduce algorithm for the devices"),
    },
    "jaxmirror.cluster_resolver": {
        name: _RESOLVER for name in ("ClusterResolver", "ClusterSpec", "RayClusterResolver",
                                     "SimpleClusterResolver", "SlurmClusterResolver",
                                     "TFConfigClusterResolver")
    },
}


def _placeholder(qualname: str, what: str, instead: str) -> type:
    message = (f"{qualname} is planned but not built yet ({what}); today, use {instead}.")

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(message)

    return type(qualname.rsplit(".", 1)[1], (), {
        "__init__": __init__, "__doc__": f"Planned: {what}. Today: {instead}.",
        "__module__": qualname.rsplit(".", 1)[0]})


class PlannedNamespace:
    """A namespace of planned names only (``jaxmirror.cluster_resolver`` until it is built).

    Args:
        qualname: its dotted name.

    Example:
        >>> import jaxmirror
        >>> jaxmirror.cluster_resolver.TFConfigClusterResolver()
        Traceback (most recent call last):
        ...
        NotImplementedError: jaxmirror.cluster_resolver.TFConfigClusterResolver is planned ...
    """

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __getattr__(self, name: str):
        return planned_attribute(self._qualname, name)

    def __repr__(self) -> str:
        return f"<planned namespace {self._qualname}>"


def planned_attribute(namespace: str, name: str):
    """The placeholder for ``namespace.name`` (for a module's ``__getattr__``).

    Args:
        namespace: ``"jaxmirror"``, ``"jaxmirror.experimental"`` or
            ``"jaxmirror.cluster_resolver"``.
        name: the attribute asked for.

    Returns:
        A placeholder class (constructing it raises ``NotImplementedError``) or, for
        ``jaxmirror.cluster_resolver``, a ``PlannedNamespace``.

    Raises:
        AttributeError: for names that are not planned.

    Example:
        >>> planned_attribute("jaxmirror.experimental", "CentralStorageStrategy").__name__
        'CentralStorageStrategy'
    """
    qualname = f"{namespace}.{name}"
    if qualname in PLANNED:
        return PlannedNamespace(qualname)
    entry = PLANNED.get(namespace, {}).get(name)
    if entry is None:
        raise AttributeError(f"module {namespace!r} has no attribute {name!r}")
    return _placeholder(qualname, *entry)
