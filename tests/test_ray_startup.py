"""Starting Ray on a busy machine: RayClusterResolver's bounded start-up and its message, and
the parameter-server fixtures' check for left processes counting only their own.

No Ray node is started here: ``ray.init`` is replaced by one that fails as Ray 2.60's does when
its raylet does not register within its fixed 30 s (``ray/_private/node.py``), on a fake clock.
"""

import os
import subprocess
import sys
import time
import types

import pytest

import jaxmirror as jm
import ps_helpers
from jaxmirror.cluster_resolver import ray_cluster
from jaxmirror.coordinator.cluster import RayCluster

ray = pytest.importorskip("ray")

RAY_TIMEOUT_TEXT = ("The current node timed out during startup. This could happen because some "
                    "of the raylet failed to startup or the GCS has become overloaded.")
RAY_DIR = os.path.dirname(ray.__file__)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


@pytest.fixture
def slow_ray(monkeypatch):
    """``ray.init`` that fails ``fails`` times (each try costing 40 s on the fake clock, and
    leaving a Ray-like process behind, as a failed start does), then succeeds."""
    clock = FakeClock()
    calls, spawned = [], []
    state = {"fails": 10**9, "initialized": False}

    def init(**kwargs):
        calls.append((dict(kwargs, _system_config=dict(kwargs["_system_config"])),
                      os.environ.get("RAY_gcs_server_port_wait_time_s")))
        kwargs["_system_config"]["object_spilling_config"] = f"session {len(calls)}"  # as Ray
        clock.now += 40.0
        if len(calls) <= state["fails"]:
            spawned.append(subprocess.Popen(
                [sys.executable, "-c", "import time; time.sleep(120)",
                 os.path.join(RAY_DIR, "core/src/ray/gcs/gcs_server")]))
            raise Exception(RAY_TIMEOUT_TEXT)
        state["initialized"] = True

    class Context:
        gcs_address = "127.0.0.1:6379"

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: state["initialized"])
    monkeypatch.setattr(ray, "shutdown", lambda **kw: state.update(initialized=False))
    monkeypatch.setattr(ray, "get_runtime_context", lambda: Context())
    monkeypatch.setattr(ray_cluster, "time",  # the module's clock only, not time.monotonic
                        types.SimpleNamespace(monotonic=clock.monotonic, sleep=lambda s: None))
    monkeypatch.delenv("RAY_gcs_server_port_wait_time_s", raising=False)
    yield state, calls, spawned
    for p in spawned:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_a_start_that_times_out_is_retried_within_the_bound_then_named(slow_ray):
    state, calls, spawned = slow_ray
    with pytest.raises(TimeoutError) as info:
        jm.cluster_resolver.RayClusterResolver(2, 1, startup_timeout_seconds=100)
    message = str(info.value)
    assert message.startswith("RayClusterResolver: ")
    for words in ("did not start within 100 s", "3 tries", "busy",
                  "startup_timeout_seconds=", "address='auto'", "timed out during startup"):
        assert words in message, words
    assert isinstance(info.value.__cause__, Exception)
    assert str(info.value.__cause__) == RAY_TIMEOUT_TEXT
    # tries begin at 0, 40 and 80 s of the 100 s; the bound reaches Ray: the GCS's port wait
    # (an environment variable Ray reads) and the workers' registration (a system config)
    assert len(calls) == 3
    assert [env for _, env in calls] == ["100", "60", "30"]
    assert all(kw["_system_config"] == {"worker_register_timeout_seconds": 100}
               for kw, _ in calls)
    assert "RAY_gcs_server_port_wait_time_s" not in os.environ  # restored after each try
    # every failed try's processes were stopped, so none is left to the next try or the test
    assert [p.wait(timeout=30) is not None for p in spawned] == [True] * 3
    assert not state["initialized"]


def test_a_start_that_succeeds_on_a_later_try_gives_a_working_resolver(slow_ray):
    state, calls, spawned = slow_ray
    state["fails"] = 2
    r = jm.cluster_resolver.RayClusterResolver(2, 1, startup_timeout_seconds=300)
    assert len(calls) == 3 and state["initialized"]
    assert r.cluster_spec().as_dict() == {"chief": ["127.0.0.1:6379"],
                                          "worker": ["127.0.0.1:6379"] * 2,
                                          "ps": ["127.0.0.1:6379"]}
    assert [p.wait(timeout=30) is not None for p in spawned] == [True, True]
    assert calls[0][0]["_system_config"] == {"worker_register_timeout_seconds": 300}
    r.shutdown()
    assert not state["initialized"]


