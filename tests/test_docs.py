"""``make docs``: the Sphinx site builds offline and warning-free, and shows every public name.

The build runs in a subprocess with the network cut off: a ``sitecustomize`` on ``PYTHONPATH``
makes every socket connection to a non-loopback address, and every name lookup other than
``localhost``, raise, and the proxy variables point at a closed local port. An extension that
fetched anything (intersphinx, an image) would fail the ``-W`` build. The generated API pages
must hold an entry for every name of every public module's ``__all__`` (a name whose
docstring does not render, or that autodoc cannot import, is caught here), and no inline
literal left open (a run of text set as code up to the next double backquote). Every link to an
``#id`` of the site finds its target; a class shows the members it inherits from jaxmirror classes
(``MirroredStrategy``: ``run``, ``reduce``, ``scope``); the API reference is one page per public
module, ``jaxmirror`` first, and that page starts with the strategies (``CrossDeviceOps``'s
internals last). ``docs/check_pages.py`` checks the same pages in a browser (``make docs-check``).

The pages' runnable code (their ``python`` blocks and the ``jaxmirror`` halves of the porting
guide's pairs) is run too, page by page, on 8 simulated CPU devices; the parameter-server guide
is left out (it starts a Ray cluster; ``notebooks/06_parameter_server.ipynb`` runs the same).
"""

import importlib
import os
import re
import runpy
import subprocess
import sys
import types
from html import unescape
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BUILD_TIMEOUT = 300  # seconds; the build takes 10 to 20 s on a 2-core machine
CODE_TIMEOUT = 240

NO_NETWORK = '''
"""Installed by tests/test_docs.py: no network for this process, loopback only."""
import ipaddress
import socket

MESSAGE = "network disabled for the docs build"
_connect, _connect_ex, _getaddrinfo = (socket.socket.connect, socket.socket.connect_ex,
                                       socket.getaddrinfo)


def _local(address):
    if not isinstance(address, tuple):  # AF_UNIX paths and the like
        return True
    host = address[0]
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def connect(self, address):
    if not _local(address):
        raise OSError(f"{MESSAGE}: connect to {address!r}")
    return _connect(self, address)


def connect_ex(self, address):
    if not _local(address):
        raise OSError(f"{MESSAGE}: connect to {address!r}")
    return _connect_ex(self, address)


def getaddrinfo(host, *args, **kwargs):
    if host is not None and not _local((host.decode() if isinstance(host, bytes) else host,)):
        raise socket.gaierror(f"{MESSAGE}: lookup of {host!r}")
    return _getaddrinfo(host, *args, **kwargs)


socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = (connect, connect_ex,
                                                                       getaddrinfo)
'''


def _offline_env(tmp_path):
    guard = tmp_path / "no_network"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(NO_NETWORK)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(guard), str(ROOT)] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                 "all_proxy"):
        env[name] = "http://127.0.0.1:9"  # the discard port: nothing listens
    env.pop("NO_PROXY", None)
    env.pop("no_proxy", None)
    env["JAX_PLATFORMS"] = "cpu"
    env["TMPDIR"] = str(tmp_path)
    return env


def _public_modules():
    """``jaxmirror`` and every module reachable through the ``__all__`` lists: the list the
    docs extension builds its pages from (one rule, there)."""
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        return list(importlib.import_module("jaxmirror_api").public_modules())
    finally:
        sys.path.remove(str(DOCS / "_ext"))


