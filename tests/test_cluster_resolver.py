"""jaxmirror.cluster_resolver: ClusterSpec, the resolvers (TF_CONFIG, Slurm, simple), errors."""

import ast
import json
import os
import pathlib
import sys

import jax
import pytest

import jaxmirror.cluster_resolver as cr
from jaxmirror.cluster_resolver import (ClusterResolver, ClusterSpec, SimpleClusterResolver,
                                        SlurmClusterResolver, TFConfigClusterResolver,
                                        parse_address)
from jaxmirror.cluster_resolver import slurm
from jaxmirror.cluster_resolver.base import local_accelerators
from jaxmirror.cluster_resolver.slurm import expand_hostlist, expand_tasks_per_node

PACKAGE = pathlib.Path(cr.__file__).resolve().parent


# --- the package ---------------------------------------------------------------------------

def test_public_names():
    assert sorted(cr.__all__) == ["ClusterResolver", "ClusterSpec", "RayClusterResolver",
                                  "SimpleClusterResolver", "SlurmClusterResolver",
                                  "TFConfigClusterResolver", "parse_address"]
    assert all(getattr(cr, name).__doc__ for name in cr.__all__)


def test_imports_only_the_standard_library_jax_and_itself():
    """Ray, an optional extra, is the one exception: imported by ``ray_support`` only, and only
    inside a function, so importing the resolvers never needs it."""
    allowed = set(sys.stdlib_module_names) | {"jax", "numpy", "__future__"}
    lazy_ray = []
    for path in PACKAGE.glob("*.py"):
        assert len(path.read_text().splitlines()) <= 400, path.name
        tree = ast.parse(path.read_text())
        top_level = set(map(id, tree.body))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert not node.level, f"{path.name}: relative import"
                names = [node.module]
            else:
                continue
            for name in names:
                if name.split(".")[0] == "ray":
                    assert path.name == "ray_support.py" and id(node) not in top_level, path.name
                    lazy_ray.append(path.name)
                    continue
                assert (name.split(".")[0] in allowed
                        or name.startswith("jaxmirror.cluster_resolver")), (path.name, name)
    assert lazy_ray == ["ray_support.py"]


# --- ClusterSpec ---------------------------------------------------------------------------

def test_cluster_spec_dense():
    spec = ClusterSpec({"worker": ["w0:2222", "w1:2222"], "chief": ("c0:2222",)})
    assert spec.jobs == ["chief", "worker"]
    assert spec.num_tasks("worker") == 2 and spec.num_tasks("chief") == 1
    assert spec.task_indices("worker") == [0, 1]
    assert spec.task_address("worker", 1) == "w1:2222"
    assert spec.job_tasks("worker") == ["w0:2222", "w1:2222"]
    assert spec.as_dict() == {"chief": ["c0:2222"], "worker": ["w0:2222", "w1:2222"]}
    assert repr(spec) == "ClusterSpec({'chief': ['c0:2222'], 'worker': ['w0:2222', 'w1:2222']})"
    assert bool(spec)


def test_cluster_spec_sparse_jobs_as_tf():
    spec = ClusterSpec({"worker": {3: "w3:2222", "1": "w1:2222"}, "ps": ["p0:1"]})
    assert spec.num_tasks("worker") == 2
    assert spec.task_indices("worker") == [1, 3]
    assert spec.task_address("worker", 3) == "w3:2222"
    assert spec.job_tasks("worker") == [None, "w1:2222", None, "w3:2222"]
    assert spec.as_dict() == {"ps": ["p0:1"], "worker": {1: "w1:2222", 3: "w3:2222"}}
    # A dict with indices 0..n-1 is dense: as_dict gives a list, as TF.
    assert ClusterSpec({"worker": {1: "b:1", 0: "a:1"}}).as_dict() == {"worker": ["a:1", "b:1"]}


def test_cluster_spec_round_trip_and_equality():
    spec = ClusterSpec({"worker": {0: "a:1", 2: "c:1"}, "ps": ["p:1"], "chief": []})
    assert ClusterSpec(spec.as_dict()) == spec
    assert ClusterSpec(spec) == spec and ClusterSpec(spec) is not spec
    assert spec == {"ps": ["p:1"], "worker": {0: "a:1", 2: "c:1"}, "chief": {}}
    assert spec != ClusterSpec({"ps": ["p:1"]})
    assert spec != {"worker": "not a list"} and spec != 3
    assert spec.as_dict()["chief"] == {} and spec.job_tasks("chief") == []
    assert spec.num_tasks("chief") == 0


