"""Multi-worker failures end with clear errors within the timeout, never a hang or a bare abort.

Through the launcher (``python -m jaxmirror.launch``, which gives the others time to end on
their own before it stops them, and says how each worker ended): a worker that raises (in a
step, between steps, before its first collective) or is killed, workers that run different
programs, and calls only the chief makes (TF's print-or-save-on-the-chief habit) end every
worker with an error naming the worker and the call, within 30 s, with 1 and 2 devices per
worker. Start-up failures start worker processes directly on loopback, each bounded by a
timeout and killed at the end of its test; errors that come before anything starts are checked
in this process.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import jaxmirror as jm
from jaxmirror.launch.processes import free_ports

WORKER = textwrap.dedent("""
    import os, sys
    import jax, jax.numpy as jnp
    import jaxmirror as jm
    timeout, mode = float(sys.argv[1]), sys.argv[2]
    options = jm.experimental.CommunicationOptions(timeout_seconds=timeout)
    strategy = jm.MultiWorkerMirroredStrategy(communication_options=options)
    print("joined", jax.process_index(), flush=True)

    @strategy.run
    def step(x):
        return jm.get_replica_context().all_reduce("SUM", x)

    for i in range(100000):
        total = float(strategy.reduce("SUM", step(jnp.float32(1.0)), axis=None))
        if mode == "die" and jax.process_index() == 1 and i == 20:
            os._exit(9)
""")


BREAKING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multi_worker_breaking.py")
LAUNCH_LIMIT = 150  # the launcher's own --timeout: no run of these may hang a test


class Launched:
    """A ``python -m jaxmirror.launch`` run of ``multi_worker_breaking.py``: its exit code and
    its output lines, each with the time it arrived."""

    def __init__(self, mode, workers, devices, timeout=None):
        command = [sys.executable, "-m", "jaxmirror.launch", "--workers", str(workers),
                   "--devices-per-worker", str(devices), "--timeout", str(LAUNCH_LIMIT),
                   BREAKING, mode] + ([str(timeout)] if timeout else [])
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        self.lines = []
        try:
            for line in proc.stdout:
                self.lines.append((time.time(), line.rstrip("\n")))
            self.code = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.text = "\n".join(line for _, line in self.lines)

    def breaking_at(self) -> float:
        return min(float(line.split()[-1]) for _, line in self.lines if " BREAKING " in line)

    def error_of(self, worker: int):
        """(arrival time, text) of worker ``worker``'s final error line."""
        found = [(t, line.split("] ", 1)[1]) for t, line in self.lines
                 if line.startswith(f"[worker {worker}] jaxmirror.errors.")]
        assert found, f"worker {worker} printed no jaxmirror error:\n{self.text[-6000:]}"
        return found[-1]

    def exits(self) -> str:
        (line,) = [line for _, line in self.lines if line.startswith("jaxmirror.launch: worker 0 ")
                   and "; worker 1 " in line]
        return line


def _config(cluster, job, index):
    return json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})


