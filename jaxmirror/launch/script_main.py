"""What each worker of ``python -m jaxmirror.launch`` runs: the script, exiting at once on failure.

``python -P .../script_main.py -- script.py [args...]`` runs like ``python script.py
[args...]``, and ``python -P .../script_main.py -m module [args...]`` like
``python -m module [args...]`` (same ``sys.argv``, ``sys.path[0]`` and ``__main__``), with
two differences:

- When the script fails (an uncaught exception, or ``sys.exit`` with a non-zero code) the
  worker prints the traceback and exits at once, without running ``atexit`` handlers. A
  process that called ``jax.distributed.initialize`` would otherwise wait in JAX's shutdown
  barrier for the other workers, up to 5 minutes, before exiting, and the launcher only
  learns of a failure from the exit. A script that succeeds exits normally.
- SIGINT raises KeyboardInterrupt even when the launcher was started with SIGINT ignored.

It is run by path with ``-P`` (this folder stays off ``sys.path``) rather than as
``-m jaxmirror.launch.script_main``, which would import ``jaxmirror`` and JAX before the
script.

Example:
    >>> from jaxmirror.launch import script_main
    >>> script_main.exit_code(None), script_main.exit_code(3), script_main.exit_code("bye")
    (0, 3, 1)
"""

import os
import runpy
import signal
import sys


def exit_code(code) -> int:
    """The exit status Python gives ``SystemExit(code)``.

    Args:
        code: ``SystemExit.code``.

    Returns:
        0 for None, the int itself, or 1 for anything else (which Python prints).
    """
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream cannot lose more
            pass


def _user_traceback(tb):
    # Skip this file's and runpy's frames: the traceback starts in the script, as with python.
    ours = {__file__, runpy.__file__, "<frozen runpy>"}
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    return tb


def tell_the_cluster(error: BaseException) -> None:
    """Tell the other workers that this one's program failed with ``error``, when it joined a
    multi-worker cluster (without importing jaxmirror or JAX if it never did).

    Args:
        error: the exception that ended the program.
    """
    failures = sys.modules.get("jaxmirror.runtime.failures")
    if failures is not None:
        failures.note_and_report(error)  # an exit code says it all: nothing else to show


def _planned_exit() -> bool:
    # An exit every worker makes at the same step (PreemptionCheckpointHandler's), not a
    # failure: looked up, not imported (importing would start JAX).
    failures = sys.modules.get("jaxmirror.runtime.failures")
    return failures is not None and failures.planned_exit()


def main(argv: list[str]) -> None:
    """Run ``argv`` (``["--", script, *args]`` or ``["-m", module, *args]``) as ``__main__``.

    Args:
        argv: the launcher's command for this worker.

    Returns:
        None, when the script succeeded; on failure the process ends inside.
    """
    mode, target, args = argv[0], argv[1], argv[2:]
    # SIGINT is how the launcher stops workers: a launcher started with SIGINT ignored (`&` in
    # a shell script) must not pass that on to the script.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [target] + args
    try:
        if mode == "-m":
            sys.path.insert(0, os.getcwd())
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            if os.path.isfile(target):  # run_path puts a folder or zip on sys.path itself
                sys.path.insert(0, os.path.dirname(os.path.realpath(target)))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        code = exit_code(e.code)
        if code == 0 or _planned_exit():
            raise  # Python's own exit: a worker ends as a finished program does
        if not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        tell_the_cluster(e)
        _flush()
        os._exit(code)
    except BaseException as e:  # noqa: BLE001 - the script's uncaught exception, Ctrl-C included
        # Python's hook prints the exception's own __traceback__, whatever it is passed (and
        # jaxmirror's, once a strategy joined a cluster, tells the other workers).
        tb = _user_traceback(e.__traceback__)
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        _flush()
        if isinstance(e, KeyboardInterrupt):
            # Die of SIGINT, as python does on an uncaught KeyboardInterrupt.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