def test_empty_cluster_spec():
    for empty in (ClusterSpec(), ClusterSpec(None), ClusterSpec({}), ClusterSpec(ClusterSpec())):
        assert not empty and empty.jobs == [] and empty.as_dict() == {}
        assert empty == ClusterSpec()
    with pytest.raises(ValueError, match="no job 'worker' in the cluster; the cluster has no jobs"):
        ClusterSpec().num_tasks("worker")


def test_unknown_job_and_missing_task_are_named():
    spec = ClusterSpec({"worker": ["a:1", "b:1"], "ps": {1: "p:1", 4: "q:1"}})
    for method in (spec.num_tasks, spec.task_indices, spec.job_tasks,
                   lambda job: spec.task_address(job, 0)):
        with pytest.raises(ValueError, match=r"no job 'chief' in the cluster; its jobs are "
                                             r"\['ps', 'worker'\]"):
            method("chief")
    with pytest.raises(ValueError, match="job 'worker' has no task 2; its task indices are 0-1"):
        spec.task_address("worker", 2)
    with pytest.raises(ValueError, match="job 'ps' has no task 0; its task indices are 1, 4"):
        spec.task_address("ps", 0)
    with pytest.raises(ValueError, match="job 'worker' has no task '1'"):
        spec.task_address("worker", "1")


@pytest.mark.parametrize("cluster,error,match", [
    ({"worker": "a:1"}, TypeError,
     r"job 'worker' must be a list of 'host:port' strings or a dict \{task index: 'host:port'\}, "
     r"got str 'a:1'; write \['a:1'\] for one task"),
    ({"worker": 2222}, TypeError, "job 'worker' must be a list .* got int 2222"),
    (["a:1"], TypeError, r"the cluster must be a dict mapping job names .* got list \['a:1'\]"),
    ({3: ["a:1"]}, TypeError, "job name 3 is not a non-empty string"),
    ({"worker": {-1: "a:1"}}, ValueError, "job 'worker' has task index -1; task indices are"),
    ({"worker": {1.0: "a:1"}}, TypeError, "job 'worker' has task index 1.0, a float"),
    ({"worker": {1: "a:1", "1": "b:1"}}, ValueError, "job 'worker' gives task 1 twice"),
    ({"worker": ["a:1", 2222]}, TypeError, "job 'worker' task 1: address 2222 is a int"),
])
def test_malformed_clusters_are_named(cluster, error, match):
    with pytest.raises(error, match=match) as info:
        ClusterSpec(cluster)
    assert str(info.value).startswith("ClusterSpec: ")


@pytest.mark.parametrize("address,why", [
    ("host1", "has no port"),
    ("host1:", "has no port"),
    ("host1:http", "has port 'http', not an integer"),
    ("host1:0", "has port 0, outside 1-65535"),
    ("host1:65536", "has port 65536, outside 1-65535"),
    (":2222", "has no host"),
    ("host 1:2222", "has an invalid host 'host 1'"),
    ("::1:2222", "looks like an IPv6 address without brackets"),
    ("[::1]", "has no port"),
    ("[::1:2222", "opens a '\\[' it does not close"),
    ("[host1]:2222", "has 'host1' in brackets, which is not an IPv6 address"),
    ("grpc://host1:2222", "has a protocol; give the protocol as `rpc_layer`"),
])
def test_bad_addresses_name_the_job_task_and_address(address, why):
    with pytest.raises(ValueError) as info:
        ClusterSpec({"worker": ["ok:1", address]})
    message = str(info.value)
    assert message.startswith(f"ClusterSpec: job 'worker' task 1: address {address!r} ")
    assert why.replace("\\", "") in message
    assert "expected 'host:port'" in message


def test_parse_address():
    assert parse_address("localhost:2222") == ("localhost", 2222)
    assert parse_address("10.0.0.7:65535") == ("10.0.0.7", 65535)
    assert parse_address("worker-0.svc.cluster.local:1") == ("worker-0.svc.cluster.local", 1)
    assert parse_address("[::1]:2222") == ("::1", 2222)
    assert parse_address("[fe80::1%eth0]:8470") == ("fe80::1%eth0", 8470)
    with pytest.raises(ValueError,
                       match=r"^parse_address: address 'x' has no port; expected 'host:port'"):
        parse_address("x")
    with pytest.raises(ValueError, match=r"^my task: address 'x:99999' has port 99999"):
        parse_address("x:99999", where="my task")
    with pytest.raises(TypeError, match=r"address None is a NoneType, not a string"):
        parse_address(None)


