"""Every notebook in notebooks/ runs top to bottom without an error (its asserts included)."""

import pathlib

import nbclient
import nbformat
import pytest

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def test_there_is_a_notebook():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    # The kernel is a fresh process that inherits this process's environment, XLA_FLAGS with 8
    # host devices included (conftest.py). The notebooks call configure_cpu_devices(8) first,
    # which sets jax_num_cpu_devices=8 before JAX starts: that agrees with XLA_FLAGS here, and
    # would win over a different count there, so the kernel always gets 8 CPU devices.
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=600,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    client.execute()  # raises CellExecutionError, naming the cell, on any error
    errors = [out for cell in nb.cells if cell.cell_type == "code"
              for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert not errors, errors
