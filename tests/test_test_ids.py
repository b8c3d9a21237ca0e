"""Test ids are the same in every process, so pytest-xdist (`pytest -n auto`) can split the suite.

Each xdist worker collects the suite itself and the workers' lists must match; an id made from
an object's repr (its address), a set's order or an unseeded random value differs between them.
"""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ADDRESS = re.compile(r"0x[0-9a-fA-F]{5,}")


def collect(seeds):
    """The test ids of ``tests/``, collected once per hash seed in ``seeds``, all at once."""
    runs = []
    for seed in seeds:
        env = {k: v for k, v in os.environ.items()
               if k != "PYTEST_ADDOPTS" and not k.startswith("PYTEST_XDIST")}
        env["PYTHONHASHSEED"] = str(seed)
        runs.append(subprocess.Popen(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
             "tests"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True))
    lists = []
    for run in runs:
        try:
            out, _ = run.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            run.kill()
            out, _ = run.communicate()
            raise AssertionError(f"collection took over 240 s:\n{out[-3000:]}") from None
        assert run.returncode == 0, f"collection failed:\n{out[-3000:]}"
        lists.append([line for line in out.splitlines() if line.startswith("tests/")])
    return lists


def test_ids_are_the_same_in_every_process_and_name_no_address():
    first, second = collect([1, 2024])
    assert len(first) > 1000, first[-10:]  # the whole suite, not a few modules
    assert "tests/test_test_ids.py::" + \
        "test_ids_are_the_same_in_every_process_and_name_no_address" in first
    only_first = sorted(set(first) - set(second))
    only_second = sorted(set(second) - set(first))
    assert not only_first and not only_second, (
        f"ids differ between processes; give these parameters ids=:\n"
        f"first only: {only_first}\nsecond only: {only_second}")
    assert first == second, "the same ids, collected in another order"
    assert len(set(first)) == len(first), "an id is collected twice"
    with_address = [i for i in first if ADDRESS.search(i)]
    assert not with_address, f"ids that hold an object address; give them ids=: {with_address}"
    tmp = tempfile.gettempdir()
    with_tmp = [i for i in first if tmp + os.sep in i]
    assert not with_tmp, f"ids that hold a temporary path; give them ids=: {with_tmp}"