# --- ClusterResolver and SimpleClusterResolver ---------------------------------------------

class _Fixed(ClusterResolver):
    def cluster_spec(self):
        return ClusterSpec({"worker": ["a:1"]})

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        return ""


def test_cluster_resolver_is_abstract_with_tf_defaults():
    with pytest.raises(TypeError):
        ClusterResolver()
    resolver = _Fixed()
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == (None, None, None)
    assert resolver.environment == ""
    resolver.task_type, resolver.task_id, resolver.rpc_layer = "worker", 0, "grpc"
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 0, "grpc")
    assert resolver.num_accelerators() == {}  # 8 simulated CPUs: CPUs are not accelerators


def test_num_accelerators_counts_local_devices_by_kind(monkeypatch):
    class Device:
        def __init__(self, platform):
            self.platform = platform

    devices = [Device(p) for p in ("gpu", "gpu", "cpu", "tpu", "cuda")]
    monkeypatch.setattr(jax, "local_devices", lambda: devices)
    assert local_accelerators() == {"GPU": 3, "TPU": 1}
    assert _Fixed().num_accelerators("worker", 0) == {"GPU": 3, "TPU": 1}


def test_simple_cluster_resolver():
    spec = ClusterSpec({"worker": ["w0:2222", "w1:2222"]})
    gpus = {"GPU": 8}
    resolver = SimpleClusterResolver(spec, task_type="worker", task_id=1, environment="google",
                                     num_accelerators=gpus, rpc_layer="grpc")
    assert resolver.cluster_spec() is spec
    assert (resolver.task_type, resolver.task_id, resolver.environment) == ("worker", 1, "google")
    assert resolver.num_accelerators() is gpus
    assert resolver.master() == ""
    assert resolver.master("worker", 0) == "grpc://w0:2222"
    assert resolver.master("worker", 0, rpc_layer="grpc+verbs") == "grpc+verbs://w0:2222"
    assert SimpleClusterResolver(spec, master="m:1").master() == "m:1"
    assert SimpleClusterResolver(spec, master="m:1", rpc_layer="grpc").master() == "grpc://m:1"
    plain = SimpleClusterResolver({"worker": ["w0:2222"]})
    assert plain.cluster_spec() == ClusterSpec({"worker": ["w0:2222"]})
    assert plain.num_accelerators() == {} and plain.task_type is None and plain.rpc_layer is None
    plain.task_id = 0
    assert plain.task_id == 0


@pytest.mark.parametrize("kwargs,match", [
    ({"cluster_spec": ["w0:1"]}, "`cluster_spec` must be a ClusterSpec, got list"),
    ({"master": 1}, "`master` must be a string, got int 1"),
    ({"task_type": 1}, "`task_type` must be a job name such as 'worker', got int 1"),
    ({"task_id": "1"}, "`task_id` must be an integer >= 0, got str '1'"),
    ({"num_accelerators": 8}, r"`num_accelerators` must be a dict such as \{'GPU': 8\}, got int"),
])
def test_simple_cluster_resolver_names_bad_arguments(kwargs, match):
    kwargs = {"cluster_spec": ClusterSpec(), **kwargs}
    with pytest.raises(TypeError, match="^SimpleClusterResolver: " + match):
        SimpleClusterResolver(**kwargs)


# --- TFConfigClusterResolver ---------------------------------------------------------------

@pytest.fixture
def tf_config(monkeypatch):
    """Sets TF_CONFIG (a dict is dumped to JSON, a string is set as it is) for the test."""
    monkeypatch.delenv("TF_CONFIG", raising=False)

    def set_config(config):
        monkeypatch.setenv("TF_CONFIG", config if isinstance(config, str) else json.dumps(config))

    return set_config


def test_no_tf_config_is_an_empty_cluster(tf_config):
    for _ in range(2):
        resolver = TFConfigClusterResolver()
        assert resolver.cluster_spec() == ClusterSpec() and not resolver.cluster_spec()
        assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == (None, None, None)
        assert resolver.environment == "" and resolver.master() == ""
        assert resolver.num_accelerators() == {}
        tf_config("  ")  # set but blank: the same


