"""Sphinx configuration of the hf-memory documentation (``make docs``).

Markdown pages through MyST, the API reference from the docstrings (autodoc, napoleon), the
command-line reference from the real argparse parsers (``_ext/cli_help.py``, which says why not
sphinx-argparse). No intersphinx: the build must not need the network.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))

from hf_memory import __version__  # noqa: E402

project = "hf-memory"
author = "hf-memory contributors"
copyright = "hf-memory contributors"
release = __version__
version = __version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_parser",
    "cli_help",
    "package_tree",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_ext"]

# Relative `.md` links between pages and the heading anchors they point at.
myst_heading_anchors = 3

autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# Our docstrings only: a method we override without one would show the base class's (transformers'
# ``set_input_embeddings``, whose reST is not ours to fix).
autodoc_inherit_docstrings = False
# Installed only in their own environments (make vllm-env): the plugin documents without them.
autodoc_mock_imports = ["vllm"]

napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
html_title = f"hf-memory {release}"
