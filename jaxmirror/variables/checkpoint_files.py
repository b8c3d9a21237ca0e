"""The file-system side of ``jaxmirror.checkpoint.save``: write beside, swap in one step, recover.

``save`` must leave a restorable checkpoint whenever it is killed (SIGKILL, OOM killer), so it
never deletes the old checkpoint before the new one is complete: orbax writes the new one into a
sibling directory, and this module swaps the two and deletes the old one afterwards. It holds no
orbax code (stdlib only), so the guarantee can be read and tested apart from the saving itself.

A destination ``<parent>/<name>`` has siblings ``<parent>/.<name>.jaxmirror-<role>-<pid>-<hex>``,
in the same directory so that every rename stays on one file system and is atomic:

- ``new``: the checkpoint being saved. Orbax writes it under ``<sibling>.orbax-checkpoint-tmp``
  and renames it to the sibling's name last, so a ``new`` sibling exists only complete (after a
  swap it holds the replaced checkpoint, complete as well).
- ``old``: the replaced checkpoint, moved aside by the two-rename fallback; complete.
- ``del``: a sibling being deleted. It is renamed before it is deleted, so a deletion killed
  midway leaves no partial ``new`` or ``old`` directory for ``recover`` to pick.

Complete therefore means: a ``new`` or ``old`` name (orbax's rename has happened) whose directory
holds orbax's marker files. The rename is orbax's completion signal in its default
(atomic-rename) mode: a directory still under its temporary name already holds
``_CHECKPOINT_METADATA`` from the start of the write, so the markers alone do not say complete.
Orbax's ``commit_success.txt`` (written just before the rename) is not required, so that
checkpoints from orbax versions or settings that do not write it still count.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import re
import secrets
import shutil
import sys
import time

# Files an orbax checkpoint directory always has (tree metadata, step metadata).
MARKERS = ("_METADATA", "_CHECKPOINT_METADATA")
# Orbax writes a checkpoint at `<final name>` + this (older versions add `-<timestamp>`).
_ORBAX_TMP = ".orbax-checkpoint-tmp"
# renameat2(2): swap two existing paths atomically; AT_FDCWD: paths relative to the cwd.
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
# How long `recover` leaves a live save to finish its two renames before it steps in.
_LIVE_SAVE_WAIT_S = 1.0


def is_checkpoint(path: str) -> bool:
    """Whether the directory ``path`` holds an orbax checkpoint's marker files."""
    return any(os.path.isfile(os.path.join(path, m)) for m in MARKERS)


def sibling(path: str, role: str) -> str:
    """A new, unique ``role`` sibling name of ``path`` for this process (nothing is created)."""
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.jaxmirror-{role}-{os.getpid()}-{secrets.token_hex(4)}")


def _siblings(path: str):
    """``(sibling path, role, pid, under orbax's temporary name)`` for every sibling of
    ``path``; names that do not follow the pattern exactly are never listed (nor touched)."""
    parent, name = os.path.split(path)
    pattern = re.compile(rf"\.{re.escape(name)}\.jaxmirror-(new|old|del)-(\d+)-[0-9a-f]{{8}}"
                         rf"({re.escape(_ORBAX_TMP)}(-\d+)?)?")
    try:
        entries = os.listdir(parent)
    except OSError:
        return []  # no parent, or one that cannot be listed: no sibling can be found or made
    found = []
    for entry in entries:
        match = pattern.fullmatch(entry)
        if match:
            found.append((os.path.join(parent, entry), match[1], int(match[2]),
                          match[3] is not None))
    return found


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True  # another thread's save, or this one's
    if os.name != "posix":
        return True  # os.kill(pid, 0) would send CTRL_C_EVENT on Windows: assume live
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, but belongs to someone else
    return True


def _written_at(path: str) -> int:
    """When the checkpoint in ``path`` was last written: orbax updates its marker files last,
    and renaming the directory (as ``replace`` does) leaves their times alone."""
    times = [-1]
    for marker in MARKERS:
        try:
            times.append(os.stat(os.path.join(path, marker)).st_mtime_ns)
        except OSError:
            pass  # no such marker, or another process deleted the sibling meanwhile
    return max(times)