def test_tf_config_worker_only(tf_config):
    tf_config({"cluster": {"worker": ["host1:2222", "host2:2222"]},
               "task": {"type": "worker", "index": 1}})
    resolver = TFConfigClusterResolver()
    assert resolver.cluster_spec().as_dict() == {"worker": ["host1:2222", "host2:2222"]}
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert resolver.rpc_layer is None
    assert resolver.master() == "host2:2222"  # no rpc_layer: the bare address, as TF
    assert resolver.master(rpc_layer="grpc") == "grpc://host2:2222"
    assert resolver.master("worker", 0) == "host1:2222"


def test_tf_config_chief_and_workers_with_rpc_layer(tf_config):
    tf_config({"cluster": {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"]},
               "task": {"type": "chief", "index": 0}, "rpc_layer": "grpc",
               "environment": "cloud"})
    resolver = TFConfigClusterResolver()
    assert resolver.cluster_spec().jobs == ["chief", "worker"]
    assert (resolver.task_type, resolver.task_id) == ("chief", 0)
    assert resolver.rpc_layer == "grpc" and resolver.environment == "cloud"
    assert resolver.master() == "grpc://c:2222"
    assert resolver.master("worker", 1) == "grpc://w1:2222"


def test_tf_config_parameter_servers(tf_config):
    tf_config({"cluster": {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "ps": ["p0:1", "p1:1"]},
               "task": {"type": "ps", "index": "1"}})  # a string index, as TF's int() reads it
    resolver = TFConfigClusterResolver(rpc_layer="grpc")
    assert (resolver.task_type, resolver.task_id) == ("ps", 1)
    assert resolver.cluster_spec().num_tasks("ps") == 2
    assert resolver.master() == "grpc://p1:1"


def test_tf_config_sparse_cluster(tf_config):
    tf_config({"cluster": {"worker": {"1": "w1:2222"}, "ps": ["p0:2222"]},
               "task": {"type": "worker", "index": 1}})
    resolver = TFConfigClusterResolver()
    assert resolver.cluster_spec().as_dict() == {"ps": ["p0:2222"], "worker": {1: "w1:2222"}}
    assert resolver.master() == "w1:2222"


def test_tf_config_single_task_and_session_master(tf_config):
    tf_config({"cluster": {"worker": ["only:2222"]}, "task": {"type": "worker", "index": 0},
               "rpc_layer": "grpc"})
    assert TFConfigClusterResolver().master() == ""  # the only task: no master, as TF
    tf_config({"cluster": {"worker": ["a:1", "b:1"]}, "session_master": "grpc://m:1"})
    assert TFConfigClusterResolver().master() == "grpc://m:1"


def test_constructor_arguments_override_tf_config(tf_config):
    tf_config({"cluster": {"chief": ["c:1"], "worker": ["w0:1", "w1:1"]},
               "task": {"type": "worker", "index": 0}, "rpc_layer": "grpc",
               "environment": "cloud"})
    resolver = TFConfigClusterResolver(task_type="chief", rpc_layer="grpc+verbs",
                                       environment="google")
    assert (resolver.task_type, resolver.task_id) == ("chief", 0)
    assert resolver.rpc_layer == "grpc+verbs" and resolver.environment == "google"
    assert resolver.master() == "grpc+verbs://c:1"
    assert TFConfigClusterResolver(task_id=1).master() == "grpc://w1:1"
    resolver.task_type, resolver.task_id = "worker", 1
    assert resolver.master() == "grpc+verbs://w1:1"
    resolver.task_type = resolver.task_id = None  # back to TF_CONFIG's task
    assert (resolver.task_type, resolver.task_id) == ("worker", 0)


def test_tf_config_is_read_every_time(tf_config):
    tf_config({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}})
    resolver = TFConfigClusterResolver()
    assert resolver.master() == "a:1"
    tf_config({"cluster": {"worker": ["x:1", "y:1", "z:1"]},
               "task": {"type": "worker", "index": 2}})
    assert resolver.cluster_spec().num_tasks("worker") == 3
    assert (resolver.task_id, resolver.master()) == (2, "z:1")
    tf_config('{"cluster": [}')  # broken after construction: the next use says so
    with pytest.raises(ValueError, match="TF_CONFIG is not valid JSON"):
        resolver.cluster_spec()


def test_an_evaluator_may_be_outside_the_cluster(tf_config):
    tf_config({"cluster": {"chief": ["c:1"], "worker": ["w:1"]},
               "task": {"type": "evaluator", "index": 0}})
    resolver = TFConfigClusterResolver()
    assert (resolver.task_type, resolver.task_id) == ("evaluator", 0)
    assert resolver.master("chief", 0) == "c:1"


