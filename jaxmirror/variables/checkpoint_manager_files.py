"""The file-system side of ``jaxmirror.checkpoint.CheckpointManager``: its state file, what a
new manager recovers from a directory, and the sweep of old checkpoints after a save.

Only the chief runs this code; the manager hands its results to the other workers. The state
file ``<directory>/checkpoint_state.json`` holds (TF keeps the same in its ``checkpoint`` file):

- ``checkpoints``: the active checkpoints, oldest first, each ``{"path": "<name>-<N>"``
  (relative to the directory), ``"timestamp"`` (``time.time()`` of its save), ``"written_ns"``
  (its orbax marker files' mtime: a checkpoint saved again since is seen to be newer)``}``;
- ``preserved``: those kept for good by ``keep_checkpoint_every_n_hours`` (never deleted, never
  taken back as active);
- ``latest`` (the last active path) and ``last_preserved_timestamp``.

It is replaced in one step (a sibling written, then renamed over it), and written before and
after old checkpoints are deleted, so a kill at any point leaves a file that, reconciled with
the directory by ``recovered``, names every complete checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import time
import warnings

from jaxmirror.variables import checkpoint_files as files

STATE_FILE = "checkpoint_state.json"
API = "jaxmirror.checkpoint.CheckpointManager"


def written_ns(path: str) -> int:
    """When orbax last wrote the checkpoint ``path`` (its marker files' mtime), -1 if never."""
    times = [-1]
    for marker in files.MARKERS:
        with contextlib.suppress(OSError):
            times.append(os.stat(os.path.join(path, marker)).st_mtime_ns)
    return max(times)


def _entries(directory: str) -> list:
    try:
        return os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _complete(directory: str, name: str) -> dict:
    """``{"<name>-<N>": N}`` for every complete checkpoint in ``directory``."""
    pattern = re.compile(rf"{re.escape(name)}-(-?\d+)")
    found = {}
    for entry in _entries(directory):
        match = pattern.fullmatch(entry)
        path = os.path.join(directory, entry)
        if match and os.path.isdir(path) and files.is_checkpoint(path):
            found[entry] = int(match[1])
    return found


def _with_siblings(directory: str, name: str) -> set:
    """The checkpoints that killed saves or deletions left siblings of (``checkpoint_files``)."""
    pattern = re.compile(rf"\.({re.escape(name)}--?\d+)\.jaxmirror-")
    return {m[1] for m in map(pattern.match, _entries(directory)) if m}


def clean_leftovers(directory: str, name: str) -> None:
    """Delete what killed saves, deletions and state writes left in ``directory``."""
    for rel in _with_siblings(directory, name) | {STATE_FILE}:
        files.remove_leftovers(os.path.join(directory, rel))


def write_state(directory: str, state: dict) -> None:
    """Replace the state file in one step (a sibling written, then renamed over it)."""
    final = os.path.join(directory, STATE_FILE)
    tmp = files.sibling(final, "new")  # a file, never a checkpoint: `files.recover` ignores it
    active = state["checkpoints"]
    try:
        with open(tmp, "w") as f:
            json.dump({"latest": active[-1]["path"] if active else None, **state}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _read_state(directory: str):
    """The state file's content, normalized; None if there is none (or it is unreadable)."""
    path = os.path.join(directory, STATE_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        entries = {key: [{"path": str(e["path"]), "timestamp": float(e["timestamp"]),
                          "written_ns": e.get("written_ns")} for e in data.get(key, [])]
                   for key in ("checkpoints", "preserved")}
        return {**entries, "last_preserved_timestamp": float(data["last_preserved_timestamp"])}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        warnings.warn(f"{API}: {path} is not a state file a CheckpointManager wrote ({error}); "
                      f"the checkpoints in {directory} are taken from the directory instead.",
                      stacklevel=2)
        return None


def recovered(directory: str, name: str) -> dict:
    """The manager's state for ``directory``: its state file reconciled with the directory.

    TF's recovery (timestamps from the future are set back to now; an active checkpoint no
    newer than ``last_preserved_timestamp`` is kept for good), and what a killed save or a lost
    state file left unrecorded: listed checkpoints that no longer exist are dropped, and complete
    checkpoints ``<name>-<N>`` not listed (or saved again since they were) become the newest
    active ones, ordered by ``N``. A save killed between its two renames is repaired first.

    Args:
        directory: the manager's directory (absolute).
        name: the checkpoints' name (``checkpoint_name``).

    Returns:
        ``{"checkpoints": [...], "preserved": [...], "last_preserved_timestamp": t}``.

    Raises:
        ValueError: ``directory`` is a file.
    """
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise ValueError(f"{API}: `directory` {directory!r} exists and is not a directory; "
                         f"give a new directory or one holding this manager's checkpoints.")
    for rel in _with_siblings(directory, name):
        files.recover(os.path.join(directory, rel))
    saved = _read_state(directory) or {"checkpoints": [], "preserved": []}
    now = time.time()
    # TF sets the clock back a little for a new directory, and never trusts one from the future.
    last = min(saved.get("last_preserved_timestamp", now - 1.0), now)
    on_disk = _complete(directory, name)
    preserved = [e for e in saved["preserved"] if e["path"] in on_disk]
    known = {e["path"] for e in preserved}
    active = []
    for e in saved["checkpoints"]:
        if e["path"] not in on_disk or e["path"] in known:
            continue
        e = {**e, "timestamp": min(e["timestamp"], now)}
        if e["written_ns"] not in (None, written_ns(os.path.join(directory, e["path"]))):
            continue  # saved again after the state was written: taken back below, as the newest
        known.add(e["path"])
        (active if e["timestamp"] > last else preserved).append(e)
    for rel in sorted((rel for rel in on_disk if rel not in known), key=on_disk.get):
        written = written_ns(os.path.join(directory, rel))
        active.append({"path": rel, "timestamp": min(written / 1e9, now), "written_ns": written})
    return {"checkpoints": active, "preserved": preserved, "last_preserved_timestamp": last}


def recorded_and_swept(directory: str, name: str, state: dict, rel: str, max_to_keep,
                       hours) -> dict:
    """The chief's part of a save: record ``rel`` as the newest checkpoint, delete the oldest
    beyond ``max_to_keep`` (or keep them for good, one per ``hours``), record again, and clean
    up what killed saves left. As TF, the state is written before the deletions too, so a kill
    while deleting still finds the new checkpoint.

    Args:
        directory: the manager's directory.
        name: the checkpoints' name.
        state: the state before the save (not changed).
        rel: the checkpoint just saved, ``<name>-<N>``.
        max_to_keep: how many to keep active, or None.
        hours: ``keep_checkpoint_every_n_hours``, or None.

    Returns:
        The new state.
    """
    state = copy.deepcopy(state)
    written = written_ns(os.path.join(directory, rel))
    active = [e for e in state["checkpoints"] if e["path"] != rel]
    active.append({"path": rel, "timestamp": time.time(), "written_ns": written})
    preserved = [e for e in state["preserved"] if e["path"] != rel]
    state.update(checkpoints=active, preserved=preserved)
    write_state(directory, state)
    doomed = []
    while max_to_keep is not None and len(active) > max_to_keep:
        oldest = active.pop(0)
        if hours and oldest["timestamp"] - hours * 3600.0 >= state["last_preserved_timestamp"]:
            state["last_preserved_timestamp"] = oldest["timestamp"]
            preserved.append(oldest)
        else:
            doomed.append(oldest)
    for e in doomed:  # renamed aside first: a kill midway leaves no partial checkpoint
        files.discard(os.path.join(directory, e["path"]), os.path.join(directory, e["path"]))
    clean_leftovers(directory, name)
    write_state(directory, state)
    return state


__all__ = ["API", "STATE_FILE", "clean_leftovers", "recorded_and_swept", "recovered",
           "write_state", "written_ns"]
