"""Running scheduled closures in a worker: load their variables, run, note and send changes.

A call brings one or more closures (``run_closures``). Each loads the values of the variables it
refers to (pulled, one request per parameter server, or brought back by the previous closure's
push), runs, and notes its changes as ``assign`` overwrites or differences; the changes go out
one message per parameter server, after each closure (fresh reads) or after the call.

The messages to the parameter servers (Ray actor calls) go out all at once and their replies
are awaited together.
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback

import cloudpickle
import jax
import numpy as np

from jaxmirror.cluster_resolver import ray_support
from jaxmirror.coordinator.errors import OutOfRangeError
from jaxmirror.coordinator.shipping import pack, unpack
from jaxmirror.coordinator.worker_runtime import cached_function, current, worker_strategy
from jaxmirror.core.values import DistributedValues
from jaxmirror.variables.handle import VariableHandle
from jaxmirror.variables.variable import Variable

LOADER_AFTER = 2  # loads of the same variables before they get a compiled loader (~20 ms)
MAX_LOADERS = 64  # compiled loaders a worker keeps at most


def _load(state, var_ids) -> None:
    """Make the local copies of ``var_ids`` current: from the values the last push brought
    back, else pulled now (one request per parameter server)."""
    missing = [i for i in var_ids if i not in state.current]
    if not missing:
        return
    values = dict((i, state.prefetched.pop(i)) for i in missing if i in state.prefetched)
    by_ps: dict = {}
    for i in missing:
        if i not in values:
            by_ps.setdefault(state.locals[i].spec.ps_index, []).append(i)
    state.prefetched.clear()  # what this closure did not take is older by now
    for ps, pulled in _ask(state, {ps: ("pull", ids) for ps, ids in by_ps.items()}).items():
        values.update(zip(by_ps[ps], pulled))
    for i in missing:
        state.locals[i].pulled = np.asarray(values[i])
    _assign_loaded(state, [state.locals[i] for i in missing if state.locals[i].var is not None])
    state.current.update(missing)


def _assign_all(variables, *values) -> None:
    for var, value in zip(variables, values):
        var.assign(value, read_value=False)


def _assign_loaded(state, locals_) -> None:
    """Assign the loaded values to the local variables: one ``assign`` each, or, for a set of
    variables loaded together before (the same closure again), one compiled ``strategy.run``
    assigning them all, a tenth of the cost (on one replica only: with several, an assignment
    in a replica context follows the aggregation rules, which a load must not)."""
    if not locals_:
        return
    key = tuple(local.spec.var_id for local in locals_)
    loader = state.loaders.get(key)
    strategy = worker_strategy()
    if loader is None:
        if len(state.loads) >= MAX_LOADERS * 16:
            state.loads.clear()
        state.loads[key] = seen = state.loads.get(key, 0) + 1
        if (state.fast and seen >= LOADER_AFTER and len(state.loaders) < MAX_LOADERS
                and strategy.num_replicas_in_sync == 1):
            loader = state.loaders[key] = functools.partial(
                _assign_all, tuple(local.var for local in locals_))
    with contextlib.ExitStack() as unwatched:  # loading is no overwrite by the closure
        for local in locals_:
            unwatched.enter_context(local.var.overwrites_unwatched())
        if loader and state.fast:
            try:
                strategy.run(loader, args=tuple(local.pulled for local in locals_))
                state.load_counts["compiled"] += 1
                return
            except Exception:  # noqa: BLE001 (one assign each, as before, from now on)
                state.loaders[key] = False
        for local in locals_:
            local.var.assign(local.pulled, read_value=False)
        state.load_counts["assigned"] += 1


def _remote(ray, ref, ps_index):
    try:
        return ray.get(ref)
    except ray_support.actor_died_errors() as e:
        raise _ParameterServerGone(ps_index, str(e)) from None


def _by_ray(state, ps, method, args):
    handle = state.ps[ps]
    return handle.pull.remote(args) if method == "pull" else handle.push.remote(pack(args))


def _ask(state, requests: dict) -> dict:
    """Send ``{ps: (method, args)}`` (``"pull"`` ids, or ``"push"`` ``(closures, pull_ids,
    watermark)``) to every parameter server at once; wait for all the replies: ``{ps: result}``
    as ``ParameterServer.pull``/``push`` give it, unpacked.

    Raises:
        _ParameterServerGone: a server is gone.
    """
    ray = ray_support.ray_module()
    refs = {ps: _by_ray(state, ps, method, args) for ps, (method, args) in requests.items()}
    return {ps: unpack(_remote(ray, ref, ps)) for ps, ref in refs.items()}


class _ParameterServerGone(Exception):
    def __init__(self, ps_index, message):
        super().__init__(message)
        self.ps_index = ps_index


def _updates(state, var_ids) -> dict:
    """One closure's changes, by parameter server: ``[(var_id, kind, value)]``. The local
    values stay current: the next closure of the call starts from them."""
    locals_ = [state.locals[i] for i in var_ids]
    finals = jax.device_get([(l.final, 0) if l.var is None else
                             (l.var.read_value(), l.flag.read_value()) for l in locals_])
    by_ps: dict = {}
    for local, (final, flag) in zip(locals_, finals):
        final = np.asarray(final)
        if int(flag):
            update = ("assign", final)
            local.flag.assign(0, read_value=False)
        elif np.array_equal(final, local.pulled, equal_nan=final.dtype.kind in "fc"):
            continue
        elif final.dtype.kind == "b":
            update = ("assign", final)
        else:
            delta = final - local.pulled
            if np.array_equal(local.pulled + delta, final, equal_nan=False):
                update = ("add", delta)  # exact: the usual small step
            else:  # rounded (bfloat16, a sign change) or not finite: exact unless raced
                update = ("add_or_set", (delta, local.pulled, final))
        local.pulled = final
        by_ps.setdefault(local.spec.ps_index, []).append((local.spec.var_id,) + update)
    return by_ps


def _forget(state, var_ids) -> None:
    """After a failed closure: its local writes are dropped (reloaded when next used)."""
    for i in var_ids:
        local = state.locals.get(i)
        if local is not None and local.flag is not None:
            local.flag.assign(0, read_value=False)
    state.current.clear()
    state.prefetched.clear()


def _push(state, pending: dict, var_ids) -> None:
    """Send every closure's changes, one message per parameter server; take back the values
    of ``var_ids`` that server holds, for the worker's next call."""
    again: dict = {}
    for i in var_ids:
        again.setdefault(state.locals[i].spec.ps_index, []).append(i)
    replies = _ask(state, {ps: ("push", (closures, again.get(ps, []), state.watermark))
                           for ps, closures in pending.items()})
    for ps, (_, pulled) in replies.items():
        state.prefetched.update(zip(again.get(ps, []), pulled))
    state.pushes += 1
    if state.exit_after_push is not None and state.pushes >= state.exit_after_push:
        os._exit(1)  # a test's fault: die after pushing, before the coordinator hears back