def test_master_without_a_task(tf_config):
    tf_config({"cluster": {"worker": ["a:1", "b:1"]}})
    resolver = TFConfigClusterResolver()
    assert resolver.task_type is None and resolver.task_id is None
    assert resolver.master("worker", 1) == "b:1"
    with pytest.raises(ValueError, match="no task to give the address of: TF_CONFIG has no "
                                         "'task' and none was given; pass `task_type`"):
        resolver.master()


GOOD_CLUSTER = {"worker": ["host1:2222", "host2:2222"]}


@pytest.mark.parametrize("config,match", [
    ('{"cluster": {"worker": ["a:1"]', r"TF_CONFIG is not valid JSON \(Expecting ',' delimiter: "
                                        r"line 1 column 31\): '\{\"cluster\".*expected an object"),
    ("worker", r"TF_CONFIG is not valid JSON \(Expecting value: line 1 column 1\): 'worker'"),
    ('["a:1"]', r"TF_CONFIG must be a JSON object like \{.*\}, got a JSON array: '\[\"a:1\"\]'"),
    ({"cluster": ["host1:2222"]},
     r"TF_CONFIG\['cluster'\] must be an object mapping job names to lists of 'host:port' "
     r"strings.*got a JSON array: '\[\"host1:2222\"\]'"),
    ({"cluster": {"worker": "host1:2222"}},
     r"TF_CONFIG\['cluster'\]: job 'worker' must be a list of 'host:port' strings .* got str "
     r"'host1:2222'"),
    ({"cluster": {"worker": ["host1:2222", "host2"]}},
     r"TF_CONFIG\['cluster'\]: job 'worker' task 1: address 'host2' has no port; "
     r"expected 'host:port'"),
    ({"cluster": {"worker": ["host1:2222", 2222]}},
     r"TF_CONFIG\['cluster'\]: job 'worker' task 1: address 2222 is a int, not a string"),
    ({"cluster": GOOD_CLUSTER, "task": "worker"},
     r"TF_CONFIG\['task'\] must be an object like \{\"type\": \"worker\", \"index\": 0\}, "
     r"got a JSON string: 'worker'"),
    ({"cluster": GOOD_CLUSTER, "task": {"type": "worker"}},
     r"TF_CONFIG\['task'\] has no 'index': '\{\"type\": \"worker\"\}'; expected an object"),
    ({"cluster": GOOD_CLUSTER, "task": {}}, r"TF_CONFIG\['task'\] has no 'type' or 'index'"),
    ({"cluster": GOOD_CLUSTER, "task": {"type": 0, "index": 0}},
     r"TF_CONFIG\['task'\]\['type'\] must be a job name such as 'worker', got '0'"),
    ({"cluster": GOOD_CLUSTER, "task": {"type": "worker", "index": 1.5}},
     r"TF_CONFIG\['task'\]\['index'\] must be an integer >= 0, got '1.5'"),
    ({"cluster": GOOD_CLUSTER, "task": {"type": "worker", "index": True}},
     r"TF_CONFIG\['task'\]\['index'\] must be an integer >= 0, got 'true'"),
    ({"cluster": GOOD_CLUSTER, "task": {"type": "worker", "index": -1}},
     r"TF_CONFIG\['task'\]\['index'\] must be an integer >= 0, got '-1'"),
    ({"cluster": GOOD_CLUSTER, "task": {"type": "wroker", "index": 0}},
     r"TF_CONFIG: task type 'wroker' is not a job of the cluster in TF_CONFIG; its jobs are "
     r"\['worker'\]"),
    ({"cluster": GOOD_CLUSTER, "task": {"type": "worker", "index": 3}},
     r"TF_CONFIG: task index 3 is outside the cluster: job 'worker' has 2 tasks \(indices 0-1\)"),
    ({"cluster": {"worker": {"0": "a:1", "2": "b:1"}}, "task": {"type": "worker", "index": 1}},
     r"TF_CONFIG: task index 1 is outside the cluster: job 'worker' has 2 tasks "
     r"\(indices 0, 2\)"),
    ({"cluster": GOOD_CLUSTER, "rpc_layer": 1},
     r"TF_CONFIG\['rpc_layer'\] must be a string, got '1'"),
])
def test_malformed_tf_config_fails_at_construction(tf_config, config, match):
    tf_config(config)
    with pytest.raises(ValueError, match="^TFConfigClusterResolver: " + match):
        TFConfigClusterResolver()


