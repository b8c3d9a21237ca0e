"""The two kinds of Ray actors: parameter servers (hold values) and workers (run closures).

Plain classes here; ``cluster`` makes Ray actors of them. A Ray actor runs one call at a time,
so each parameter server applies one closure's updates at once, and deduplicates them by closure
id: a closure re-run after its worker died has its updates applied at most once.
"""

from __future__ import annotations

import os

import numpy as np

from jaxmirror.coordinator import closures, worker_runtime
from jaxmirror.coordinator.shipping import pack, unpack

FORGET_AT = 1 << 16  # applied closure ids kept before the finished ones are dropped


def _apply(values: dict, var_id, kind: str, value) -> None:
    old = values[var_id]
    if kind == "assign":
        new = np.array(value, dtype=old.dtype)  # a copy: the argument may be a read-only buffer
    elif kind in ("add", "assign_add"):
        new = (old + value).astype(old.dtype, copy=False)
    elif kind in ("sub", "assign_sub"):
        new = (old - value).astype(old.dtype, copy=False)
    elif kind == "add_or_set":
        # A difference that does not give the worker's value back exactly (rounding, inf or
        # NaN): the worker's value when nobody else changed the variable since its read, else
        # the difference added to the other changes.
        delta, pulled, final = value
        if np.array_equal(old, pulled, equal_nan=old.dtype.kind in "fc"):
            new = np.array(final, dtype=old.dtype)
        else:
            new = (old + delta).astype(old.dtype, copy=False)
    else:
        raise ValueError(f"ParameterServer: unknown update kind {kind!r}.")
    values[var_id] = np.asarray(new).reshape(old.shape)


class ParameterServer:
    """A parameter server: variables' values by id, updated one closure at a time.

    Args:
        index: the task index (``/job:ps/task:index``).

    Example:
        >>> ps = ParameterServer(0)
        >>> ps.create([(7, np.float32(1.0))])
        >>> ps.apply_closures([(1, [(7, "add", np.float32(2.0))])], [7])[1][0].item()
        3.0
        >>> ps.apply_closures([(1, [(7, "add", np.float32(2.0))])], [7])  # closure 1 again
        ([False], [array(3., dtype=float32)])
    """

    def __init__(self, index: int):
        self.index = index
        self.values: dict = {}
        self.applied: set = set()
        self.deduplicate = True
        self.reapplied = 0  # closures pushed again (a re-run whose first push had landed)
        self.pushes = 0

    def ping(self) -> int:
        """The process id (also: the actor is up)."""
        return os.getpid()

    def create(self, items) -> None:
        """Add variables: ``items`` is a list of ``(var_id, initial value)``."""
        for var_id, value in items:
            self.values[var_id] = np.array(value)

    def pull(self, var_ids) -> bytes:
        """The values of ``var_ids``, in order, ``pack``ed."""
        return pack([self.values[i] for i in var_ids])

    def push(self, payload: bytes) -> bytes:
        """``apply_closures`` of the ``pack``ed ``(closures, pull_ids, watermark)``; its result
        ``pack``ed."""
        self.pushes += 1
        return pack(self.apply_closures(*unpack(payload)))

    def apply_closures(self, closures, pull_ids, watermark=None) -> tuple:
        """Apply each closure's updates, all of one closure at once, unless already applied.

        Args:
            closures: a list of ``(closure_id, updates)``, in the order the closures ran;
                ``updates`` a list of ``(var_id, kind, value)``, kind ``"assign"``, ``"add"``,
                ``"sub"`` or ``"add_or_set"`` (value ``(delta, read, final)``: ``final`` if the
                variable still holds ``read``, else the variable plus ``delta``).
            pull_ids: variables whose values to return after the updates.
            watermark: the coordinator's oldest unfinished closure id: older ids can never be
                pushed again (their closures will not re-run), so a large record of applied
                ids drops them.

        Returns:
            ``(applied, values of pull_ids)``: ``applied`` a list of bools, one per closure.
        """
        applied = []
        for closure_id, updates in closures:
            seen = closure_id in self.applied
            self.reapplied += seen
            fresh = not seen or not self.deduplicate
            if fresh:
                self.update(updates)
                self.applied.add(closure_id)
            applied.append(fresh)
        if watermark is not None and len(self.applied) > FORGET_AT:
            self.applied = {i for i in self.applied if i >= watermark}
        return applied, [self.values[i] for i in pull_ids]

    def update(self, updates) -> None:
        """Apply updates made on the coordinator (no closure; never deduplicated)."""
        staged = dict((i, self.values[i]) for i, _, _ in updates)
        for var_id, kind, value in updates:
            _apply(staged, var_id, kind, value)
        self.values.update(staged)

    def set_deduplication(self, on: bool) -> None:
        """Testing: turn deduplication by closure id off to see what it prevents."""
        self.deduplicate = bool(on)

    def counts(self) -> dict:
        """Testing: ``pushes`` (messages received) and ``pushed_again`` (closures pushed a
        second time: their worker died after the first)."""
        return {"pushes": self.pushes, "pushed_again": self.reapplied}


class Worker:
    """A worker: runs scheduled closures on its own devices (``worker_runtime``).

    Args:
        index: the task index (``/job:worker/task:index``).
        num_workers: how many workers the cluster has.
        ps_handles: the parameter-server actors.
        strategy_factory: a function returning the worker's own strategy.
        env: environment variables to set before JAX starts in this process (device count,
            platform).
    """

    def __init__(self, index, num_workers, ps_handles, strategy_factory, env):
        os.environ.update(env)
        if "JAX_PLATFORMS" in env:  # read by JAX at import, which came before this call
            import jax
            jax.config.update("jax_platforms", env["JAX_PLATFORMS"])
        worker_runtime.install(index, num_workers, ps_handles, strategy_factory)

    def ping(self) -> int:
        """The process id (also: the actor is up)."""
        return os.getpid()

    def run(self, calls, writes, follows, fresh, watermark, fast=True):
        """Run closures one after another (``closures.run_closures``)."""
        return closures.run_closures(calls, writes, follows, fresh, watermark, fast)

    def load_counts(self) -> dict:
        """Testing: how many closures' variables were loaded by one compiled assignment
        (``compiled``) and by one ``assign`` each (``assigned``)."""
        return worker_runtime.current().load_counts.copy()

    def exit_after_pushes(self, count: int) -> None:
        """Testing: exit the process right after the ``count``-th push from now."""
        worker_runtime.exit_after_pushes(count)