def _to_host(result):
    def convert(x):
        if isinstance(x, (Variable, VariableHandle)):  # a variable returned: its value, as TF
            x = x.read_value()
        if isinstance(x, DistributedValues):
            return tuple(np.asarray(c) for c in worker_strategy().experimental_local_results(x))
        return np.asarray(x) if isinstance(x, jax.Array) else x
    return jax.tree.map(convert, result, is_leaf=lambda x: isinstance(
        x, (DistributedValues, VariableHandle)))


def _error_outcome(e: Exception) -> tuple:
    import pickle
    text = "".join(traceback.format_exception(e))
    try:
        pickle.dumps(e)
        error = e
    except Exception:
        error = None
    return ("error", error, f"{type(e).__name__}: {e}", text)


def _run_one(state, call, pending: dict):
    import pickle
    closure_id, fn_id, fn_blob, args_blob, var_ids = call
    if fn_blob is None and fn_id not in state.functions:
        return ("missing",)  # the coordinator sends the function again
    try:
        fn = cached_function(fn_id, fn_blob)
        args, kwargs = pickle.loads(args_blob)
        _load(state, var_ids)
        used = set(var_ids)
        objects = [b for b in state.objects.values() if b.var_ids <= used]
        for bundle in objects:
            bundle.load()
        # Pickled here: a result that cannot travel fails its closure before its changes count.
        result = cloudpickle.dumps(_to_host(fn(*args, **kwargs)))
        for bundle in objects:
            bundle.store()
        for ps, updates in _updates(state, var_ids).items():
            pending.setdefault(ps, []).append((closure_id, updates))
        return ("ok", result)
    except _ParameterServerGone as e:
        _forget(state, var_ids)
        return ("ps", e.ps_index, str(e))
    except StopIteration as stop:  # a per-worker iterator ran out: TF's OutOfRangeError
        _forget(state, var_ids)
        error = OutOfRangeError(
            f"a scheduled function on worker {state.index} raised StopIteration: its "
            f"per-worker iterator ran out of data; repeat the dataset, or schedule no more "
            f"steps than it has batches.")
        error.__traceback__ = stop.__traceback__
        return _error_outcome(error)
    except Exception as e:  # the user's error: reported, the worker lives on
        _forget(state, var_ids)
        return _error_outcome(e)


