"""Sphinx configuration: Markdown pages (MyST) and an API reference from the docstrings.

Built offline (``make docs``): no extension here reaches the network (no intersphinx).
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))  # not the working directory: tests run it
sys.path.insert(0, os.path.join(_HERE, "_ext"))
sys.path.insert(0, os.path.dirname(_HERE))

project = "jaxmirror"
author = "the jaxmirror authors"
copyright = "the jaxmirror authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "jaxmirror_api",  # docs/_ext: the API pages from each public module's __all__
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# MyST: ```{directive}``` blocks, ::: fences, and #anchors for headings down to ###.
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# autodoc + napoleon: Google-style Args/Returns/Raises/Example sections.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autoclass_content = "class"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True

html_theme = "furo"
html_title = "jaxmirror"
html_static_path = ["_static"]
html_css_files = ["jaxmirror.css"]  # docs/_static: long table cells wrap
default_role = "py:obj"  # `Name` in a docstring: a link when Name is documented, else code
