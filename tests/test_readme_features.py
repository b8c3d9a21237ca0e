"""The README's feature table matches what the tests cover, row by row.

The table lives in ``README.md`` between ``<!-- features:start -->`` and
``<!-- features:end -->``; ``docs/features.md`` includes that region (MyST ``include``), so the
two cannot diverge. Pure parsing (and ``getattr`` on jaxmirror): no JAX work.

Each table row is ``| TF | jaxmirror | status | tests |``. The status starts with "supported",
"differs" or "not yet". A supported or differing row names 1 to 3 tests as
``tests/FILE.py::NAME`` (a function at module level or a method of a class in that file; no
parametrized ids), or says ``**untested**`` where it is a known gap listed in ``KNOWN_UNTESTED``
below. A "not yet" row names none (``—``), and the TF names it lists are absent from jaxmirror
(``ABSENT`` below says where each would be).
"""

import ast
import functools
import re
from pathlib import Path

import jaxmirror
import jaxmirror.experimental.coordinator as coordinator
import jaxmirror.planned

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FEATURES_PAGE = ROOT / "docs" / "features.md"
START, END = "<!-- features:start -->", "<!-- features:end -->"
HEADER = ["TF", "jaxmirror", "status", "tests"]
STATUSES = ("supported", "differs", "not yet")
NONE, UNTESTED = "—", "**untested**"

REF = re.compile(r"`tests/(\w+\.py)::([^`]*)`")  # `tests/test_x.py::test_name`
TEST_FILE = re.compile(r"(?<![\w/])(?:tests/)?(test_\w+\.py)\b")  # a test file named anywhere
REPO_PATH = re.compile(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|md|ipynb))`")  # `docs/porting.md`, ...

# Supported or differing rows that no test checks yet, by their TF cell. A gap closed (a test
# named in the row) must leave this set too.
KNOWN_UNTESTED = {
    "`ReplicaContext.devices`",
    "`experimental.CommunicationImplementation` `AUTO`, `RING`, `NCCL`",
}

# Each "not yet" row, by the first code span of its TF cell: where jaxmirror would have the names.
ABSENT = {
    "TPUStrategy.experimental_split_to_logical_devices": [
        (jaxmirror.TPUStrategy, "experimental_split_to_logical_devices"),
        (jaxmirror.TPUStrategy, "experimental_assign_to_logical_device"),
        (jaxmirror.TPUStrategy, "experimental_replicate_to_logical_devices")],
    "tf.keras": [(jaxmirror, "keras")],
    "experimental_run_v2": [(jaxmirror.Strategy, "experimental_run_v2")],
    "DistributedDataset.reduce": [(jaxmirror.DistributedDataset, "reduce"),
                                  (jaxmirror.Strategy, "experimental_make_numpy_dataset")],
    "StrategyExtended.read_var": [(jaxmirror.StrategyExtended, "read_var"),
                                  (jaxmirror.StrategyExtended, "non_slot_devices"),
                                  (jaxmirror.StrategyExtended, "update_non_slot")],
    "tf.nn.scale_regularization_loss": [(jaxmirror, "scale_regularization_loss")],
    "AUC": [(jaxmirror.metrics, "AUC"), (jaxmirror.metrics, "Precision"),
            (jaxmirror.metrics, "Recall")],
    "experimental.CollectiveHints": [(jaxmirror.experimental, "CollectiveHints")],
    "TPUClusterResolver": [(jaxmirror.cluster_resolver, "TPUClusterResolver"),
                           (jaxmirror.cluster_resolver, "GCEClusterResolver"),
                           (jaxmirror.cluster_resolver, "KubernetesClusterResolver"),
                           (jaxmirror.cluster_resolver, "UnionResolver")],
    "coordinator.experimental_get_current_worker_index": [
        (coordinator, "experimental_get_current_worker_index"),
        (coordinator.ClusterCoordinator, "experimental_get_current_worker_index")],
    "SavedModel export": [(jaxmirror, "saved_model"), (jaxmirror.checkpoint, "saved_model")],
}


def _region() -> str:
    text = README.read_text()
    lines = text.splitlines()
    assert lines.count(START) == 1 and text.count(START) == 1, f"{START} once, on its own line"
    assert lines.count(END) == 1 and text.count(END) == 1, f"{END} once, on its own line"
    start, end = lines.index(START), lines.index(END)
    assert start < end
    return "\n".join(lines[start + 1:end])


def _cells(line: str) -> list:
    """A table line's cells: split at ``|`` outside code spans (and not escaped)."""
    cells, cell, in_code, i = [], "", False, 0
    body = line.strip()
    assert body.startswith("|") and body.endswith("|"), line
    body = body[1:-1]
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body):
            cell += body[i:i + 2]
            i += 2
            continue
        if ch == "`":
            in_code = not in_code
        if ch == "|" and not in_code:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += ch
        i += 1
    cells.append(cell.strip())
    return cells


