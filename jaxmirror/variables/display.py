"""How a variable prints: TF's ``<tf.Variable 'name:0' shape=... dtype=..., numpy=...>``."""

from __future__ import annotations

import numpy as np


def component_reprs(var, components, num_replicas: int) -> list[str]:
    """One TF-style line per component of ``var`` (``name:0``, ``name/replica_1:0``, ...).

    Args:
        var: the variable (its ``name``, ``shape`` and ``dtype`` are shown).
        components: a zero-argument function returning its components as arrays.
        num_replicas: how many components to show when they cannot be read (traced, or on
            another process's devices).

    Returns:
        A list of strings.

    Example:
        >>> import jaxmirror
        >>> v = jaxmirror.Variable(2.0, name="w")
        >>> component_reprs(v, lambda: (v.numpy(),), 1)
        ["<jaxmirror.Variable 'w:0' shape=() dtype=float32, numpy=2.0>"]
    """
    try:
        comps = [np.asarray(c) for c in components()]
    except Exception:  # traced, or not addressable from this process
        comps = [None] * num_replicas
    names = [f"{var.name}:0"] + [f"{var.name}/replica_{i}:0" for i in range(1, len(comps))]
    # As TF prints them: numpy=2.0 for a scalar, numpy=array([...], dtype=...) otherwise.
    text = [repr(c.item()) if c is not None and c.ndim == 0 else repr(c) for c in comps]
    return [f"<jaxmirror.Variable '{n}' shape={var.shape} dtype={var.dtype}, numpy={t}>"
            for n, t in zip(names, text)]
