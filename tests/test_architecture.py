"""The package's shape: the public API, its layers, and the internals they name (ARCHITECTURE.md)."""

import ast
import functools
import gc
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmirror as jm
from conftest import strategy
from jaxmirror.step.program import cache_of

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


@functools.cache
def _modules() -> tuple:
    """(dotted name under jaxmirror, parsed tree) of every module, parsed once per session."""
    return tuple((".".join(path.relative_to(PACKAGE).with_suffix("").parts),
                  ast.parse(path.read_text())) for path in sorted(PACKAGE.rglob("*.py")))


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


# step/ folded by stage (issue 30): a module per stage, the jaxpr analyses in one folder.
STEP_MODULES = {
    "step", "step.program", "step.call_plan", "step.compiled", "step.arguments", "step.graphs",
    "step.cross_replica", "step.fused", "step.replica_context", "step.losses", "step.analysis",
    "step.analysis.jaxpr_walk", "step.analysis.replication", "step.analysis.rows",
    "step.analysis.divergence", "step.analysis.masked_stats", "step.analysis.padding_check"}


def test_step_is_folded_by_stage_with_the_analyses_in_one_layer_step_folder():
    step = {m.removesuffix(".__init__") for m, _ in _modules() if m.split(".")[0] == "step"}
    assert step == STEP_MODULES, (sorted(step - STEP_MODULES), sorted(STEP_MODULES - step))
    assert {_layer(m) for m in step} == {LAYERS.index({"step"})}


# A module owns a stage end to end (the program and its cache, the compiled side, a call
# plan...): what one stage needs, not a line count, sets its size; this is the ceiling.
MAX_MODULE_LINES = 800


def test_modules_stay_small():
    sizes = {m: len((PACKAGE / pathlib.Path(*m.split("."))).with_suffix(".py").read_text()
                    .splitlines()) for m, _ in _modules()}
    assert max(sizes.values()) <= MAX_MODULE_LINES, {
        m: n for m, n in sizes.items() if n > MAX_MODULE_LINES}


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
    assert cache_of(s).programs() == [first.program]


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
    from jaxmirror.step.analysis import replication, rows
    from jaxmirror.step.analysis.jaxpr_walk import Analysis

    assert all(isinstance(p, jax.extend.core.Primitive) for p in rows.ANALYSIS.rules)
    assert all(isinstance(p, jax.extend.core.Primitive) for p in replication.ANALYSIS.rules)
    assert jax.lax.copy_p in rows.ANALYSIS.rules
    with pytest.raises(TypeError, match="not a JAX primitive"):
        Analysis(constant=None, unknown=lambda eqn, ins: ins).register("copy_p")


# ``self``/``cls`` (and a method's first parameter) name the object a method belongs to.
SELF = {"self", "cls"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _owned(tree) -> set:
    """The private attributes a module's own classes own: set on ``self``/``cls`` (by
    assignment or ``setattr``), declared in ``__slots__``, or assigned in a class body."""
    owned = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id in SELF):
            owned.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "setattr" and len(node.args) > 1
              and isinstance(node.args[0], ast.Name) and node.args[0].id in SELF
              and isinstance(node.args[1], ast.Constant)):
            owned.add(node.args[1].value)
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                value = getattr(stmt, "value", None)
                for target in getattr(stmt, "targets", [getattr(stmt, "target", None)]):
                    if not isinstance(target, ast.Name):
                        continue
                    owned.add(target.id)
                    if target.id == "__slots__" and value is not None:
                        slots = ast.literal_eval(value)
                        owned.update([slots] if isinstance(slots, str) else slots)
    return owned


def _attribute_writes(node):
    """(line, object node, attribute) for each attribute ``node`` writes or deletes: ``x.a = ``,
    ``x.a += ``, ``del x.a``, ``x.a[k] = `` (into it), ``setattr(x, "a", v)``, ``delattr``,
    ``object.__setattr__(x, "a", v)``."""
    if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx,
                                                                      (ast.Store, ast.Del)):
        while isinstance(node, ast.Subscript):
            node = node.value
        if isinstance(node, ast.Attribute):
            yield node.lineno, node.value, node.attr
    elif isinstance(node, ast.Call):
        func, args = node.func, node.args
        if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and len(args) > 1:
            obj, name = args[0], args[1]
        elif (isinstance(func, ast.Attribute) and func.attr in ("__setattr__", "__delattr__")
              and isinstance(func.value, ast.Name) and func.value.id in ("object", "type")
              and len(args) > 1):
            obj, name = args[0], args[1]
        elif (isinstance(func, ast.Attribute) and func.attr in ("__setattr__", "__delattr__")
              and args):
            obj, name = func.value, args[0]
        else:
            return
        if isinstance(name, ast.Constant) and isinstance(name.value, str):
            yield node.lineno, obj, name.value


def _built_here(method) -> set:
    """Names a method binds to an object it builds without its constructor: ``X.__new__(...)``
    or a copy (``copy.copy(self)``): a method may set the private attributes of those."""
    built = set()
    for node in ast.walk(method):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("__new__", "copy", "deepcopy"):
                built.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return built