def _tables(region: str) -> list:
    """Every table of the region: a list of (section heading, [rows of cells])."""
    tables, heading, current = [], None, None
    for line in region.splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.lstrip().startswith("|"):
            if current is None:
                current = (heading, [])
                tables.append(current)
            current[1].append(_cells(line))
        else:
            current = None
    return tables


def _rows() -> list:
    rows = []
    for heading, table in _tables(_region()):
        assert table[0] == HEADER, f"{heading}: header {table[0]}"
        assert all(set(c) <= set("-: ") for c in table[1]), f"{heading}: separator {table[1]}"
        for row in table[2:]:
            assert len(row) == 4, f"{heading}: a row of {len(row)} cells: {row}"
            rows.append((heading, row))
    return rows


@functools.lru_cache(maxsize=None)
def _test_names(path: Path) -> frozenset:
    """Functions at module level and methods of module-level classes."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.update(n.name for n in node.body
                         if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return frozenset(names)


def _status(row) -> str:
    return next(s for s in STATUSES if row[2].startswith(s))


def test_the_region_has_tables_of_four_columns_with_known_statuses():
    rows = _rows()
    assert len(rows) > 50
    sections = {heading for heading, _ in rows}
    assert {"Strategies", "Variables", "Multi-worker", "Checkpoints"} <= sections
    bad = [(h, row) for h, row in rows if len(row) != 4 or not row[2].startswith(STATUSES)]
    assert bad == []


def test_every_row_names_tests_as_its_status_asks():
    problems, untested = [], set()
    for heading, (tf, _, status, tests) in _rows():
        where = f"{heading}: {tf}"
        if status.startswith("not yet"):
            if tests != NONE:
                problems.append(f"{where}: a 'not yet' row names no test, has {tests!r}")
            continue
        if tests == UNTESTED:
            untested.add(tf)
            continue
        refs = REF.findall(tests)
        rebuilt = ", ".join(f"`tests/{f}::{n}`" for f, n in refs)
        if not 1 <= len(refs) <= 3 or rebuilt != tests:
            problems.append(f"{where}: the tests cell must be 1 to 3 `tests/FILE.py::NAME`, "
                            f"comma-separated; got {tests!r}")
    assert problems == []
    assert untested == KNOWN_UNTESTED, (
        "rows marked **untested** differ from KNOWN_UNTESTED (name a test, or list the gap)")


def test_every_test_named_exists():
    missing = []
    for file, name in REF.findall(_region()):
        path = ROOT / "tests" / file
        if not re.fullmatch(r"test_\w+\.py", file) or not path.is_file():
            missing.append(f"tests/{file} (no such test file)")
        elif not re.fullmatch(r"\w+", name):
            missing.append(f"tests/{file}::{name} (name a function, not a parametrized id)")
        elif name not in _test_names(path):
            missing.append(f"tests/{file}::{name} (no such function or method)")
    assert missing == []


def test_every_file_named_exists():
    region = _region()
    files = set(TEST_FILE.findall(region))
    assert files, "the table names test files"
    missing = sorted(f for f in files if not (ROOT / "tests" / f).is_file())
    paths = set(REPO_PATH.findall(region)) - {f"tests/{f}" for f in files}
    missing += sorted(p for p in paths if not (ROOT / p).is_file())
    assert missing == []


def test_not_yet_names_are_absent():
    problems, seen = [], set()
    for heading, (tf, _, status, _) in _rows():
        if not status.startswith("not yet"):
            continue
        spans = re.findall(r"`([^`]+)`", tf)
        key = spans[0] if spans else tf
        if key not in ABSENT:
            problems.append(f"{heading}: {tf}: say in ABSENT where its names would be")
            continue
        seen.add(key)
        for owner, name in ABSENT[key]:
            try:
                getattr(owner, name)
            except AttributeError:
                continue
            problems.append(f"{tf}: {getattr(owner, '__name__', owner)}.{name} exists; the row "
                            f"says 'not yet'")
    assert problems == []
    assert seen == set(ABSENT), f"ABSENT lists rows the table no longer has: {set(ABSENT) - seen}"


def test_the_planned_list_is_as_the_table_says():
    if "that list is empty now" in _region():
        assert jaxmirror.planned.PLANNED == {}


def test_the_docs_page_includes_the_region_and_holds_no_table_of_its_own():
    page = FEATURES_PAGE.read_text()
    include = (f"```{{include}} ../README.md\n:start-after: {START}\n:end-before: {END}\n```")
    assert include in page
    assert not any(line.lstrip().startswith("|") for line in page.splitlines())