@pytest.fixture
def start(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    started = []

    def run(cluster, job, index, timeout, mode="train"):
        env = dict(os.environ, TF_CONFIG=_config(cluster, job, index), PYTHONUNBUFFERED="1",
                   XLA_FLAGS="--xla_force_host_platform_device_count=1")
        proc = subprocess.Popen([sys.executable, str(script), str(timeout), mode], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        started.append(proc)
        return proc

    yield run
    for proc in started:  # whatever a failed assertion left running
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _finish(proc, limit):
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=limit)
    return proc.returncode, out, err, time.monotonic() - t0


def test_a_chief_whose_peer_never_starts_fails_naming_it_within_the_timeout(start):
    ports = free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    code, _, err, elapsed = _finish(start(cluster, "worker", 0, timeout=4), limit=60)
    assert code == 1, err[-2000:]  # a Python exception, not abort()'s 134
    assert "TimeoutError" in err and "did not assemble within 4 s" in err
    assert f"Never started, or not reachable (nothing listens at the address): worker 1 " \
           f"(127.0.0.1:{ports[1]})" in err
    assert elapsed < 40


def test_a_worker_that_cannot_reach_the_chief_fails_naming_it(start):
    ports = free_ports(2)
    cluster = {"chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]}
    code, _, err, elapsed = _finish(start(cluster, "worker", 0, timeout=3), limit=60)
    assert code == 1, err[-2000:]
    assert (f"could not reach the coordinator, chief 0 (127.0.0.1:{ports[0]}) (process 0 of "
            f"2), within 3 s") in err
    assert elapsed < 40


def test_a_worker_killed_mid_training_makes_the_other_exit_with_an_error(start):
    ports = free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    survivor = start(cluster, "worker", 0, timeout=15, mode="die")
    victim = start(cluster, "worker", 1, timeout=15, mode="die")
    code, out, err, elapsed = _finish(survivor, limit=90)
    assert victim.wait(timeout=30) == 9
    assert "joined 0" in out
    assert code == 1, err[-3000:]  # not a hang, not SIGABRT (-6 / 134)
    assert (f"jaxmirror.errors.UnavailableError: worker 1 (127.0.0.1:{ports[1]}) stopped (its "
            f"address no longer answers") in err
    assert "Gloo all-reduce failed" in err  # what the collective said, as the cause
    assert elapsed < 60


@pytest.mark.parametrize("tf_config,match", [
    ("{not json", "TF_CONFIG"),
    (_config({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "worker", 2), "outside"),
    (_config({"worker": ["127.0.0.1"]}, "worker", 0), "host:port"),
    (_config({"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}, "ps", 0),
     "only 'chief' and 'worker' tasks"),
    (_config({"worker": ["localhost:2222", "localhost:2222"]}, "worker", 0), "the same address"),
    (_config({"chief": ["127.0.0.1:1", "127.0.0.1:3"], "worker": ["127.0.0.1:2"]}, "worker", 0),
     "chief"),
])
def test_a_bad_cluster_is_refused_before_anything_starts(monkeypatch, tf_config, match):
    monkeypatch.setenv("TF_CONFIG", tf_config)
    with pytest.raises(ValueError, match=match):
        jm.MultiWorkerMirroredStrategy()
    import jax
    assert not jax.distributed.is_initialized()


def test_a_cluster_after_jax_has_started_is_refused_clearly(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", _config({"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                                            "worker", 0))
    with pytest.raises(RuntimeError, match="JAX has already started in this process"):
        jm.MultiWorkerMirroredStrategy()


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="`cluster_resolver` must be"):
        jm.MultiWorkerMirroredStrategy(cluster_resolver={"worker": ["a:1"]})
    with pytest.raises(ValueError, match="`communication_options` must be"):
        jm.MultiWorkerMirroredStrategy(communication_options={"timeout_seconds": 3})
    with pytest.raises(ValueError, match="`timeout_seconds` must be a positive number"):
        jm.experimental.CommunicationOptions(timeout_seconds=0)
    with pytest.raises(ValueError, match="`bytes_per_pack` must be a non-negative int"):
        jm.experimental.CommunicationOptions(bytes_per_pack=-1)
    with pytest.raises(ValueError, match="`implementation` must be a CommunicationImplementation"):
        jm.experimental.CommunicationOptions(implementation="MPI")


def test_without_a_cluster_it_trains_on_this_machine(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = jm.MultiWorkerMirroredStrategy()
    assert strategy.num_replicas_in_sync == 8
    assert strategy.cluster_resolver.cluster_spec().as_dict() == {}
    total = strategy.reduce("SUM", strategy.run(lambda: 1.0), axis=None)
    assert float(total) == 8.0
    strategy.experimental_initialize()
    config = strategy.update_config_proto({"keep": 1})
    assert config["keep"] == 1 and config["num_processes"] == 1
    assert config["jax_cpu_collectives_implementation"] == "gloo"


def test_copies_as_tf():
    import copy

    strategy = jm.MirroredStrategy(["CPU:0", "CPU:1"])
    clone = copy.deepcopy(strategy)
    assert clone is not strategy and clone.extended.devices == strategy.extended.devices
    assert float(clone.reduce("SUM", clone.run(lambda: 1.0), axis=None)) == 2.0
    with pytest.raises(RuntimeError, match="Must only deepcopy DistributionStrategy"):
        copy.copy(strategy)
    one = copy.deepcopy(jm.OneDeviceStrategy("CPU:1"))
    assert one.extended.devices == (jm.OneDeviceStrategy("CPU:1").extended.devices[0],)


def test_tpu_strategy_refuses_without_a_tpu():
    with pytest.raises(ValueError, match="not 'tpu'"):
        jm.TPUStrategy()


# -- failures through the launcher (issue 27) -----------------------------------------------------
RAISED = {"raise-in-step": "ValueError: this step cannot take 2 rows",
          "raise-between": "RuntimeError: lost the data file",
          "raise-before": "ValueError: bad configuration on this worker"}


def _survivors_end_naming(run, failed, workers, what, within=30.0, error="UnavailableError"):
    """Every worker but ``failed`` exits with code 1 (not stopped by the launcher, not
    SIGABRT) printing ``error`` naming worker ``failed`` and ``what``."""
    assert "still running; stopping" not in run.text, run.text[-6000:]
    exits = run.exits()
    for w in range(workers):
        if w == failed:
            continue
        assert f"worker {w} exited with code 1" in exits, exits
        at, text = run.error_of(w)
        assert text.startswith(f"jaxmirror.errors.{error}: "), text
        assert f"worker {failed} (127.0.0.1:" in text and what in text, text
        assert f"this worker, worker {w} (127.0.0.1:" in text, text
        assert "stops too; fix that, then restart every worker (from a checkpoint)." in text
        assert at - run.breaking_at() < within, (at - run.breaking_at(), text)


@pytest.mark.parametrize("workers,devices", [(2, 1), (2, 2)])
@pytest.mark.parametrize("mode", sorted(RAISED))
def test_a_worker_that_raises_ends_the_others_naming_it(mode, workers, devices):
    run = Launched(mode, workers, devices)
    assert run.code == 1
    assert "worker 1 exited with code 1" in run.exits()
    _survivors_end_naming(run, 1, workers, RAISED[mode])


def test_a_worker_that_raises_ends_three_others():
    run = Launched("raise-between", 4, 1)
    _survivors_end_naming(run, 1, 4, RAISED["raise-between"])


@pytest.mark.parametrize("workers,devices", [(2, 1), (2, 2), (4, 1)])
def test_a_killed_worker_ends_the_others_naming_it(workers, devices):
    run = Launched("kill", workers, devices)
    assert "worker 1 was killed by SIGKILL" in run.exits()
    _survivors_end_naming(run, 1, workers, "stopped")


def test_a_killed_chief_ends_the_others_naming_it():
    # The coordination service runs beside the chief: its death is named like any other's.
    run = Launched("kill-chief", 2, 2)
    assert "worker 0 was killed by SIGKILL" in run.exits()
    _survivors_end_naming(run, 0, 2, "stopped (sent no sign of life for 15 s")


@pytest.mark.parametrize("workers,devices", [(2, 2), (4, 1)])
def test_workers_running_different_programs_get_a_named_error(workers, devices):
    run = Launched("mismatch", workers, devices)
    assert run.code == 1
    exits = run.exits()
    for w in range(workers):
        assert f"worker {w} exited with code 1" in exits, exits
    # Whoever compares with worker 1 first finds the difference; the others learn of it.
    found = [run.error_of(w) for w in range(workers)]
    for at, text in found:
        assert text.startswith("jaxmirror.errors.CollectiveMismatchError: step `step`: worker ")
        assert "runs a different step from worker" in text, text
        assert "with inputs (float32[1]" in text and ", program " in text
        assert at - run.breaking_at() < 30.0
    _, text = found[1]
    assert "worker 1 (127.0.0.1:" in text


CHIEF_ONLY = {"chief-result": "`Mean.result()`", "chief-save": "`jaxmirror.checkpoint.save`",
              "chief-reduce": "`strategy.reduce`"}


@pytest.mark.parametrize("workers,devices", [(2, 2), (4, 1)])
@pytest.mark.parametrize("mode", sorted(CHIEF_ONLY))
def test_a_call_only_the_chief_makes_ends_every_worker_with_a_named_error(mode, workers,
                                                                         devices):
    # TF's habit of printing or saving on the chief only, around a call that communicates.
    run = Launched(mode, workers, devices)
    assert run.code == 1
    at, text = run.error_of(0)
    call = CHIEF_ONLY[mode].strip("`")
    assert text.startswith(f"jaxmirror.errors.CollectiveMismatchError: {call}: "), text
    assert ("worker 0 (127.0.0.1:" in text and "never called there, so neither can go on"
            in text) or "ended its program without making this call" in text, text
    assert "make the call on every worker" in text and "should_checkpoint" in text
    assert at - run.breaking_at() < 30.0
    _survivors_end_naming(run, 0, workers, call, error="CollectiveMismatchError")


def test_a_metric_read_on_the_chief_after_the_loop_names_the_workers_that_ended():
    run = Launched("chief-result-at-end", 2, 2)
    at, text = run.error_of(0)
    assert text.startswith("jaxmirror.errors.CollectiveMismatchError: Mean.result(): worker 1 "
                           "(127.0.0.1:")
    assert "ended its program without making this call, which worker 0 (127.0.0.1:" in text
    _survivors_end_naming(run, 0, 2, "Mean.result()", error="CollectiveMismatchError")


@pytest.mark.parametrize("devices", [1, 2])
def test_timeout_seconds_bounds_each_collective(devices):
    # Worker 1 is busy 60 s between steps; worker 0 waits in the next step for 5 s at most.
    run = Launched("busy", 2, devices, timeout=5)
    at, text = run.error_of(0)
    assert text.startswith("jaxmirror.errors.DeadlineExceededError: MultiWorkerMirroredStrategy: "
                           "`step` (this worker's cross-worker call 4) on worker 0 (127.0.0.1:")
    assert "did not finish within 5 s" in text
    assert "worker 1 (127.0.0.1:" in text and "is not in it (busy, slow" in text  # the sleeper
    assert 5.0 < at - run.breaking_at() < 20.0
    _, text = run.error_of(1)  # raised into it when its sleep ends, or printed at exit
    assert text.startswith("jaxmirror.errors.DeadlineExceededError: ")
    assert "did not finish within 5 s" in text and "this worker, worker 1" in text


def test_a_run_that_breaks_nothing_finishes_cleanly():
    run = Launched("ok", 2, 2)
    assert run.code == 0, run.text[-4000:]
    assert run.text.count("finished") == 2
    assert "jaxmirror.errors" not in run.text
