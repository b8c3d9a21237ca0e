"""The API reference, generated from the public modules' ``__all__``.

``.. jaxmirror-api:: MODULE`` (in an ``{eval-rst}`` block of a page of ``docs/api/``: the
directives it generates are reStructuredText) renders MODULE's docstring and, for every
name of its ``__all__``, the autodoc directive that fits it (class, exception, function, public
submodule), so a name added to ``__all__`` appears without editing the docs. A name exported by
several public modules (``MultiWorkerMirroredStrategy`` is also ``experimental.``) is documented
once, where it is first reached from ``jaxmirror``; the other modules list it as an alias.

A long page can be cut into topics: ``:names: A, B`` renders only those names, in that order
(under the page's own ``##`` heading), and a last ``:rest:`` directive every name of ``__all__``
that no ``:names:`` of the page took, so a new name still appears. The module's docstring comes
with the page's first directive (``:names:`` with no names: the docstring alone).

A class shows every member it has, those it inherits from jaxmirror classes included
(``MirroredStrategy`` lists ``run``, ``reduce``, ``scope``), and names its bases by their public
names (``Bases: jaxmirror.Strategy``, a link).

Every public module (``jaxmirror`` and the modules reachable through ``__all__``) must have its
page ``docs/api/<module>.md``; a missing one is a build warning (an error under ``-W``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import types
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

ROOT = "jaxmirror"
logger = logging.getLogger(__name__)


@functools.cache  # the modules do not change during a build: walked once, not per page
def public_modules() -> tuple[str, ...]:
    """``jaxmirror`` and every module reachable through ``__all__``, breadth first."""
    order, i = [ROOT], 0
    while i < len(order):
        module = importlib.import_module(order[i])
        i += 1
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if (isinstance(obj, types.ModuleType) and obj.__name__.startswith(ROOT + ".")
                    and obj.__name__ not in order):
                order.append(obj.__name__)
    return tuple(order)


@functools.cache  # asked for by every page and every documented class
def canonical_names() -> dict[int, str]:
    """id(object) -> the public name under which it is documented (the first one reached);
    shared, so callers only read it."""
    names: dict[int, str] = {}
    for modname in public_modules():
        module = importlib.import_module(modname)
        for name in module.__all__:
            obj = getattr(module, name)
            if not isinstance(obj, types.ModuleType):
                names.setdefault(id(obj), f"{modname}.{name}")
    return names


def page_of(modname: str) -> str:
    return f"api/{modname}"


def _summary(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.strip().split("\n\n")[0].replace("\n", " ")


def _kind(obj) -> str:
    if isinstance(obj, types.ModuleType):
        return "module"
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    if callable(obj):
        return "function"
    return "data"


SECTIONS = [("module", "Modules"), ("class", "Classes"), ("function", "Functions"),
            ("exception", "Exceptions and warnings"), ("data", "Constants")]


class JaxmirrorApi(SphinxDirective):
    """``jaxmirror-api MODULE``: MODULE's docstring, then every name of its ``__all__``."""

    required_arguments = 1
    has_content = False
    option_spec = {"names": directives.unchanged, "rest": directives.flag}

    def run(self):
        modname = self.arguments[0]
        module = importlib.import_module(modname)
        if not hasattr(module, "__all__"):
            raise self.error(f"{modname} has no __all__")
        canonical = canonical_names()
        # What the page's earlier directives took (temp_data: this document's reading only).
        taken = self.env.temp_data.setdefault("jaxmirror_api_taken", {})
        lines = [] if modname in taken else [f".. automodule:: {modname}", ""]
        done = taken.setdefault(modname, set())
        if "names" in self.options:
            names = [n.strip() for n in self.options["names"].split(",") if n.strip()]
            wrong = [n for n in names if n not in module.__all__ or n in done]
            if wrong:
                raise self.error(f"jaxmirror-api {modname}: {wrong} not in __all__, or listed "
                                 "twice on the page; list each name of __all__ once")
            done.update(names)
            for name in names:
                obj = getattr(module, name)
                lines += self._entry(modname, name, obj, _kind(obj), canonical)
            return self._parse(lines, modname)
        by_kind: dict[str, list[str]] = {}
        for name in module.__all__:
            if "rest" not in self.options or name not in done:
                by_kind.setdefault(_kind(getattr(module, name)), []).append(name)
        done.update(module.__all__)
        for kind, title in SECTIONS:
            names = by_kind.get(kind)
            if not names:
                continue
            lines += [f".. rubric:: {title}", ""]
            for name in names:
                lines += self._entry(modname, name, getattr(module, name), kind, canonical)
        return self._parse(lines, modname)

    def _parse(self, lines, modname):
        content = StringList(lines, source=f"<jaxmirror-api {modname}>")
        container = nodes.container()
        self.state.nested_parse(content, self.content_offset, container)
        return container.children

    @staticmethod
    def _entry(modname, name, obj, kind, canonical) -> list[str]:
        full = f"{modname}.{name}"
        if kind == "module":
            summary = _summary(obj)
            return [f"* :doc:`/{page_of(obj.__name__)}`: {summary}" if summary else
                    f"* :doc:`/{page_of(obj.__name__)}`", ""]
        home = canonical.get(id(obj), full)
        if home != full:  # documented under its first public name; here an alias
            role = {"class": "class", "exception": "exc", "function": "func"}.get(kind, "obj")
            directive = kind if kind in ("class", "exception", "function") else "data"
            sig = ""
            if kind in ("function", "class"):
                try:
                    sig = str(inspect.signature(obj))
                except (TypeError, ValueError):
                    sig = ""
            return [f".. py:{directive}:: {name}{sig}", f"   :module: {modname}", "",
                    f"   The same object as :py:{role}:`{home}`.", ""]
        if kind in ("class", "exception"):
            # Members a class gets from jaxmirror bases, public (MirroredStrategy's run, reduce
            # and scope, from Strategy) or private (Strategy's input methods, a variable's
            # operators), are shown with it, as TF's pages do; those of other libraries' bases
            # (object, Enum, flax's BatchNorm) are not. (Sphinx filters an inherited member by
            # the name of the class that defines it.)
            documented = [b for b in obj.__mro__[1:] if not _ours(b)]
            skip = sorted({a.__name__ for b in documented for a in b.__mro__})
            return [f".. auto{kind}:: {full}", "   :members:",
                    f"   :inherited-members: {', '.join(skip)}", "   :show-inheritance:",
                    "   :special-members: __call__", ""]
        if kind == "function":
            return [f".. autofunction:: {full}", ""]
        return [f".. autodata:: {full}", ""]


