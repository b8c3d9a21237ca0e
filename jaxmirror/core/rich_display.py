"""How jaxmirror objects show in Jupyter: small HTML tables (``_repr_html_``).

A notebook user asks "where does this value live, and what is in it?" far more often than a
script does. Every distributed value, variable and strategy answers with one table: a row per
device (or per shard, or per property), each with the device's TF name, shape, dtype and the
first few values. ``repr`` stays short; only Jupyter asks for the HTML.

Reading values for display never starts device work beyond copying the shown shards to the host,
and a value that cannot be read (traced, or on another worker's devices) says so instead of
failing: a display must never raise.
"""

from __future__ import annotations

import html

import jax
import numpy as np

from jaxmirror.core import _compat, devices

# How many leading values of each component a table shows.
PREVIEW_VALUES = 6
# What a table shows for an array a step was given with donate_argnums.
DELETED = "(deleted: donated to a step; use the step's results)"

_STYLE = ("<style>.jaxmirror-table td, .jaxmirror-table th {text-align: left; "
          "padding: 2px 8px; font-family: monospace;}</style>")


def preview(value, limit: int = PREVIEW_VALUES) -> str:
    """The first ``limit`` values of an array, flattened, as text (``…`` when there are more).

    Args:
        value: an array-like (a device array is copied to the host).
        limit: how many values to show.

    Returns:
        A str, e.g. ``"[0. 1. 2. …] (8 values)"`` or ``"2.5"``.

    Example:
        >>> import numpy as np
        >>> preview(np.arange(8.0), limit=3)
        '[0.0, 1.0, 2.0, …] (8 values)'
    """
    if _compat.is_tracer(value):
        return "(traced: no values until the step runs)"
    if isinstance(value, jax.Array) and value.is_deleted():
        return DELETED
    size = int(np.prod(np.shape(value)))
    if np.ndim(value) == 0:
        return repr(np.asarray(value).item())
    # Only the values shown leave the device, not the whole array.
    head = np.asarray(value.reshape(-1)[:limit] if isinstance(value, jax.Array)
                      else np.asarray(value).reshape(-1)[:limit])
    shown = ", ".join(repr(x) for x in head.tolist())
    more = f", …] ({size} values)" if size > limit else "]"
    return f"[{shown}{more}"


def device_label(device) -> str:
    """A device as a TF user reads it: ``CPU:1``, or ``task 1 GPU:0`` with several workers.

    Args:
        device: a ``jax.Device``.

    Returns:
        A str.

    Example:
        >>> import jax
        >>> device_label(jax.devices()[0])
        'CPU:0'
    """
    name = devices.tf_name(device)
    short = name.rsplit("/device:", 1)[1]
    return short if jax.process_count() == 1 else f"task {device.process_index} {short}"


def device_list(devices, limit: int = 16) -> str:
    """Devices as a short comma-separated list of ``device_label``s (cut after ``limit``).

    Args:
        devices: ``jax.Device``s.
        limit: how many to name before "…".

    Returns:
        A str.

    Example:
        >>> import jax
        >>> device_list(jax.devices()[:2])
        'CPU:0, CPU:1'
    """
    devices = list(devices)
    named = ", ".join(device_label(d) for d in devices[:limit])
    return named if len(devices) <= limit else f"{named}, … ({len(devices)} devices)"


def shard_rows(array, limit: int = PREVIEW_VALUES) -> list[list[str]]:
    """One ``[device, shape, dtype, values]`` row per shard of ``array`` this process holds
    (a ``PerReplica``'s stack shows its components instead: ``PerReplica.display_rows``).

    Args:
        array: a ``jax.Array`` (or anything array-like: one row, no device).
        limit: how many values each row shows.

    Returns:
        A list of rows of str, in device order.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> shard_rows(jnp.arange(3.0))[0][1:3]
        ['(3,)', 'float32']
    """
    if _compat.is_tracer(array):
        return [["(traced)", str(tuple(array.shape)), str(array.dtype), preview(array)]]
    if isinstance(array, jax.Array) and array.is_deleted():
        return [["", str(tuple(array.shape)), str(array.dtype), DELETED]]
    shards = getattr(array, "addressable_shards", None)
    if shards is None:
        host = np.asarray(array)
        return [["host", str(host.shape), str(host.dtype), preview(host, limit)]]
    rows = []
    for shard in sorted(shards, key=lambda s: (s.device.process_index, s.device.id)):
        data = shard.data
        rows.append([device_label(shard.device), str(tuple(data.shape)), str(data.dtype),
                     preview(data, limit)])
    return rows


def table(title: str, headers, rows, notes=()) -> str:
    """An HTML table: a bold title, a header row, one row per entry, then notes in small type.

    Args:
        title: the first line (escaped).
        headers: column names.
        rows: rows of str (escaped).
        notes: lines shown under the table.

    Returns:
        A str of HTML.

    Example:
        >>> "<td>CPU:0</td>" in table("x", ["device"], [["CPU:0"]])
        True
    """
    esc = html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in row) + "</tr>"
                   for row in rows)
    foot = "".join(f"<div><small>{esc(n)}</small></div>" for n in notes)
    return (f"{_STYLE}<div><b>{esc(title)}</b><table class='jaxmirror-table'>"
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{foot}</div>")


def property_table(title: str, items) -> str:
    """A two-column HTML table of ``(property, value)`` pairs.

    Args:
        title: the first line.
        items: ``(name, value)`` pairs; values are shown with ``str``.

    Returns:
        A str of HTML.

    Example:
        >>> "<td>replicas</td><td>2</td>" in property_table("s", [("replicas", 2)])
        True
    """
    return table(title, ["property", "value"], [[k, str(v)] for k, v in items])


def safe_html(make) -> str | None:
    """``make()``, or ``None`` (Jupyter then shows ``repr``) when it raises: a display never fails.

    Args:
        make: a zero-argument function returning the HTML.

    Returns:
        A str or None.

    Example:
        >>> safe_html(lambda: 1 / 0) is None
        True
    """
    try:
        return make()
    except Exception:  # noqa: BLE001 -- any failure falls back to the plain repr
        return None
