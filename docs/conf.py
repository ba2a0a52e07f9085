"""Sphinx configuration of the gradfuse documentation site.

Build (offline: no intersphinx, nothing is fetched):

    .venv/bin/pip install -q -e '.[docs]'
    .venv/bin/python -m sphinx -W --keep-going docs docs/_build/html

Which venv builds: the README's main ``.venv`` (MXNet 1.9.1, numpy 1.23, the compiled
kernels built in place). It has no torch, so ``torch``, ``lightning`` and ``pytorch_lightning`` are mocked
for autodoc (``autodoc_mock_imports`` below): ``gradfuse.torch`` imports against the mocks
and its pages come from its own docstrings, which is all autodoc reads. ``gradfuse.mxnet``
imports the real MXNet. The compiled modules (``gradfuse._core``) are built with Cython's
``embedsignature`` (setup.py), so their functions show real signatures here.
"""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))

import gradfuse  # noqa: E402  (the checkout's package, with its kernels built in place)

project = "gradfuse"
author = "the gradfuse developers"
copyright = "the gradfuse developers"
release = gradfuse.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
]

# the Markdown guides of docs/ are the pages; README.md comes in through quickstart.md
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# MyST: GitHub-style heading anchors, so the guides' links like design.md#the-timeline
# resolve both on GitHub and in the site
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence", "deflist"]

# autodoc: the frameworks the docs venv lacks are mocked (see the module docstring)
autodoc_mock_imports = ["torch", "lightning", "pytorch_lightning"]
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_include_init_with_doc = False

# offline: no intersphinx (nothing is fetched during the build)
html_theme = "furo"
html_title = f"gradfuse {release}"
html_static_path = []
