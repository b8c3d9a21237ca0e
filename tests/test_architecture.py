"""The package's shape: the public API, its layers, and the internals they name (ARCHITECTURE.md)."""

import ast
import gc
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmirror as jm
from conftest import strategy

PACKAGE = pathlib.Path(jm.__file__).resolve().parent

PUBLIC = [
    "CrossDeviceOps", "DistributedDataset", "DistributedIterator", "DistributedValues",
    "HierarchicalCopyAllReduce", "InputContext", "InputOptions", "InputReplicationMode",
    "Mirrored", "MirroredStrategy", "MirroredVariable", "MultiWorkerMirroredStrategy",
    "NcclAllReduce", "OneDeviceStrategy", "PerReplica", "ReduceOp", "ReductionToOneDevice",
    "ReplicaContext", "RunOptions", "Server", "Strategy", "StrategyExtended",
    "SyncOnReadVariable", "TPUStrategy", "Variable", "VariableAggregation",
    "VariableSynchronization", "assign_values", "checkpoint", "cluster_resolver",
    "compute_average_loss", "configure_cpu_devices", "errors", "experimental",
    "experimental_set_strategy",
    "get_cross_replica_context", "get_replica_context", "get_strategy", "has_strategy",
    "in_cross_replica_context", "launch", "metrics", "nn", "read_values",
]
SUBPACKAGES = ["collectives", "coordinator", "core", "data", "planned", "runtime", "step",
               "strategies", "variables"]
# Each layer imports only its own layer and the ones before it.
LAYERS = [{"core"}, {"cluster_resolver"}, {"runtime"}, {"variables"}, {"step"},
          {"data", "collectives"}, {"coordinator"}, {"strategies"}, {"nn", "metrics"},
          {"checkpoint", "errors", "experimental", "launch", "planned", "__init__"}]


def test_public_names_are_pinned():
    assert sorted(jm.__all__) == sorted(PUBLIC)
    assert all(hasattr(jm, name) for name in PUBLIC)
    assert sorted(jm.experimental.__all__) == [
        "AutoShardPolicy", "CentralStorageStrategy", "CommunicationImplementation",
        "CommunicationOptions", "FileDataset", "MultiWorkerMirroredStrategy", "PaddedRowsWarning",
        "ParameterServerStrategy", "PreemptionCheckpointHandler", "ReplicaDivergenceWarning",
        "ShardedVariable", "TerminationConfig", "ValueContext", "check_replicas", "coordinator",
        "partitioners", "simulate_cpu_devices"]
    assert sorted(jm.cluster_resolver.__all__) == [
        "ClusterResolver", "ClusterSpec", "RayClusterResolver", "SimpleClusterResolver",
        "SlurmClusterResolver", "TFConfigClusterResolver", "parse_address"]
    assert sorted(jm.checkpoint.__all__) == ["CheckpointManager", "restore", "restore_into",
                                            "save", "to_saveable"]


def test_dir_shows_the_public_api_and_the_layers_only():
    shown = {n for n in dir(jm) if not n.startswith("__")}
    assert shown == set(PUBLIC) | set(SUBPACKAGES)


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        yield ".".join(rel.with_suffix("").parts), ast.parse(path.read_text())


def _layer(module: str) -> int:
    top = module.split(".")[0]
    return next(i for i, layer in enumerate(LAYERS) if top in layer)


def _imported(module: str, tree):
    """(line, imported jaxmirror module, at module level?) for every import of ``module``."""
    top_level = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert not node.level, f"{module}:{node.lineno}: a relative import"
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            if t.startswith("jaxmirror."):
                yield node.lineno, t[len("jaxmirror."):], id(node) in top_level


def test_imports_flow_one_way_and_only_at_module_level():
    subpackages = set(SUBPACKAGES) | {"checkpoint", "cluster_resolver", "experimental", "launch",
                                      "metrics", "nn"}
    wrong = []
    for module, tree in _modules():
        for line, target, at_top in _imported(module, tree):
            if target.split(".")[0] not in subpackages:
                continue  # a name imported from a module, e.g. jaxmirror.core.context.Entry
            if not at_top:
                wrong.append(f"{module}:{line} imports {target} inside a function")
            elif _layer(target) > _layer(module):
                wrong.append(f"{module}:{line} imports {target}, a higher layer")
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_another_modules_private_names():
    wrong = []
    for module, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxmirror"):
                wrong += [f"{module}:{node.lineno} imports {node.module}.{a.name}"
                          for a in node.names
                          if a.name.startswith("_") and a.name != "_compat"]
    assert not wrong, "\n".join(wrong)


def test_modules_stay_small():
    sizes = {m: len((PACKAGE / pathlib.Path(*m.split("."))).with_suffix(".py").read_text()
                    .splitlines()) for m, _ in _modules()}
    assert max(sizes.values()) <= 450, {m: n for m, n in sizes.items() if n > 450}


def test_program_cache_keeps_a_program_exactly_as_long_as_its_function():
    s = jm.MirroredStrategy(["CPU:0", "CPU:1"])

    def step():
        return jm.get_replica_context().all_reduce("sum", 1)

    first = s.function(step)
    for i in range(300):  # many new functions, dropped at once, `step` run in between
        s.function(lambda i=i: i)
        assert int(s.run(step)) == 2
        assert s.function(step).program is first.program
    assert first.trace_count == 1 and first.compile_count == 1
    gc.collect()
    assert s._programs.programs() == [first.program]


def test_one_device_strategy_makes_plain_variables_through_its_placement():
    s = jm.OneDeviceStrategy("CPU:1")
    assert s.extended.placement.distributed_variables is False
    assert jm.MirroredStrategy(["CPU:0"]).extended.placement.distributed_variables is True
    with s.scope():
        v = jm.Variable(1.0)
    assert type(v) is jm.Variable and v.distribute_strategy is s
    assert v.read_value().devices() == {jax.devices()[1]}


def test_rows_follow_a_copy_of_the_batch():
    # The rule tables are keyed by primitive objects: lax.copy_p keeps a padded batch's rows.
    s = strategy(2)
    batch = next(iter(s.experimental_distribute_dataset([np.arange(3.0)])))
    out = s.run(lambda x: jnp.array(x, copy=True) * 2, args=(batch,))
    assert [c.tolist() for c in s.experimental_local_results(out)] == [[0.0, 2.0], [4.0]]
    assert s.gather(out, axis=0).tolist() == [0.0, 2.0, 4.0]


def test_analysis_rules_are_keyed_by_primitive_objects():
    from jaxmirror.step import replication, rows
    from jaxmirror.step.jaxpr_walk import Analysis

    assert all(isinstance(p, jax.extend.core.Primitive) for p in rows.ANALYSIS.rules)
    assert all(isinstance(p, jax.extend.core.Primitive) for p in replication.ANALYSIS.rules)
    assert jax.lax.copy_p in rows.ANALYSIS.rules
    with pytest.raises(TypeError, match="not a JAX primitive"):
        Analysis(constant=None, unknown=lambda eqn, ins: ins).register("copy_p")