def _send(state, pending, var_ids, calls, outcomes) -> list:
    """``_push``; when a parameter server is gone, the closures whose changes were in the
    messages fail with it."""
    sent = {cid for closures in pending.values() for cid, _ in closures}
    try:
        _push(state, pending, var_ids)
    except _ParameterServerGone as e:
        _forget(state, var_ids)
        return [("ps", e.ps_index, str(e)) if call[0] in sent else outcome
                for call, outcome in zip(calls, outcomes)]
    except Exception as e:  # noqa: BLE001 (a server refused the changes: those closures failed)
        _forget(state, var_ids)
        failed = _error_outcome(e)
        return [failed if call[0] in sent else outcome for call, outcome in zip(calls, outcomes)]
    return outcomes


def run_closures(calls, writes=0, follows=False, fresh=True, watermark=None,
                 fast=True) -> list:
    """Run scheduled closures one after another in this worker; never raises.

    With ``fresh``, each closure sends its changes when it ends (one message per parameter
    server, which brings the servers' values back), and the next closure starts from those
    values, as if it had been sent alone. Otherwise each closure starts from the local values
    the one before it left (its own changes, not other workers'), and the changes of all go out
    at the end, one message per parameter server, where each closure's changes still apply at
    most once. The first closure starts from the values the worker's previous call brought back
    (when ``follows``) or pulls them.

    Args:
        calls: ``[(closure_id, fn_id, fn_blob, args_blob, var_ids)]``: the closure's id
            (parameter servers apply its updates at most once); the function's id and its pickle
            (``None`` if this worker has it); the pickled ``(args, kwargs)``; the
            parameter-server variables the function and arguments refer to.
        writes: the coordinator's count of its own writes when it sent the call
            (``ps_variables.coordinator_writes``): values brought back before a newer write are
            dropped, so the closures see that write.
        follows: whether the call was sent while this worker still ran the one before it;
            otherwise values brought back by that one may be old (the worker was idle), and
            are dropped.
        fresh: see above.
        watermark: the coordinator's oldest unfinished closure id, passed on to the parameter
            servers (``ParameterServer.apply_closures``).
        fast: whether to load a set of variables loaded before by one compiled assignment
            (else one ``assign`` per variable: the same values).

    Returns:
        One outcome per call, in order: ``("ok", result)`` with arrays as NumPy arrays,
        ``("error", exception or None, text, traceback)`` when the function raised,
        ``("ps", index, text)`` when a parameter server is gone, ``("skipped",)`` for closures
        after a failed one (not run), ``("missing",)`` when this worker lacks the function
        (the coordinator sends it again).
    """
    state = current()
    state.watermark = watermark
    state.fast = fast
    if writes != state.prefetched_writes or not follows:
        state.prefetched.clear()
        state.prefetched_writes = writes
    state.current.clear()
    for call in calls:  # a function's pickle comes once: keep it even if its closure is skipped
        if call[2] is not None and call[1] not in state.functions:
            try:
                cached_function(call[1], call[2])
            except Exception:  # noqa: BLE001 (its closure reports it when it runs)
                pass
    pending: dict = {}
    outcomes = []
    for call in calls:
        outcomes.append(_run_one(state, call, pending))
        if outcomes[-1][0] == "missing":  # this and the rest go back to the coordinator's queue
            outcomes += [("missing",)] * (len(calls) - len(outcomes))
            break
        if outcomes[-1][0] != "ok":
            break
        if fresh:
            if pending:
                outcomes = _send(state, pending, call[4], calls, outcomes)
                pending = {}
            state.current.clear()
            if outcomes[-1][0] != "ok":
                break
    if pending:
        outcomes = _send(state, pending, sorted({i for c in calls for i in c[4]}), calls,
                         outcomes)
    state.current.clear()
    return outcomes + [("skipped",)] * (len(calls) - len(outcomes))