def test_conf_uses_no_extension_that_needs_the_network():
    conf = runpy.run_path(str(DOCS / "conf.py"))
    assert not any("intersphinx" in ext for ext in conf["extensions"]), conf["extensions"]
    assert "intersphinx_mapping" not in conf
    assert conf["html_theme"] == "furo"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The site, built once for this module's tests: (the HTML folder, the build's output)."""
    tmp_path = tmp_path_factory.mktemp("docs")
    env = _offline_env(tmp_path)
    probe = subprocess.run(  # the guard is active in the build's interpreter
        [sys.executable, "-c",
         "import socket\ntry:\n socket.create_connection(('192.0.2.1', 80), timeout=5)\n"
         "except OSError as e:\n print(e)"],
        env=env, capture_output=True, text=True, timeout=60)
    assert "network disabled for the docs build" in probe.stdout, probe.stdout + probe.stderr
    html = tmp_path / "html"
    build = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q",
         "-d", str(tmp_path / "doctrees"), str(DOCS), str(html)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    assert build.returncode == 0, f"sphinx failed:\n{build.stdout}\n{build.stderr}"
    return html, build.stdout + build.stderr


def test_build_is_warning_free_and_has_every_page(built):
    html, output = built
    assert "WARNING" not in output and "ERROR" not in output, output
    pages = ["index", "quickstart", "porting", "features", "guides/nnx_linen",
             "guides/multi_worker", "guides/parameter_server", "guides/performance",
             "api/index"] + [f"api/{m}" for m in _public_modules()]
    missing = [p for p in pages if not (html / f"{p}.html").is_file()]
    assert missing == []


@pytest.mark.parametrize("modname", _public_modules())
def test_every_public_name_has_an_api_entry(built, modname):
    html, _ = built
    page = (html / "api" / f"{modname}.html").read_text()
    assert f'id="module-{modname}"' in page
    module = importlib.import_module(modname)
    missing = []
    for name in module.__all__:
        obj = getattr(module, name)
        if isinstance(obj, types.ModuleType):  # its own page, linked from here
            target = html / "api" / f"{obj.__name__}.html"
            if not target.is_file() or f'href="{obj.__name__}.html"' not in page:
                missing.append(name)
        elif f'id="{modname}.{name}"' not in page:
            missing.append(name)
    assert missing == [], f"{modname}: no API entry for {missing}"
    text = re.sub(r"<[^>]+>", "", page)
    assert "``" not in text, "an inline literal was left open in a docstring"


def _runnable_code(page: Path) -> str:
    """A page's ``python`` blocks and ``{code-block} python`` blocks captioned ``jaxmirror``."""
    blocks = []
    for fence, kind, body in re.findall(r"^(`{3,})(\{code-block\} python|python)\n(.*?)^\1[ \t]*$",
                                        page.read_text(), re.S | re.M):
        if kind.startswith("{code-block}"):
            options, _, body = body.partition("\n\n") if body.startswith(":") else ("", "", body)
            caption = re.search(r":caption: *(.*)", options)
            if caption and caption.group(1).strip() != "jaxmirror":
                continue  # TensorFlow's side of a pair, or a script shown whole
        blocks.append(body)
    return "\n\n".join(blocks)


@pytest.mark.parametrize("page", ["index", "quickstart", "porting", "guides/nnx_linen",
                                  "guides/multi_worker", "guides/performance"])
def test_the_pages_code_runs(tmp_path, page):
    code = _runnable_code(DOCS / f"{page}.md")
    assert "jaxmirror" in code
    script = tmp_path / "page.py"
    script.write_text(code)
    env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path))
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=CODE_TIMEOUT)
    assert run.returncode == 0, (f"{page}.md's code failed:\n{run.stdout[-3000:]}\n"
                                 f"{run.stderr[-5000:]}")


def broken_anchors(html: Path) -> list[str]:
    """Every ``href="#id"`` / ``href="page.html#id"`` of the site whose target id is missing."""
    ids = {page: set(re.findall(r'\bid="([^"]+)"', page.read_text()))
           for page in html.rglob("*.html")}
    broken = []
    for page in ids:
        for href in re.findall(r'href="([^"]*#[^"]*)"', page.read_text()):
            if re.match(r"[a-z]+:", href):  # http:, mailto:: outside the site
                continue
            target, _, fragment = unescape(href).partition("#")
            target = (page.parent / unquote(target)).resolve() if target else page
            if target not in ids or (fragment and unquote(fragment) not in ids[target]):
                broken.append(f"{page.relative_to(html)}: {href}")
    return broken


