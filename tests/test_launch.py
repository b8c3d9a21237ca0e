"""jaxmirror.launch: local workers with TF_CONFIG, their output, their failures, stopping them.

Every test is bounded by timeouts, and checks afterwards that no process it started is left.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import process_marks

LAUNCH = [sys.executable, "-m", "jaxmirror.launch"]
MARK = "JAXMIRROR_TEST_LAUNCH_MARK"
DEVICE_FLAG = "--xla_force_host_platform_device_count="


@pytest.fixture
def launch():
    # Imported here, not at the top: workers of `run` import this module to find its
    # functions, and importing jaxmirror (so JAX) would cost each of them a second.
    import jaxmirror.launch

    return jaxmirror.launch


_alive, _wait_until = process_marks.alive, process_marks.wait_until


@pytest.fixture(autouse=True)
def nothing_left_running(monkeypatch):
    """Every process a test starts inherits a mark; none may still run once the test is over."""
    yield from process_marks.nothing_left_running(monkeypatch, MARK)


def _script(folder, name: str, body: str) -> str:
    path = folder / name
    path.write_text("import json, os, signal, sys, time\n"
                    "i = int(os.environ['JAXMIRROR_LAUNCH_WORKER_INDEX'])\n"
                    + textwrap.dedent(body))
    return str(path)


def _launch(folder, *args, timeout: float = 60, env=None):
    return subprocess.run(LAUNCH + [str(a) for a in args], cwd=folder, capture_output=True,
                          text=True, timeout=timeout, env=env)


def _lines(text: str, worker: int) -> list[str]:
    prefix = f"[worker {worker}] "
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


def _pids(folder, names) -> list[int]:
    assert _wait_until(lambda: all((folder / n).exists() for n in names), 30.0), names
    return [int((folder / n).read_text()) for n in names]


# The command line.

def test_each_worker_gets_its_own_task_in_one_cluster(tmp_path):
    script = _script(tmp_path, "show.py", """
        names = ["TF_CONFIG", "JAXMIRROR_LAUNCH_WORKERS", "JAXMIRROR_LAUNCH_WORKER_INDEX",
                 "PYTHONUNBUFFERED", "XLA_FLAGS", "JAX_NUM_CPU_DEVICES"]
        shown = {n: os.environ.get(n) for n in names}
        shown.update(argv=sys.argv[1:], name=__name__, path0=sys.path[0])
        print(json.dumps(shown))
    """)
    result = _launch(tmp_path, "--workers", 3, script, "a", "--flag")
    assert result.returncode == 0, result.stderr
    shown = [json.loads(_lines(result.stdout, i)[0]) for i in range(3)]
    configs = [json.loads(s["TF_CONFIG"]) for s in shown]
    assert [c["task"] for c in configs] == [{"type": "worker", "index": i} for i in range(3)]
    cluster = configs[0]["cluster"]
    assert list(cluster) == ["worker"] and all(c["cluster"] == cluster for c in configs)
    hosts = {address.rsplit(":", 1)[0] for address in cluster["worker"]}
    ports = {int(address.rsplit(":", 1)[1]) for address in cluster["worker"]}
    assert hosts == {"127.0.0.1"} and len(ports) == 3
    for i, s in enumerate(shown):
        assert (s["JAXMIRROR_LAUNCH_WORKERS"], s["JAXMIRROR_LAUNCH_WORKER_INDEX"]) == ("3", str(i))
        assert s["PYTHONUNBUFFERED"] == "1"
        # Without --devices-per-worker the device settings are inherited untouched.
        assert s["XLA_FLAGS"] == os.environ.get("XLA_FLAGS")
        assert s["JAX_NUM_CPU_DEVICES"] == os.environ.get("JAX_NUM_CPU_DEVICES")
        # Run as `python show.py a --flag` would be.
        assert s["argv"] == ["a", "--flag"] and s["name"] == "__main__"
        assert s["path0"] == str(tmp_path.resolve())


def test_devices_per_worker_replaces_the_inherited_device_count(tmp_path):
    assert f"{DEVICE_FLAG}8" in os.environ["XLA_FLAGS"]  # conftest's, inherited by the workers
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ["XLA_FLAGS"] + " --xla_cpu_multi_thread_eigen=false")
    script = _script(tmp_path, "devices.py", """
        import jax
        print(json.dumps([jax.device_count(), os.environ["XLA_FLAGS"],
                          os.environ["JAX_NUM_CPU_DEVICES"]]))
    """)
    result = _launch(tmp_path, "--workers", 2, "--devices-per-worker", 2, script, env=env)
    assert result.returncode == 0, result.stderr
    for i in range(2):
        count, flags, num = json.loads(_lines(result.stdout, i)[-1])
        assert count == 2 and num == "2"
        assert flags.split().count(f"{DEVICE_FLAG}2") == 1 and f"{DEVICE_FLAG}8" not in flags
        assert "--xla_cpu_multi_thread_eigen=false" in flags.split()


def test_output_is_forwarded_line_by_line_with_the_workers_prefix(tmp_path):
    script = _script(tmp_path, "talk.py", """
        print(f"out {i} a")
        print(f"err {i}", file=sys.stderr)
        print(f"out {i} b")
        sys.stdout.write(f"unfinished {i}")
    """)
    result = _launch(tmp_path, "--workers", 2, script)
    assert result.returncode == 0, result.stderr
    for i in range(2):
        assert _lines(result.stdout, i) == [f"out {i} a", f"out {i} b", f"unfinished {i}"]
        assert _lines(result.stderr, i) == [f"err {i}"]
    assert all(line.startswith("[worker ") for line in result.stdout.splitlines())
    assert all(line.startswith("[worker ") for line in result.stderr.splitlines())


def test_module_mode_runs_like_python_dash_m(tmp_path):
    (tmp_path / "mymod.py").write_text("import sys\nprint(__name__, sys.argv[1:])\n")
    result = _launch(tmp_path, "--workers", 2, "-m", "mymod", "x", "--y")
    assert result.returncode == 0, result.stderr
    assert _lines(result.stdout, 0) == _lines(result.stdout, 1) == ["__main__ ['x', '--y']"]


@pytest.mark.parametrize("body,code,message", [
    ("sys.exit(3 if i == 1 else 0)", 3, "worker 1 exited with code 3"),
    ("if i == 1: raise ValueError(f'bad {i}')", 1, "worker 1 exited with code 1"),
    ("if i == 1: os.kill(os.getpid(), signal.SIGKILL)", 128 + 9,
     "worker 1 was killed by SIGKILL"),
])
def test_the_failing_workers_exit_code_is_the_launchers(tmp_path, body, code, message):
    result = _launch(tmp_path, "--workers", 2, _script(tmp_path, "fail.py", body))
    assert result.returncode == code
    assert f"jaxmirror.launch: {message}" in result.stderr
    if "ValueError" in body:
        assert _lines(result.stderr, 1)[-1] == "ValueError: bad 1"
        assert _lines(result.stderr, 1)[0] == "Traceback (most recent call last):"
        worker_1 = "\n".join(_lines(result.stderr, 1))
        assert "script_main" not in worker_1 and "runpy" not in worker_1


def test_a_failing_worker_stops_its_sleeping_sibling_and_the_siblings_children(tmp_path):
    script = _script(tmp_path, "fail_fast.py", """
        import pathlib, subprocess
        here = pathlib.Path(sys.argv[1])
        if i == 0:
            ready = here / "child_ready"
            child = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; "
                                      "signal.signal(signal.SIGINT, signal.SIG_IGN); "
                                      "open(sys.argv[1], 'w').close(); time.sleep(60)",
                                      str(ready)])
            (here / "child").write_text(str(child.pid))
            while not ready.exists():  # a SIGINT during its start-up would print a traceback
                time.sleep(0.05)
            (here / "pid0").write_text(str(os.getpid()))
            time.sleep(60)
        while not (here / "pid0").exists():
            time.sleep(0.05)
        sys.exit(5)
    """)
    start = time.monotonic()
    # A grace long enough for worker 0 to print its KeyboardInterrupt on a loaded machine; the
    # grandchild ignores SIGINT, so the SIGKILL at the end of the grace is what stops it.
    result = _launch(tmp_path, "--workers", 2, "--grace", 5, script, tmp_path)
    elapsed = time.monotonic() - start
    assert result.returncode == 5, result.stderr
    assert elapsed < 20, elapsed
    assert ("jaxmirror.launch: worker 1 exited with code 5; stopping the other workers"
            in result.stderr)
    assert _lines(result.stderr, 0)[-1] == "KeyboardInterrupt"  # worker 0 got SIGINT
    # The grandchild ignored SIGINT: it went with its worker's process group at SIGKILL.
    worker, child = _pids(tmp_path, ["pid0", "child"])
    assert _wait_until(lambda: not _alive(worker) and not _alive(child), 5.0)


def test_a_worker_that_ignores_sigint_gets_sigkill_after_the_grace(tmp_path):
    script = _script(tmp_path, "stubborn.py", """
        if i == 0:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            open("pid0", "w").write(str(os.getpid()))
            time.sleep(60)
        while not os.path.exists("pid0"):
            time.sleep(0.05)
        sys.exit(1)
    """)
    start = time.monotonic()
    result = _launch(tmp_path, "--workers", 2, "--grace", 1, script)
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr
    assert 1 <= elapsed < 20, elapsed
    assert "worker 0 still running (1 s after SIGINT); sending SIGKILL" in result.stderr
    assert not _alive(_pids(tmp_path, ["pid0"])[0])


def test_timeout_stops_every_worker(tmp_path):
    script = _script(tmp_path, "slow.py", "open(f'pid{i}', 'w').write(str(os.getpid()))\n"
                                          "time.sleep(60)\n")
    start = time.monotonic()
    result = _launch(tmp_path, "--workers", 2, "--timeout", 1.5, "--grace", 1, script)
    assert result.returncode == 124, result.stderr
    assert time.monotonic() - start < 20
    assert ("jaxmirror.launch: timed out after 1.5 s (--timeout) with worker(s) 0, 1 still "
            "running" in result.stderr)
    assert not any(map(_alive, _pids(tmp_path, ["pid0", "pid1"])))


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_the_launcher_stops_the_workers(tmp_path, sig, code):
    script = _script(tmp_path, "wait.py", "open(f'pid{i}', 'w').write(str(os.getpid()))\n"
                                          "time.sleep(60)\n")
    launcher = subprocess.Popen(LAUNCH + ["--workers", "2", "--grace", "5", script],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    try:
        workers = _pids(tmp_path, ["pid0", "pid1"])
        start = time.monotonic()
        launcher.send_signal(sig)
        _, stderr = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == code, stderr
    assert time.monotonic() - start < 20
    assert "SIGKILL" not in stderr  # the workers took the SIGINT
    reason = "interrupted" if sig == signal.SIGINT else "received SIGTERM"
    assert f"jaxmirror.launch: {reason}; sending SIGINT to the workers" in stderr
    assert not any(map(_alive, workers))


def test_bad_command_lines_exit_2_before_starting_anything(tmp_path, launch, capsys):
    missing = _launch(tmp_path, "--workers", 2, "missing.py")
    assert missing.returncode == 2 and "no such script: missing.py" in missing.stderr
    for argv, says in [(["--workers", "0", "x.py"], "--workers: expected a positive number"),
                       (["--workers", "2", "--timeout", "0", "x.py"], "--timeout: expected a"),
                       (["--workers", "2", "--grace", "-1", "x.py"], "--grace: expected a"),
                       (["x.py"], "required: --workers")]:
        with pytest.raises(SystemExit) as caught:  # argparse's way; the same in-process
            launch.main(argv)
        assert caught.value.code == 2 and says in capsys.readouterr().err


def test_a_jax_distributed_worker_that_raises_stops_the_cluster_at_once(tmp_path):
    # JAX's shutdown barrier would keep the raising worker alive until its sibling's 60 s
    # sleep ended; the launcher's workers exit at once when their script fails.
    script = _script(tmp_path, "dist.py", """
        import jax
        cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]
        jax.distributed.initialize(coordinator_address=cluster[0],
                                   num_processes=len(cluster), process_id=i)
        print("process", jax.process_index(), "of", jax.process_count(), "devices",
              jax.device_count(), flush=True)
        if i == 1:
            raise RuntimeError("worker 1 fails")
        time.sleep(60)
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    start = time.monotonic()
    result = _launch(tmp_path, "--workers", 2, "--devices-per-worker", 2, "--grace", 5,
                     script, env=env)
    assert result.returncode == 1, result.stderr
    assert time.monotonic() - start < 40
    assert _lines(result.stdout, 1) == ["process 1 of 2 devices 4"]
    assert "RuntimeError: worker 1 fails" in _lines(result.stderr, 1)


