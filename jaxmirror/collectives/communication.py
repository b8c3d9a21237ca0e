"""``CommunicationOptions`` and ``CommunicationImplementation``: how collectives communicate.

TF's ``tf.distribute.experimental.CommunicationOptions``, accepted by ``all_reduce``,
``reduce_to``, ``batch_reduce_to`` and ``MultiWorkerMirroredStrategy``. ``bytes_per_pack``
packs the leaves of a nest into buffers of about that size (one collective each);
``wire_dtype`` (jaxmirror's addition) sends each replica's floats in a narrower dtype and
accumulates and returns the sums in their own; ``timeout_seconds`` bounds how long joining a cluster may take.
``implementation`` is recorded: XLA compiles the collectives (NCCL on GPUs, gloo between CPU
processes, a ring either way).
"""

from __future__ import annotations

import enum
import numbers

import jax.numpy as jnp


class CommunicationImplementation(enum.Enum):
    """Which collective implementation to prefer (TF's enum of that name).

    ``AUTO`` lets the runtime choose, ``RING`` asks for ring algorithms (gloo between CPU
    processes), ``NCCL`` for NVIDIA's library (GPUs only).

    Example:
        >>> import jaxmirror
        >>> jaxmirror.experimental.CommunicationImplementation.NCCL.value
        'NCCL'
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


class CommunicationOptions:
    """Options for cross-replica communication (``tf.distribute.experimental.CommunicationOptions``).

    Args:
        bytes_per_pack: group whole leaves into packs of about this many bytes, one
            collective each; 0 (the default): the cross-device ops' ``num_packs`` decides.
        timeout_seconds: how long cluster start-up may take before it fails with an error
            naming the workers that never joined; ``None`` takes the default (300 s, as
            ``jax.distributed``).
        implementation: a ``CommunicationImplementation`` (or its name, e.g. ``"NCCL"``).
        wire_dtype: ``"bfloat16"`` or ``"float16"`` (or ``"float32"``: as they are) to send
            each replica's wider floats in (jaxmirror's addition; TF has none). Only the
            values go narrowed, each rounded once (a MEAN's divided by the replica count
            first); sums are accumulated, sent back and returned in the values' own dtype
            (float32 in, float32 out), so a sum beyond the wire's range or precision is exact
            (8 x 40000 over float16 is 320000.0), and the wire saves about a quarter of the
            traffic, not half. A value float16 cannot hold (beyond 65504) arrives as ``inf``,
            as any cast to float16 gives it, and the sum is ``inf``: never a wrong finite
            number, and not checked (a check would cost every step a reduction and a sync);
            bfloat16 has float32's range. ``None`` (the default) sends values as they are.

    Raises:
        ValueError: for a negative ``bytes_per_pack``, a ``timeout_seconds`` that is not a
            positive number, an unknown ``implementation``, or another ``wire_dtype``.

    Example:
        >>> import jaxmirror
        >>> options = jaxmirror.experimental.CommunicationOptions(timeout_seconds=30)
        >>> options.timeout_seconds, options.implementation.name
        (30, 'AUTO')
    """

    __slots__ = ("bytes_per_pack", "timeout_seconds", "implementation", "wire_dtype")

    def __init__(self, bytes_per_pack: int = 0, timeout_seconds=None,
                 implementation=CommunicationImplementation.AUTO, wire_dtype=None):
        bytes_per_pack = non_negative_int(bytes_per_pack, "CommunicationOptions",
                                          "bytes_per_pack")
        if timeout_seconds is not None and (
                isinstance(timeout_seconds, bool)
                or not isinstance(timeout_seconds, (int, float)) or not timeout_seconds > 0):
            raise ValueError(f"CommunicationOptions: `timeout_seconds` must be a positive "
                             f"number of seconds or None; got {timeout_seconds!r}.")
        given = implementation
        if isinstance(implementation, str):
            implementation = CommunicationImplementation.__members__.get(implementation.upper())
        if not isinstance(implementation, CommunicationImplementation):
            names = ", ".join(m.name for m in CommunicationImplementation)
            raise ValueError(f"CommunicationOptions: `implementation` must be a "
                             f"CommunicationImplementation ({names}); got {given!r}.")
        self.bytes_per_pack = bytes_per_pack
        self.timeout_seconds = timeout_seconds
        self.implementation = implementation
        self.wire_dtype = _checked_wire_dtype(wire_dtype)

    def merge(self, options: "CommunicationOptions | None") -> "CommunicationOptions":
        """These options with the ones ``options`` sets overriding them (TF's ``merge``).

        Args:
            options: another ``CommunicationOptions`` or ``None``.

        Returns:
            A new ``CommunicationOptions``.

        Example:
            >>> from jaxmirror.collectives.communication import CommunicationOptions
            >>> a = CommunicationOptions(bytes_per_pack=1024)
            >>> a.merge(CommunicationOptions(timeout_seconds=5)).bytes_per_pack
            1024
        """
        if options is None:
            return self
        if not isinstance(options, CommunicationOptions):
            raise ValueError(f"CommunicationOptions.merge: `options` must be a "
                             f"CommunicationOptions or None; got {options!r}.")
        auto = CommunicationImplementation.AUTO
        return CommunicationOptions(
            options.bytes_per_pack or self.bytes_per_pack,
            options.timeout_seconds if options.timeout_seconds is not None
            else self.timeout_seconds,
            options.implementation if options.implementation is not auto
            else self.implementation,
            options.wire_dtype if options.wire_dtype is not None else self.wire_dtype)

    def __repr__(self) -> str:
        return (f"CommunicationOptions(bytes_per_pack={self.bytes_per_pack}, "
                f"timeout_seconds={self.timeout_seconds}, "
                f"implementation={self.implementation}"
                + (f", wire_dtype={self.wire_dtype.name}" if self.wire_dtype is not None else "")
                + ")")


def non_negative_int(value, api: str, arg_name: str) -> int:
    """``value`` as an int if it is a non-negative integer (numpy ones too), else ValueError.

    Args:
        value: what was given.
        api: the API name, for the error.
        arg_name: the argument's name, for the error.

    Returns:
        ``int(value)``.

    Example:
        >>> non_negative_int(3, "NcclAllReduce", "num_packs")
        3
    """
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{api}: `{arg_name}` must be a non-negative int; got {value!r}.")
    return int(value)


def _checked_wire_dtype(wire_dtype):
    if wire_dtype is None:
        return None
    try:
        dtype = jnp.dtype(wire_dtype)
    except TypeError:
        dtype = None
    if dtype not in _WIRE_DTYPES:
        # Narrower floats (float8) would round sums away and overflow at a few hundred.
        raise ValueError(f"CommunicationOptions: `wire_dtype` must be 'bfloat16', 'float16' "
                         f"or 'float32', or None; got {wire_dtype!r}.")
    return dtype


_WIRE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