def recover(path: str) -> None:
    """Put the newest complete sibling back at ``path`` if a killed save left nothing there.

    Only the two-rename fallback of ``replace`` has such a window (``path`` missing between its
    renames); orbax never writes at ``path`` itself, so a ``path`` that exists is left alone. A
    sibling of a live process may be a save inside that window: it is given
    ``_LIVE_SAVE_WAIT_S`` to finish (its pid may also have been reused, so not forever).
    """
    deadline = time.monotonic() + _LIVE_SAVE_WAIT_S
    while not os.path.lexists(path):
        complete = [(p, pid) for p, role, pid, tmp in _siblings(path)
                    if role in ("new", "old") and not tmp and is_checkpoint(p)]
        if not complete:
            return
        if time.monotonic() < deadline and any(_alive(pid) for _, pid in complete):
            time.sleep(0.01)
            continue
        newest = max(complete, key=lambda found: _written_at(found[0]))[0]
        try:
            os.rename(newest, path)
        except OSError:
            # Another process recovered first (or took `newest`): look again, for a while.
            if time.monotonic() >= deadline and not os.path.lexists(path):
                raise
            time.sleep(0.01)


def remove_leftovers(path: str) -> None:
    """Delete the siblings of ``path`` that saves killed earlier left (a live process's stay)."""
    for p, role, pid, tmp in _siblings(path):
        if not _alive(pid):
            if role == "del" or tmp:
                _delete(p)  # never picked by `recover`: no need to rename it first
            else:
                discard(path, p)


def _delete(p: str) -> None:
    # Best effort: the checkpoint is in place whatever is left here, and `remove_leftovers`
    # tries again at the next save (another process may be deleting it at the same time).
    if os.path.isdir(p) and not os.path.islink(p):
        shutil.rmtree(p, ignore_errors=True)
    else:
        try:
            os.remove(p)
        except OSError:
            pass


def discard(path: str, p: str) -> None:
    """Delete ``p``, a sibling of ``path``, if it exists: renamed to a ``del`` sibling first, so
    that a deletion killed midway leaves no partial checkpoint under a ``new``/``old`` name."""
    trash = sibling(path, "del")
    try:
        os.rename(p, trash)
    except FileNotFoundError:
        return  # never made, or another process's cleanup took it
    _delete(trash)


def abandon(path: str, new: str) -> None:
    """Delete what a failed save left of its ``new`` sibling: the sibling and orbax's temporary
    directories for it."""
    discard(path, new)
    name = os.path.basename(new)
    for p, _, _, tmp in _siblings(path):
        if tmp and os.path.basename(p).startswith(name + _ORBAX_TMP):
            _delete(p)


@functools.lru_cache(maxsize=None)
def _renameat2():
    """libc's ``renameat2``, or None where there is none (not Linux, glibc before 2.28)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


def exchange(a: str, b: str) -> bool:
    """Swap the existing paths ``a`` and ``b`` in one atomic step; False where this system
    cannot (no ``renameat2``, or a kernel or file system without ``RENAME_EXCHANGE``)."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), a, None, b)


def replace(new: str, path: str) -> None:
    """Put the complete checkpoint ``new`` (a sibling of ``path``) at ``path`` atomically, then
    delete what ``path`` held. At every instant ``path`` holds the old or the new checkpoint,
    except inside the fallback's window, which ``recover`` repairs."""
    if not os.path.lexists(path):
        os.rename(new, path)  # atomic: `path` appears complete
        return
    if exchange(new, path):
        discard(path, new)  # `new` now holds what was at `path`
        return
    old = sibling(path, "old")
    os.rename(path, old)
    # Killed here, `path` is missing; `recover` (run by save and restore) renames the newest
    # complete sibling back.
    try:
        os.rename(new, path)
    except BaseException:
        os.rename(old, path)
        raise
    discard(path, old)


def check_destination(path: str, force: bool) -> None:
    """Raises where ``save`` may not write ``path``.

    Args:
        path: the destination.
        force: whether a checkpoint there may be replaced.

    Raises:
        FileExistsError: ``path`` is a file, a non-empty directory without a checkpoint, or a
            checkpoint and ``force`` is False.
    """
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise FileExistsError(f"jaxmirror.checkpoint.save: {path!r} exists and is not a "
                              f"directory; give a new directory.")
    if os.listdir(path):
        if not is_checkpoint(path):
            raise FileExistsError(
                f"jaxmirror.checkpoint.save: directory {path!r} is not empty and holds no "
                f"orbax checkpoint, so it is not replaced, even with force=True; give a new or "
                f"empty directory.")
        if not force:
            raise FileExistsError(
                f"jaxmirror.checkpoint.save: a checkpoint already exists in {path!r}; pass "
                f"force=True to replace it, or give a new directory.")


__all__ = ["MARKERS", "abandon", "check_destination", "discard", "exchange", "is_checkpoint",
           "recover", "remove_leftovers", "replace", "sibling"]