def _its_own(obj, method) -> bool:
    """Whether ``obj`` (a node) is the object ``method`` belongs to, or one it is building."""
    if isinstance(obj, ast.Call) and getattr(obj.func, "id", None) == "super":
        return True
    if not isinstance(obj, ast.Name):
        return False
    if obj.id in SELF:
        return True
    if method is None:
        return False
    params = method.args.posonlyargs + method.args.args
    static = any(getattr(d, "id", None) == "staticmethod" for d in method.decorator_list)
    return (bool(params) and not static and obj.id == params[0].arg) or obj.id in _built_here(
        method)


def _private_writes(tree):
    """(line, what is written) for every write of a private attribute of another object than
    the writer's own: a method writes only its own object's (or one it builds with
    ``__new__``); a module's functions write only the attributes its own classes own."""
    owned = _owned(tree)

    def visit(node, method):
        for child in ast.iter_child_nodes(node):
            for line, obj, name in _attribute_writes(child):
                if _private(name) and not _its_own(obj, method) and (
                        method is not None or name not in owned):
                    yield line, f"{ast.unparse(obj)}.{name}", method is not None
            inner = (child if isinstance(node, ast.ClassDef)
                     and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else method)
            yield from visit(child, inner)

    yield from visit(tree, None)


def test_no_module_writes_another_objects_private_attributes():
    # A leading underscore is private to the module that owns the attribute (its classes set it
    # on self): another module asks the owning class (a method, a constructor argument). Even in
    # the owning module, a method changes only its own object, not another instance's fields.
    # core/_compat.py is exempt: writing JAX's internals is its job.
    wrong = [f"jaxmirror/{module.replace('.', '/')}.py:{line} writes {target}"
             + (" (a method writing another object's)" if in_method
                else " (an attribute this module's classes do not own)")
             for module, tree in _modules() if module != "core._compat"
             for line, target, in_method in _private_writes(tree)]
    if wrong:
        pytest.fail("private attributes written from outside their object; give the owning "
                    "class a method or a constructor argument:\n" + "\n".join(wrong),
                    pytrace=False)


def test_the_private_write_check_catches_every_form():
    source = """
import copy
class Box:
    __slots__ = ("_slot",)
    _declared = None
    def __init__(self, other):
        self._mine = 1
        setattr(self, "_set", 2)
        other._mine = 3                      # 9: another instance, even of this class
    def clone(self):
        new = object.__new__(type(self))
        new._mine = 4
        twin = copy.copy(self)
        twin._slot = 5
        return new
def module_function(box, var):
    box._mine += 1
    box._declared = box._slot = 6
    del var._value                           # 19
    var._value = 7                           # 20
    var._table[0] = 8                        # 21
    setattr(var, "_value", 9)                # 22
    object.__setattr__(var, "_value", 10)    # 23
    delattr(var, "_value")                   # 24
    var.public = var.__dict__ = 11
"""
    found = [(line, target) for line, target, _ in _private_writes(ast.parse(source))]
    assert sorted(found) == [(9, "other._mine"), (19, "var._value"), (20, "var._value"),
                             (21, "var._table"), (22, "var._value"), (23, "var._value"),
                             (24, "var._value")]


def test_the_package_never_walks_the_stack_with_sys_getframe():
    wrong = [f"jaxmirror/{module.replace('.', '/')}.py:{node.lineno}"
             for module, tree in _modules() for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr == "_getframe"
             or isinstance(node, ast.ImportFrom) and node.module == "sys"
             and any(a.name == "_getframe" for a in node.names)]
    if wrong:
        pytest.fail("sys._getframe used; use inspect.currentframe() or traceback.walk_stack:\n"
                    + "\n".join(wrong), pytrace=False)


# JAX's and flax's internals, and a primitive's parameters, are read in core/_compat.py only
# (issue 31): a JAX upgrade that moves one of them changes one accessor, which
# tests/test_jax_compat.py exercises.
_INTERNAL_MODULES = ("jax._src", "jax.interpreters", "jax.core", "flax.nnx.graphlib",
                     "flax.nnx.nn", "flax.nnx.variablelib", "jaxlib.")


def test_only_compat_reads_jax_and_flax_internals_and_primitive_parameters():
    wrong = []
    for module, tree in _modules():
        if module == "core._compat":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                names = []
            wrong += [f"{module}:{node.lineno} imports {n}" for n in names
                      if n.startswith(_INTERNAL_MODULES)]
            if isinstance(node, ast.Attribute) and (
                    node.attr == "params" and isinstance(node.value, ast.Name)
                    and node.value.id == "eqn"
                    or ast.unparse(node).startswith(("jax.core.", "jax.interpreters."))):
                wrong.append(f"{module}:{node.lineno} reads {ast.unparse(node)}")
    assert not wrong, "\n".join(sorted(set(wrong)))