def test_tf_config_overrides_are_checked(tf_config):
    tf_config({"cluster": GOOD_CLUSTER, "task": {"type": "worker", "index": 0}})
    with pytest.raises(ValueError, match="the task given to it: task index 5 is outside the "
                                         r"cluster: job 'worker' has 2 tasks \(indices 0-1\)"):
        TFConfigClusterResolver(task_id=5)
    with pytest.raises(ValueError, match="task type 'ps' is not a job of the cluster"):
        TFConfigClusterResolver(task_type="ps")
    with pytest.raises(TypeError, match="`task_id` must be an integer >= 0, got str '1'"):
        TFConfigClusterResolver(task_id="1")
    with pytest.raises(TypeError, match="`rpc_layer` must be a string, got int 1"):
        TFConfigClusterResolver(rpc_layer=1)
    resolver = TFConfigClusterResolver()
    with pytest.raises(TypeError, match="`task_id` must be an integer >= 0, got float 1.0"):
        resolver.task_id = 1.0


# --- SlurmClusterResolver ------------------------------------------------------------------

def _fake_nvidia_smi(directory, gpus: int) -> None:
    """An ``nvidia-smi`` in ``directory`` whose ``--list-gpus`` lists ``gpus`` GPUs."""
    script = directory / "nvidia-smi"
    lines = "".join(f"GPU {i}: Fake GPU (UUID: GPU-{i})\\n" for i in range(gpus))
    script.write_text(f"#!/bin/sh\nprintf '{lines}'\n")
    script.chmod(0o755)