def test_every_link_to_an_anchor_finds_it(built):
    html, _ = built
    assert broken_anchors(html) == []


def entry_ids(page: Path, name: str) -> set[str]:
    """The ids of the members documented in the entry of ``name`` on ``page``."""
    prefix = re.escape(name + ".")
    return {m[len(name) + 1:] for m in re.findall(rf'id="({prefix}[\w.]+)"', page.read_text())}


@pytest.mark.parametrize("name, base, members", [
    ("MirroredStrategy", "Strategy", {"run", "reduce", "scope", "experimental_distribute_dataset",
                                      "num_replicas_in_sync", "extended"}),
    ("OneDeviceStrategy", "Strategy", {"run", "reduce", "scope", "gather"}),
    ("MirroredVariable", "Variable", {"assign", "assign_add", "read_value", "value"}),
    ("NcclAllReduce", "CrossDeviceOps", {"reduce", "batch_reduce", "broadcast"}),
])
def test_a_class_shows_what_it_inherits_and_links_its_base(built, name, base, members):
    html, _ = built
    page = html / "api" / "jaxmirror.html"
    assert members <= entry_ids(page, f"jaxmirror.{name}")
    assert entry_ids(page, f"jaxmirror.{name}") >= entry_ids(page, f"jaxmirror.{base}") & members
    text = page.read_text()
    entry = text[text.index(f'id="jaxmirror.{name}"'):]
    bases = re.search(r"<p>Bases: (.*?)</p>", entry[:entry.index("</dt>") + 2000], re.S)
    assert bases and f'href="#jaxmirror.{base}"' in bases.group(1), entry[:1500]


def test_the_api_reference_is_one_page_per_module_starting_with_the_strategies(built):
    html, _ = built
    index = (html / "api" / "index.html").read_text()
    index = index[index.index('id="api-reference"'):]  # the page's toctree, not the sidebar's
    order = re.findall(r'<li class="toctree-l1"><a class="reference internal" '
                       r'href="(jaxmirror[\w.]*)\.html"', index)
    assert order[:3] == ["jaxmirror", "jaxmirror.checkpoint", "jaxmirror.experimental"], order
    assert sorted(order) == sorted(_public_modules())
    page = (html / "api" / "jaxmirror.html").read_text()
    first = ["MirroredStrategy", "Strategy", "ReplicaContext", "PerReplica", "Mirrored",
             "Variable", "MirroredVariable", "DistributedDataset", "DistributedIterator",
             "CrossDeviceOps", "NcclAllReduce"]
    where = [page.index(f'id="jaxmirror.{name}"') for name in first]
    assert where == sorted(where), dict(zip(first, where))
    entries = re.findall(r'<dt class="sig sig-object py" id="jaxmirror\.(\w+)"', page)
    assert entries[0] == "MirroredStrategy", entries
    headings = re.findall(r"<h2>(.*?)<a", page)
    assert headings[:2] == ["Strategies", "Running a step: replica context and reduce"], headings
    assert headings[-1] == "Submodules", headings
    for modname in _public_modules()[1:]:  # the other modules: their own pages, not this one
        assert f'id="module-{modname}"' not in page


def test_long_words_in_table_cells_wrap(built):
    """The feature table's test names would otherwise make it 2 to 3 page widths wide, its last
    columns off the page (docs/check_pages.py measures it in a browser)."""
    html, _ = built
    features = (html / "features.html").read_text()
    assert 'href="_static/jaxmirror.css' in features
    rule = (html / "_static" / "jaxmirror.css").read_text()
    assert re.search(r"table\.docutils td[^{]*\{[^}]*overflow-wrap: anywhere", rule, re.S), rule
