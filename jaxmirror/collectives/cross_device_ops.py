"""``CrossDeviceOps``: TF's choice of all-reduce implementation, kept for compatibility.

In jaxmirror every collective is compiled by XLA into the step's program, which picks the
algorithm for the hardware (NCCL on GPUs, its own on CPUs). These classes are accepted where TF
takes them and remember their settings, so TF code passes them unchanged.
"""

from __future__ import annotations


class CrossDeviceOps:
    """Base class of cross-device reduction choices (``tf.distribute.CrossDeviceOps``).

    Example:
        >>> import jaxmirror
        >>> isinstance(jaxmirror.NcclAllReduce(), jaxmirror.CrossDeviceOps)
        True
    """

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class _PackedAllReduce(CrossDeviceOps):
    def __init__(self, num_packs: int = 1):
        if not isinstance(num_packs, int) or isinstance(num_packs, bool) or num_packs < 0:
            raise ValueError(f"{type(self).__name__}: `num_packs` must be a non-negative int; "
                             f"got {num_packs!r}.")
        self.num_packs = num_packs


class NcclAllReduce(_PackedAllReduce):
    """All-reduce with NCCL (``tf.distribute.NcclAllReduce``); XLA's GPU collectives use NCCL.

    Args:
        num_packs: how many packs gradients are split into (accepted, unused by XLA).

    Example:
        >>> import jaxmirror
        >>> jaxmirror.NcclAllReduce(num_packs=2).num_packs
        2
    """


class HierarchicalCopyAllReduce(_PackedAllReduce):
    """Hierarchical-copy all-reduce (``tf.distribute.HierarchicalCopyAllReduce``).

    Args:
        num_packs: how many packs gradients are split into (accepted, unused by XLA).

    Example:
        >>> import jaxmirror
        >>> jaxmirror.HierarchicalCopyAllReduce().num_packs
        1
    """


class ReductionToOneDevice(CrossDeviceOps):
    """Reduce to one device, then broadcast (``tf.distribute.ReductionToOneDevice``).

    Args:
        reduce_to_device: the intermediate device's name, or ``None``.
        accumulation_fn: accepted for TF compatibility.

    Example:
        >>> import jaxmirror
        >>> jaxmirror.ReductionToOneDevice("/cpu:0").reduce_to_device
        '/cpu:0'
    """

    def __init__(self, reduce_to_device=None, accumulation_fn=None):
        self.reduce_to_device = reduce_to_device
        self.accumulation_fn = accumulation_fn
