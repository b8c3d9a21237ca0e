"""``RunOptions``: options for ``Strategy.run``."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Options for ``Strategy.run`` (``tf.distribute.RunOptions``, with JAX's own knobs).

    Args:
        donate_argnums: positions of ``args`` whose buffers the step may reuse for its outputs
            (``jax.jit``'s donation): pass the params' position so updated params are written in
            place of the old ones. A donated argument must not be used after the call.

    Example:
        >>> import jax.numpy as jnp, jaxmirror
        >>> s = jaxmirror.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> params = s.run(lambda: jnp.zeros(3))
        >>> new = s.run(lambda p: p + 1, args=(params,),
        ...             options=jaxmirror.RunOptions(donate_argnums=(0,)))
        >>> new.tolist()
        [1.0, 1.0, 1.0]
    """

    donate_argnums: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "donate_argnums",
                           argnums(self.donate_argnums, "RunOptions", "donate_argnums"))


def argnums(nums, where: str, name: str) -> tuple:
    """Argument positions given as an int or a sequence of them, as a tuple.

    Args:
        nums: an int or a sequence of ints.
        where: the API name, for the error.
        name: the parameter's name, for the error.

    Returns:
        The positions as a tuple.

    Raises:
        ValueError: unless every position is a non-negative int.

    Example:
        >>> argnums(1, "RunOptions", "donate_argnums")
        (1,)
    """
    positions = (nums,) if isinstance(nums, int) else tuple(nums)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in positions):
        raise ValueError(f"{where}: `{name}` must be non-negative ints; got {nums!r}.")
    return positions