# jaxmirror.launch.run

def _index_times(x, scale=1):
    return int(os.environ["JAXMIRROR_LAUNCH_WORKER_INDEX"]), x * scale


def _raise_in_worker_1(folder):
    if os.environ["JAXMIRROR_LAUNCH_WORKER_INDEX"] == "1":
        while not os.path.exists(os.path.join(folder, "pid0")):
            time.sleep(0.05)
        raise ValueError("bad input in worker 1")
    with open(os.path.join(folder, "pid0"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)


def test_run_returns_the_values_in_worker_order_and_passes_arguments(launch):
    assert launch.run(_index_times, workers=3, args=(10,), kwargs={"scale": 2},
                      timeout=60) == [(0, 20), (1, 20), (2, 20)]


def _joins_with(params):
    import jaxmirror as jm  # noqa: PLC0415 - in the worker
    strategy = jm.MultiWorkerMirroredStrategy()  # JAX must not have started before this
    return type(params["w"]).__name__, params["w"].tolist(), strategy.num_replicas_in_sync


def test_run_ships_jax_arrays_as_numpy_so_the_workers_can_still_join(launch):
    import jax.numpy as jnp
    shown = launch.run(_joins_with, workers=2, devices_per_worker=1,
                       args=({"w": jnp.arange(3.0)},), timeout=120)
    assert shown == [("ndarray", [0.0, 1.0, 2.0], 2)] * 2


def test_run_ships_lambdas_and_closures(launch):
    offset, seen = 5, ["a", "b"]
    assert launch.run(lambda: offset + len(seen) + int(os.environ["JAXMIRROR_LAUNCH_WORKER_INDEX"]),
                      workers=2, timeout=60) == [7, 8]


def test_run_sets_the_environment(launch):
    def environment():
        return {k: os.environ.get(k) for k in ["MY_VAR", "JAX_NUM_CPU_DEVICES", "XLA_FLAGS",
                                               "JAXMIRROR_LAUNCH_WORKERS"]}

    shown = launch.run(environment, workers=2, devices_per_worker=2, env={"MY_VAR": "x"},
                       timeout=60)
    for s in shown:
        assert s["MY_VAR"] == "x" and s["JAX_NUM_CPU_DEVICES"] == "2"
        assert s["JAXMIRROR_LAUNCH_WORKERS"] == "2"
        assert s["XLA_FLAGS"].split().count(f"{DEVICE_FLAG}2") == 1
        assert f"{DEVICE_FLAG}8" not in s["XLA_FLAGS"]


def test_run_forwards_the_workers_output_with_their_prefix(launch, capsys):
    def talk():
        print("hello")
        print("oops", file=sys.stderr)

    launch.run(talk, workers=2, timeout=60)
    out, err = capsys.readouterr()
    assert sorted(out.splitlines()) == ["[worker 0] hello", "[worker 1] hello"]
    assert sorted(err.splitlines()) == ["[worker 0] oops", "[worker 1] oops"]


def test_run_raises_the_first_workers_exception_and_stops_the_others(launch, tmp_path):
    start = time.monotonic()
    with pytest.raises(launch.WorkerError) as caught:
        launch.run(_raise_in_worker_1, workers=2, args=(str(tmp_path),), grace=2, timeout=60)
    assert time.monotonic() - start < 20
    e = caught.value
    assert isinstance(e, RuntimeError) and (e.worker_index, e.exit_code) == (1, 1)
    assert str(e).startswith("worker 1 raised ValueError: bad input in worker 1\n")
    assert "in _raise_in_worker_1" in e.traceback and "in _raise_in_worker_1" in str(e)
    assert not _alive(_pids(tmp_path, ["pid0"])[0])


def _ended_by_worker_1(folder):
    """Worker 1 listens at its TF_CONFIG address (so the group counts as a joined cluster)
    and raises a second later; worker 0 ends itself at once with UnavailableError naming it,
    as a joined worker does that hears of a failure before the failed worker's exit is seen."""
    import socket

    from jaxmirror.errors import UnavailableError

    index = int(os.environ["JAXMIRROR_LAUNCH_WORKER_INDEX"])
    host, port = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"][1].rsplit(":", 1)
    if index == 1:
        with socket.create_server((host, int(port))):
            time.sleep(1.0)
            raise ValueError("the real failure, in worker 1")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    raise UnavailableError("worker 1 (127.0.0.1) raised ValueError: the real failure")


def test_run_reports_the_worker_where_a_joined_groups_failure_started(launch, tmp_path):
    with pytest.raises(launch.WorkerError) as caught:
        launch.run(_ended_by_worker_1, workers=2, args=(str(tmp_path),), grace=2, timeout=60)
    e = caught.value
    assert (e.worker_index, e.exit_code) == (1, 1), str(e)
    assert str(e).startswith("worker 1 raised ValueError: the real failure, in worker 1")


@pytest.mark.parametrize("die,code,says", [
    (lambda: os._exit(3), 3, "exited with code 3"),
    (lambda: os.kill(os.getpid(), signal.SIGABRT), -signal.SIGABRT, "was killed by SIGABRT"),
], ids=["os._exit", "SIGABRT"])
def test_run_reports_a_worker_that_dies_without_an_exception(launch, die, code, says):
    def die_in_worker_1():
        if os.environ["JAXMIRROR_LAUNCH_WORKER_INDEX"] == "1":
            print("last words", file=sys.stderr, flush=True)
            die()
        return "fine"

    with pytest.raises(launch.WorkerError) as caught:
        launch.run(die_in_worker_1, workers=2, timeout=60)
    assert (caught.value.worker_index, caught.value.exit_code) == (1, code)
    assert f"worker 1 {says} without returning a result" in str(caught.value)
    assert "last words" in str(caught.value)


def test_run_times_out_naming_the_running_workers(launch):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"timed out after 1 s .*worker\(s\) 0, 1 were still"):
        launch.run(time.sleep, workers=2, args=(60,), timeout=1, grace=1)
    assert time.monotonic() - start < 15