def test_an_operator_setting_of_the_gcs_wait_is_kept(slow_ray, monkeypatch):
    state, calls, _ = slow_ray
    state["fails"] = 0
    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "7")
    jm.cluster_resolver.RayClusterResolver(1, 1, startup_timeout_seconds=200).shutdown()
    assert calls[0][1] == "7" and os.environ["RAY_gcs_server_port_wait_time_s"] == "7"


def test_other_start_errors_are_not_retried(monkeypatch):
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        raise ValueError("bad resources")
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(ValueError, match="bad resources"):
        jm.cluster_resolver.RayClusterResolver(1, 1)
    assert len(calls) == 1


@pytest.mark.parametrize("bad", [0, -1, "60", True, float("nan"), float("inf"),
                                 pytest.param(10 ** 400, id="too-big-for-a-float")])
def test_startup_timeout_must_be_a_positive_number(bad):
    with pytest.raises(ValueError, match=r"RayClusterResolver: `startup_timeout_seconds` must be"):
        jm.cluster_resolver.RayClusterResolver(1, 1, startup_timeout_seconds=bad)


def test_the_left_process_check_counts_only_this_tests_own_processes():
    stale = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "raylet"])
    try:
        before = ps_helpers.snapshot()
        ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        # a worker of our raylet that outlived it, reparented away from this process
        orphan_pid = int(subprocess.run(
            ["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(120)' "
                         "</dev/null >/dev/null 2>&1 & echo $!"],
            env={**os.environ, "RAY_RAYLET_PID": str(ours.pid)}, capture_output=True,
            text=True, check=True).stdout)
        try:
            deadline = time.monotonic() + 30
            own = ps_helpers.own_processes(before, {ours.pid})
            while len(own) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
                own = ps_helpers.own_processes(before, {ours.pid})
            pids = {int(row.split()[0]) for row in own}
            assert pids == {ours.pid, orphan_pid}
            assert stale.pid not in pids
        finally:
            os.kill(orphan_pid, 9)
            ours.kill()
            ours.wait()
        # SIGKILL takes effect when the killed process next runs: on a busy machine, not at once.
        deadline = time.monotonic() + 30
        while ps_helpers.own_processes(before, {ours.pid}) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ps_helpers.own_processes(before, {ours.pid}) == []
    finally:
        stale.kill()
        stale.wait()


def test_actors_not_up_in_time_are_named(monkeypatch):
    class Actor:
        def __init__(self, name):
            self.ping = types.SimpleNamespace(remote=lambda: name)
    cluster = RayCluster.__new__(RayCluster)  # its actors faked: no Ray node here
    cluster.ps = [Actor("ps0"), Actor("ps1")]
    cluster.workers = [Actor("w0"), Actor("w1")]
    waits = []

    def wait(refs, num_returns, timeout):
        waits.append((list(refs), num_returns, timeout))
        return [r for r in refs if r != "w1"], ["w1"]
    monkeypatch.setattr(ray, "wait", wait)
    with pytest.raises(jm.errors.DeadlineExceededError) as info:
        cluster.wait_ready(timeout=45)
    assert waits == [(["ps0", "ps1", "w0", "w1"], 4, 45)]
    assert str(info.value) == (
        "ParameterServerStrategy: worker 1 did not start within 45 s (the machine may be "
        "busy); wait longer: strategy.extended.ray_cluster.wait_ready(timeout=...).")


def test_the_strategy_given_another_resolver_names_the_start_up_bound(slow_ray):
    _, calls, _ = slow_ray
    spec = jm.cluster_resolver.ClusterSpec({"worker": ["w0:1", "w1:1"], "ps": ["p0:1"]})
    with pytest.raises(TimeoutError, match=r"^RayClusterResolver: the local Ray node did not "
                       r"start within 120 s \(3 tries; .*startup_timeout_seconds=.*"
                       r"ParameterServerStrategy"):
        jm.experimental.ParameterServerStrategy(jm.cluster_resolver.SimpleClusterResolver(spec))
    assert len(calls) == 3
