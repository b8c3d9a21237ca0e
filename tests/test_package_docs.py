"""The package's own documentation matches its files: the subpackage docstrings, ARCHITECTURE.md
and one docstring format."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxmirror"
ARCHITECTURE = ROOT / "ARCHITECTURE.md"
# The layers as tests/test_architecture.py enforces them, read without importing jaxmirror.
LAYERS = next(ast.literal_eval(node.value)
              for node in ast.parse((ROOT / "tests" / "test_architecture.py").read_text()).body
              if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "LAYERS")
SECTIONS = ("Args:", "Returns:", "Yields:", "Raises:", "Example:", "Examples:", "Attributes:",
            "Modules:", "Note:")


def _relative(path: pathlib.Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def _listed_modules(docstring: str) -> list[str]:
    """The names of a docstring's ``Modules:`` section, one ````name````: line each."""
    lines = docstring.splitlines()
    start = lines.index("Modules:") + 1
    names = []
    for line in lines[start:]:
        if not line.strip() or not line.startswith(" "):
            break
        match = re.fullmatch(r" {4}``(\w+)``: \S.*", line)
        assert match, f"not a one-line ``name``: entry: {line!r}"
        names.append(match.group(1))
    return names


def test_each_subpackage_docstring_lists_exactly_its_modules():
    wrong = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        folder = init.parent
        if folder == PACKAGE:
            continue
        docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
        if "Modules:" not in docstring.splitlines():
            wrong.append(f"{_relative(init)}: no `Modules:` section")
            continue
        listed = _listed_modules(docstring)
        on_disk = {p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")}
        on_disk |= {p.parent.name for p in folder.glob("*/__init__.py")}
        wrong += [f"{_relative(init)}: {name} is not listed"
                  for name in sorted(on_disk - set(listed))]
        wrong += [f"{_relative(init)}: lists {name}, which is not a module of it"
                  for name in sorted(set(listed) - on_disk)]
        wrong += [f"{_relative(init)}: lists {name} twice"
                  for name in sorted({n for n in listed if listed.count(n) > 1})]
    assert not wrong, "\n".join(wrong)


def _layer_sections() -> list[tuple[set, str]]:
    """ARCHITECTURE.md's ``### Layer N: ...`` headings, in order: (names, the section's text)."""
    text = ARCHITECTURE.read_text()
    heads = list(re.finditer(r"^### Layer (\d+): (.*)$", text, re.MULTILINE))
    sections = []
    for i, head in enumerate(heads):
        end = text.find("\n## ", head.end())
        end = min(heads[i + 1].start() if i + 1 < len(heads) else len(text),
                  end if end >= 0 else len(text))
        names = {n.rstrip("/").removesuffix(".py") for n in re.findall(r"`([^`]+)`", head[2])}
        assert int(head[1]) == i + 1, f"layer heading {head[0]!r} is out of sequence"
        sections.append((names, text[head.end():end]))
    return sections


def test_architecture_lists_the_layers_in_the_enforced_order():
    assert [names for names, _ in _layer_sections()] == LAYERS


def test_architecture_names_every_module_under_its_layer():
    on_disk = {_relative(p) for p in PACKAGE.rglob("*.py")
               if p.name != "__init__.py" or p.parent == PACKAGE}
    sections = _layer_sections()
    assert len(sections) == len(LAYERS), "ARCHITECTURE.md needs one `### Layer N:` per layer"
    wrong = []
    for (names, section), layer in zip(sections, LAYERS):
        here = {p for p in on_disk
                if pathlib.Path(p).parts[1].removesuffix(".py") in layer}
        named = set(re.findall(r"`(jaxmirror/[\w/]+\.py)`", section))
        wrong += [f"{p} is not named under layer {sorted(layer)}" for p in sorted(here - named)]
        wrong += [f"layer {sorted(layer)} names {p}, which is not a module of it"
                  for p in sorted(named - here)]
    assert not wrong, "\n".join(wrong)


def _docstrings():
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                docstring = ast.get_docstring(node)
                if docstring:
                    yield f"{_relative(path)}:{getattr(node, 'lineno', 1)}", docstring


def test_docstrings_use_one_format():
    # Google style as everywhere in the package: a section's body indented 4 spaces under its
    # title, and examples inside an ``Example:`` section.
    wrong = []
    for where, docstring in _docstrings():
        lines = docstring.splitlines()
        for i, line in enumerate(lines):
            if line in SECTIONS:
                body = next((b for b in lines[i + 1:] if b.strip()), "")
                if len(body) - len(body.lstrip()) != 4:
                    wrong.append(f"{where}: {line} body not indented 4 spaces: {body!r}")
            if line.startswith(">>>"):
                wrong.append(f"{where}: an example outside an `Example:` section")
    assert not wrong, "\n".join(sorted(set(wrong)))
