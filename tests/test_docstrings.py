"""Every public name has a docstring, and every example in them runs and prints what it says."""

import doctest
import importlib
import inspect
import pkgutil

import pytest

import jaxmirror

MODULES = sorted(m.name for m in pkgutil.walk_packages(jaxmirror.__path__, "jaxmirror."))


@pytest.mark.parametrize("name", ["jaxmirror"] + MODULES)
def test_examples_in_docstrings_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                             verbose=False)
    assert result.failed == 0, f"{result.failed} doctest(s) failed in {name}"


def _public_objects():
    for name in jaxmirror.__all__:
        obj = getattr(jaxmirror, name)
        yield name, obj
    for name in jaxmirror.experimental.__all__:
        yield f"experimental.{name}", getattr(jaxmirror.experimental, name)


@pytest.mark.parametrize("name,obj", list(_public_objects()))
def test_public_names_document_themselves_with_an_example(name, obj):
    if inspect.ismodule(obj):
        doc = obj.__doc__ or ""
    else:
        doc = inspect.getdoc(obj) or ""
    assert doc, f"{name} has no docstring"
    assert ">>>" in doc, f"{name}'s docstring has no runnable example"
    if inspect.isfunction(obj):
        assert "Returns:" in doc and ("Args:" in doc or not inspect.signature(obj).parameters), name