def test_ctrl_c_in_the_parent_stops_the_workers(launch, tmp_path):
    def sleep(folder):
        index = os.environ["JAXMIRROR_LAUNCH_WORKER_INDEX"]
        with open(os.path.join(folder, f"pid{index}"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)

    def interrupt():
        _pids(tmp_path, ["pid0", "pid1"])
        os.kill(os.getpid(), signal.SIGINT)  # Python raises KeyboardInterrupt in the main thread

    threading.Thread(target=interrupt, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        launch.run(sleep, workers=2, args=(str(tmp_path),), grace=5, timeout=60)
    assert time.monotonic() - start < 30
    assert not any(map(_alive, _pids(tmp_path, ["pid0", "pid1"])))


@pytest.mark.parametrize("kwargs,error,says", [
    (dict(fn=42), TypeError, "`fn` must be callable; got 42"),
    (dict(workers=0), ValueError, "`workers` must be a positive int; got 0"),
    (dict(workers="2"), TypeError, "`workers` must be a positive int; got '2' of type str"),
    (dict(workers=True), TypeError, "`workers` must be a positive int; got True"),
    (dict(devices_per_worker=0), ValueError, "`devices_per_worker` must be None or a positive int"),
    (dict(timeout=0), ValueError, "`timeout` must be None or a number > 0 (seconds); got 0"),
    (dict(grace=-1), ValueError, "`grace` must be a number >= 0 (seconds); got -1"),
    (dict(args=5), TypeError, "`args` must be a tuple or list"),
    (dict(kwargs=[1]), TypeError, "`kwargs` must be None or a dict"),
    (dict(env={"A": 1}), TypeError, "`env` must be None or a mapping of str to str"),
    (dict(args=(threading.Lock(),)), TypeError, "cannot pickle `fn`, `args` and `kwargs`"),
])
def test_run_checks_its_arguments_before_starting_anything(launch, kwargs, error, says):
    call = dict(fn=len, workers=1, args=("ab",)) | kwargs
    with pytest.raises(error) as caught:
        launch.run(**call)
    assert says in str(caught.value)


def test_run_from_a_notebook_ships_the_notebooks_function_and_shows_output_in_the_cell():
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in [
        "import os, jaxmirror.launch\n"
        "base = 40\n"
        "def work(x):\n"
        "    print('hi from', os.environ['JAXMIRROR_LAUNCH_WORKER_INDEX'])\n"
        "    return base + x",
        "jaxmirror.launch.run(work, workers=2, args=(2,), timeout=60)",
    ]]
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=120).execute()
    outputs = nb.cells[1].outputs
    printed = "".join(o["text"] for o in outputs if o["output_type"] == "stream")
    assert sorted(printed.splitlines()) == ["[worker 0] hi from 0", "[worker 1] hi from 1"]
    results = [o["data"]["text/plain"] for o in outputs if o["output_type"] == "execute_result"]
    assert results == ["[42, 42]"]
