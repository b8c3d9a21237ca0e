"""What each worker of ``jaxmirror.launch.run`` runs: call the function, write back the outcome.

``python -P .../worker_main.py PAYLOAD RESULT``. It is run by path, not as
``-m jaxmirror.launch.worker_main``: that would import ``jaxmirror`` (and JAX, a second per
worker) before the parent's ``sys.path`` is in place; ``-P`` keeps this directory off
``sys.path``. So it imports only the standard library until the payload is read.

``PAYLOAD`` is a plain pickle of ``{"sys_path": [...], "call": bytes}``: the parent's
``sys.path`` comes first, because ``call`` (cloudpickle of ``(fn, args, kwargs)``) names the
modules of importable functions and the parent may have added to its path (a notebook's
folder, pytest's test folder). ``RESULT`` receives a cloudpickle of ``("returned", value)`` or
``("raised", type name, message, formatted traceback)``, written whole or not at all.

Example:
    >>> from jaxmirror.launch import worker_main
    >>> worker_main.outcome_of(divmod, (7, 2), {})
    ('returned', (3, 1))
    >>> worker_main.outcome_of(divmod, (7, 0), {})[:3]
    ('raised', 'ZeroDivisionError', 'integer division or modulo by zero')
"""

import os
import pickle
import signal
import sys
import traceback


def _type_name(cls: type) -> str:
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def outcome_of(fn, args, kwargs) -> tuple:
    """What calling ``fn(*args, **kwargs)`` did, as the worker reports it.

    Args:
        fn: the function.
        args: its positional arguments.
        kwargs: its keyword arguments.

    Returns:
        ``("returned", value)`` or ``("raised", type name, message, traceback text)``.
    """
    try:
        return "returned", fn(*args, **kwargs)
    except SystemExit:
        if _planned_exit():
            raise  # every worker leaves at this step (a preemption checkpoint): Python's exit
        return _failed(sys.exc_info()[1])
    except BaseException as e:  # noqa: BLE001 - Ctrl-C too: fn did not return
        return _failed(e)


def _failed(e: BaseException) -> tuple:
    e = _tell_the_cluster(e)
    return "raised", _type_name(type(e)), str(e), _traceback(e)


def _planned_exit() -> bool:
    # Looked up, not imported: importing would start JAX.
    failures = sys.modules.get("jaxmirror.runtime.failures")
    return failures is not None and failures.planned_exit()


def _tell_the_cluster(error: BaseException) -> BaseException:
    # The other workers learn of the failure at once (jaxmirror's failure record), when this
    # one joined a cluster; looked up, not imported: importing would start JAX. An error that
    # is another worker's failure reaching this one comes back as the error naming it.
    failures = sys.modules.get("jaxmirror.runtime.failures")
    if failures is None:
        return error
    return failures.note_and_report(error)


def _traceback(e: BaseException) -> str:
    # The first frame is outcome_of's own call; the user's frames start below it.
    tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
    return "".join(traceback.format_exception(type(e), e, tb))


def _dump(outcome: tuple) -> tuple[tuple, bytes]:
    import cloudpickle  # after the parent's sys.path is in place

    try:
        return outcome, cloudpickle.dumps(outcome)
    except Exception as e:  # noqa: BLE001 - whatever the value's pickling raises
        outcome = ("raised", _type_name(type(e)),
                   f"the function's return value cannot be pickled: {e}", _traceback(e))
        return outcome, cloudpickle.dumps(outcome)


def main(payload_path: str, result_path: str) -> int:
    """Run the payload's call, write its outcome to ``result_path``; the worker's exit code.

    Args:
        payload_path: the parent's payload file.
        result_path: where the outcome goes.

    Returns:
        0 when the function returned, 1 when it raised.
    """
    # SIGINT is how the parent stops workers: an inherited "ignore SIGINT" must not stick.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with open(payload_path, "rb") as f:
        payload = pickle.load(f)
    sys.path[:] = payload["sys_path"]
    try:
        fn, args, kwargs = pickle.loads(payload["call"])
    except BaseException as e:  # noqa: BLE001 - e.g. a module the worker cannot import
        outcome = ("raised", _type_name(type(e)), f"cannot unpickle the function: {e}",
                   _traceback(e))
    else:
        outcome = outcome_of(fn, args, kwargs)
    outcome, data = _dump(outcome)
    # Renamed into place: a worker killed mid-write leaves no half a result behind.
    with open(result_path + ".part", "wb") as f:
        f.write(data)
    os.replace(result_path + ".part", result_path)
    return 0 if outcome[0] == "returned" else 1


if __name__ == "__main__":
    if main(sys.argv[1], sys.argv[2]):
        # A failed worker exits at once, skipping atexit: after jax.distributed.initialize,
        # JAX's shutdown barrier would hold it up to 5 minutes waiting for the others, and
        # the parent only learns of the failure from the exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