def _ours(cls) -> bool:
    return cls.__module__ == ROOT or cls.__module__.startswith(ROOT + ".")


def _public_bases(app, name, obj, options, bases):
    """Show base classes by their public names (``jaxmirror.Strategy``), not module paths; a
    private jaxmirror base is replaced by its own bases (its members are shown with the class)."""
    canonical = canonical_names()

    def shown(base):
        if id(base) in canonical:
            module, _, qual = canonical[id(base)].rpartition(".")
            # A stand-in whose __module__ and __qualname__ give autodoc the public path.
            return [type(qual, (), {"__module__": module, "__qualname__": qual})]
        if _ours(base):
            return [b for parent in base.__bases__ for b in shown(parent)]
        return [base]

    new = []
    for base in bases:
        for b in shown(base):
            if all((b.__module__, b.__qualname__) != (n.__module__, n.__qualname__) for n in new):
                new.append(b)
    bases[:] = new


# ``jax.Array``s: reStructuredText ends an inline literal only before a space or punctuation, so
# a plural "s" right after it leaves the literal open (a warning, or text set as code up to the
# next ``). An escaped space after the literal ends it and prints nothing. A literal that ends in
# a space (``[worker i] ``) cannot be closed at all: its trailing space is dropped.
def _fix_line(line: str) -> str:
    parts = line.split("``")
    if len(parts) % 2 == 0:  # an odd number of ``: a literal spans lines; leave the line alone
        return line
    for i in range(1, len(parts), 2):  # parts[i] is a literal's text, parts[i + 1] what follows
        parts[i] = parts[i].rstrip() or parts[i]
        if parts[i + 1][:1].isalnum():
            parts[i + 1] = "\\ " + parts[i + 1]
    return "``".join(parts)