@pytest.fixture
def slurm_env(monkeypatch, tmp_path):
    """A clean environment (no Slurm variables, no CUDA_VISIBLE_DEVICES, an ``nvidia-smi``
    listing no GPU first on PATH); returns a function that sets the given variables."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "SLURMD_")):
            monkeypatch.delenv(name)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    (tmp_path / "bin").mkdir()
    _fake_nvidia_smi(tmp_path / "bin", 0)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    slurm.forget_chosen_gpus()

    def set_env(**variables):
        for name, value in variables.items():
            monkeypatch.setenv(name, str(value))

    yield set_env
    slurm.forget_chosen_gpus()


def test_slurm_single_node(slurm_env):
    slurm_env(SLURM_PROCID=0, SLURM_NTASKS=1, SLURM_JOB_NODELIST="localhost",
              SLURM_TASKS_PER_NODE=1)
    resolver = SlurmClusterResolver()
    assert resolver.cluster_spec() == ClusterSpec({"worker": ["localhost:8888"]})
    assert resolver.get_task_info() == ("worker", 0)
    assert resolver.master() == "grpc://localhost:8888"
    assert resolver.num_accelerators() == {} and resolver.environment == ""
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # no GPUs asked for: left alone


def test_slurm_several_nodes_compressed_and_zero_padded(slurm_env):
    slurm_env(SLURM_PROCID=4, SLURM_STEP_NUM_TASKS=5, SLURM_STEP_NODELIST="node[08-10]",
              SLURM_STEP_TASKS_PER_NODE="2(x2),1", SLURM_LOCALID=0, SLURMD_NODENAME="node10",
              SLURM_JOB_NODELIST="ignored[1-9]")
    resolver = SlurmClusterResolver(port_base=2222)
    assert resolver.cluster_spec().as_dict() == {"worker": [
        "node08:2222", "node08:2223", "node09:2222", "node09:2223", "node10:2222"]}
    assert (resolver.task_type, resolver.task_id) == ("worker", 4)
    assert resolver.master() == "grpc://node10:2222"
    assert resolver.master("worker", 1, rpc_layer="grpc+verbs") == "grpc+verbs://node08:2223"


def test_slurm_custom_jobs_are_given_ranks_in_name_order(slurm_env):
    slurm_env(SLURM_PROCID=2, SLURM_NTASKS=4, SLURM_STEP_NODELIST="n[1-2]",
              SLURM_STEP_TASKS_PER_NODE="2(x2)")
    for jobs in ({"ps": 1, "worker": 3}, {"worker": 3, "ps": 1}):
        resolver = SlurmClusterResolver(jobs=jobs, rpc_layer=None)
        assert resolver.cluster_spec().as_dict() == {
            "ps": ["n1:8888"], "worker": ["n1:8889", "n2:8888", "n2:8889"]}
        assert (resolver.task_type, resolver.task_id) == ("worker", 1)
        assert resolver.master() == "n2:8888"
        assert resolver.master("ps", 0) == "n1:8888"


def test_slurm_tasks_per_node_given(slurm_env):
    slurm_env(SLURM_PROCID=3, SLURM_NTASKS=4, SLURM_STEP_NODELIST="a,b")
    assert SlurmClusterResolver(tasks_per_node=2).cluster_spec().as_dict() == {
        "worker": ["a:8888", "a:8889", "b:8888", "b:8889"]}
    resolver = SlurmClusterResolver(tasks_per_node={"x": 3, "y": 1})  # hosts from the dict
    assert resolver.cluster_spec().job_tasks("worker") == ["x:8888", "x:8889", "x:8890", "y:8888"]
    assert resolver.master() == "grpc://y:8888"


def test_slurm_gpus_are_split_among_a_nodes_tasks(slurm_env):
    slurm_env(SLURM_PROCID=1, SLURM_NTASKS=2, SLURM_STEP_NODELIST="g1",
              SLURM_STEP_TASKS_PER_NODE=2)
    resolver = SlurmClusterResolver(gpus_per_node=4)
    assert resolver.num_accelerators() == {"GPU": 2}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    # A second resolver in the same process splits the node's GPUs again, not task 1's share.
    assert SlurmClusterResolver(gpus_per_node=4).num_accelerators() == {"GPU": 2}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_slurm_gpus_from_the_environment(slurm_env, monkeypatch, tmp_path):
    slurm_env(SLURM_PROCID=1, SLURM_NTASKS=2, SLURM_STEP_NODELIST="g1",
              SLURM_STEP_TASKS_PER_NODE=2, CUDA_VISIBLE_DEVICES="4,5,6,7")
    assert SlurmClusterResolver().num_accelerators() == {"GPU": 2}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert SlurmClusterResolver().num_accelerators() == {"GPU": 2}  # again: the same share
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"
    slurm.forget_chosen_gpus()  # now "6,7" reads as given: the node's 2 GPUs, 1 per task
    assert SlurmClusterResolver().num_accelerators() == {"GPU": 1}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "7"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    slurm_env(SLURM_GPUS_ON_NODE=2)
    assert SlurmClusterResolver(auto_set_gpu=False).num_accelerators() == {"GPU": 1}
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    _fake_nvidia_smi(tmp_path / "bin", 8)
    monkeypatch.delenv("SLURM_GPUS_ON_NODE")
    assert SlurmClusterResolver(gpus_per_task=1).num_accelerators() == {"GPU": 1}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert SlurmClusterResolver(gpus_per_node=4, gpus_per_task=0).num_accelerators() == {}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES='3' lists 1 GPUs, too few for "
                                           "task 1 on its node to get 1"):
        SlurmClusterResolver(gpus_per_node=2)
    assert SlurmClusterResolver(gpus_per_node=2, auto_set_gpu=False).num_accelerators() == {
        "GPU": 1}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"


def test_slurm_asking_for_more_gpus_than_a_node_has(slurm_env):
    slurm_env(SLURM_PROCID=0, SLURM_NTASKS=2, SLURM_STEP_NODELIST="g1",
              SLURM_STEP_TASKS_PER_NODE=2)
    with pytest.raises(RuntimeError, match=r"2 tasks on a node with gpus_per_task=2 need 4 GPUs "
                                           r"but a node has 2 \(gpus_per_node\)"):
        SlurmClusterResolver(gpus_per_node=2, gpus_per_task=2)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_slurm_missing_variables_say_not_under_slurm(slurm_env):
    with pytest.raises(RuntimeError, match="^SlurmClusterResolver: not running under Slurm: "
                                           "SLURM_PROCID is not set; start the processes "
                                           "with srun"):
        SlurmClusterResolver()
    slurm_env(SLURM_PROCID=0)
    with pytest.raises(RuntimeError, match="not running under Slurm: SLURM_STEP_NODELIST and "
                                           "SLURM_JOB_NODELIST are not set"):
        SlurmClusterResolver()
    slurm_env(SLURM_STEP_NODELIST="n1")
    with pytest.raises(RuntimeError, match="SLURM_STEP_TASKS_PER_NODE is not set"):
        SlurmClusterResolver()


@pytest.mark.parametrize("variables,kwargs,error,match", [
    ({}, {"jobs": {"ps": 1, "worker": 4}}, RuntimeError,
     r"`jobs` \{'ps': 1, 'worker': 4\} ask for 5 tasks but the Slurm step has 4 "
     r"\(SLURM_NTASKS=4\); ask for exactly 4"),
    ({}, {"jobs": {"worker": 3}}, RuntimeError,
     r"`jobs` \{'worker': 3\} ask for 3 tasks but the Slurm step has 4"),
    ({}, {"jobs": ["worker"]}, TypeError, r"`jobs` must be a dict \{job name: number of tasks\}"),
    ({}, {"jobs": {"worker": "4"}}, TypeError, r"`jobs\['worker'\]` must be an integer >= 0"),
    ({"SLURM_NTASKS": 5}, {}, RuntimeError,
     r"SLURM_NTASKS=5 but SLURM_STEP_TASKS_PER_NODE='2\(x2\)' place 4 tasks"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3)"}, {}, RuntimeError,
     r"SLURM_STEP_TASKS_PER_NODE='2\(x3\)' counts tasks on 3 nodes but "
     r"SLURM_STEP_NODELIST='n\[1-2\]' has 2"),
    ({"SLURM_STEP_NODELIST": "n[2-1]"}, {}, ValueError,
     r"SLURM_STEP_NODELIST: 'n\[2-1\]' is not a Slurm hostlist \(the range '2-1' in 'n\[2-1\]' "
     r"runs backwards\)"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2x2"}, {}, ValueError,
     r"SLURM_STEP_TASKS_PER_NODE: '2x2' is not a Slurm tasks-per-node list"),
    ({"SLURM_PROCID": "one"}, {}, ValueError, r"SLURM_PROCID='one' is not an integer >= 0"),
    ({"SLURM_PROCID": 4}, {}, RuntimeError, r"SLURM_PROCID=4 but the step has only 4 tasks"),
    ({"SLURM_LOCALID": 1}, {}, RuntimeError,
     r"rank 2 should be task 0 on n2 under Slurm's block distribution, but Slurm says "
     r"SLURM_LOCALID=1; run with --distribution=block"),
    ({"SLURMD_NODENAME": "n1"}, {}, RuntimeError,
     "rank 2 should be task 0 on n2 .* but Slurm says SLURMD_NODENAME=n1"),
    ({}, {"port_base": 65535}, ValueError, "`port_base` 65535 \\+ 2 tasks on a node runs past"),
    ({}, {"tasks_per_node": 0}, ValueError, "`tasks_per_node` must be an integer >= 1, got int 0"),
])
def test_slurm_inconsistent_environments_and_arguments(slurm_env, variables, kwargs, error, match):
    slurm_env(**{"SLURM_PROCID": 2, "SLURM_NTASKS": 4, "SLURM_STEP_NODELIST": "n[1-2]",
                 "SLURM_STEP_TASKS_PER_NODE": "2(x2)", **variables})
    with pytest.raises(error, match="^SlurmClusterResolver: " + match):
        SlurmClusterResolver(**kwargs)


def test_expand_hostlist():
    assert expand_hostlist("node[01-03,07],gpu5") == ["node01", "node02", "node03", "node07",
                                                      "gpu5"]
    assert expand_hostlist("a[1-2],b[9-11],c") == ["a1", "a2", "b9", "b10", "b11", "c"]
    assert expand_hostlist("n[098-100]") == ["n098", "n099", "n100"]
    assert expand_hostlist("rack[1-2]-ib") == ["rack1-ib", "rack2-ib"]
    assert expand_hostlist("solo") == ["solo"]
    assert expand_hostlist("10.0.0.1,10.0.0.2") == ["10.0.0.1", "10.0.0.2"]
    for bad, why in [("", "it is empty"), ("a,,b", "it has an empty name"),
                     ("n[1-2", "a '\\[' is not closed"), ("n[[1]]", "its brackets do not pair up"),
                     ("a[1-2]b[3-4]",
                      "'a\\[1-2\\]b\\[3-4\\]' is not a name with at most one bracket group"),
                     ("n[1-x]", "'1-x' in 'n\\[1-x\\]' is not a number or a range")]:
        with pytest.raises(ValueError, match=f"is not a Slurm hostlist \\({why}"):
            expand_hostlist(bad)


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    assert expand_tasks_per_node("1,3(x2)") == [1, 3, 3]
    with pytest.raises(ValueError, match=r"'2\(x\)' is not a Slurm tasks-per-node list"):
        expand_tasks_per_node("2(x)")