def _fix_inline_literals(app, what, name, obj, options, lines):
    """Close the inline literals that plain-text habits leave open in docstrings (see above)."""
    lines[:] = [_fix_line(line) for line in lines]


# Members public only so that jaxmirror's layers can call each other (what a compiled step asks
# of a variable: ``jaxmirror.core.stateful.Stateful`` and ``variables.overwrites``), not API.
def _internal_members() -> set:
    from jaxmirror.core.stateful import Stateful
    from jaxmirror.variables.overwrites import OverwriteWatch

    names = {n for cls in (Stateful, OverwriteWatch) for n in vars(cls) if not n.startswith("_")}
    return (names | {"single_copy"}) - {"shape", "dtype"}


_INTERNAL = _internal_members()


def _skip_internal(app, what, name, obj, skip, options):
    if what == "class" and name in _INTERNAL:
        return True
    return None


def _check_pages(app):
    srcdir = Path(app.srcdir)
    for modname in public_modules():
        page = srcdir / f"{page_of(modname)}.md"
        text = page.read_text() if page.exists() else ""
        if f".. jaxmirror-api:: {modname}\n" not in text:
            logger.warning(f"jaxmirror-api: the public module {modname} has no API page: add "
                           f"{page_of(modname)}.md (as the other pages in api/ are written)")
        elif ":names:" in text and ":rest:" not in text:
            logger.warning(f"jaxmirror-api: {page_of(modname)}.md lists names by topic "
                           "(:names:) but has no :rest: directive; end it with one, so that a "
                           "name added to __all__ is shown")


_BACKLINK = re.compile(r'(<a class="viewcode-back" href=")([^"#]*)#([^"]+)(")')


def _fix_backlinks(app, pagename, templatename, context, doctree):
    """Point the source pages' ``[docs]`` links at the entry where each object is documented.

    Sphinx's viewcode builds them as ``page#<module>.<name>`` with one ``<module>`` and the last
    page per source module; here a source module's objects are documented under several public
    modules (``jaxmirror.data.options``: ``jaxmirror.InputOptions`` and
    ``jaxmirror.experimental.AutoShardPolicy``) and under aliases, so the link is rebuilt from
    the object's public name and the page the Python domain records for it.
    """
    if not pagename.startswith("_modules/") or 'class="viewcode-back"' not in context.get(
            "body", ""):
        return  # not a source page (the _modules/ index has no [docs] links)
    source = importlib.import_module(pagename[len("_modules/"):].replace("/", "."))
    objects = app.env.get_domain("py").objects
    canonical = canonical_names()

    def fix(match):
        head, _, fragment, tail = match.groups()
        for modname in sorted(public_modules(), key=len, reverse=True):
            if not fragment.startswith(modname + "."):
                continue
            qualname = fragment[len(modname) + 1:]
            first, _, rest = qualname.partition(".")
            public = canonical.get(id(getattr(source, first, None)))
            entry = public and objects.get(public + ("." + rest if rest else ""))
            if entry:
                uri = app.builder.get_relative_uri(pagename, entry.docname)
                return f"{head}{uri}#{entry.node_id}{tail}"
        return match.group(0)

    context["body"] = _BACKLINK.sub(fix, context["body"])


def setup(app):
    app.add_directive("jaxmirror-api", JaxmirrorApi)
    app.connect("autodoc-process-bases", _public_bases)
    app.connect("autodoc-process-docstring", _fix_inline_literals)
    app.connect("builder-inited", _check_pages)
    app.connect("autodoc-skip-member", _skip_internal)
    app.connect("html-page-context", _fix_backlinks)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
