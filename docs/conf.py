"""Sphinx configuration of cuflash's documentation: the PyData theme, numpydoc, MyST for the Markdown pages and
sphinx-gallery for the examples. Build it from the repository root with
python -m sphinx -W -b html docs docs/_build/html (warnings are errors). Nothing is fetched from the network."""

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)  # the checkout's own cuflash, whatever is installed
os.environ.setdefault("MPLBACKEND", "Agg")

import cuflash  # noqa: E402

project = "cuflash"
author = "the cuflash authors"
copyright = "the cuflash authors"
version = release = cuflash.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",
    "myst_parser",
    "sphinx_gallery.gen_gallery",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "examples", "**/sg_execution_times.rst", "sg_execution_times.rst"]
root_doc = "index"
default_role = "autolink"  # `name` in a docstring links to its reference page where there is one

# The reference pages are committed (docs/reference/*.rst), one per public name: nothing is generated into the
# source tree, and a name listed in an autosummary table without its page is a warning (an error under -W).
autosummary_generate = False
autodoc_typehints = "none"  # the signature shows the defaults; numpydoc's Parameters say the types
autodoc_default_options = {"member-order": "bysource"}
numpydoc_show_class_members = False
numpydoc_xref_param_type = False
numpydoc_validation_checks: set = set()

myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

sphinx_gallery_conf = {
    "examples_dirs": "examples",
    "gallery_dirs": "auto_examples",
    "filename_pattern": r"/plot_",
    "download_all_examples": False,
    "remove_config_comments": True,
    "reference_url": {},
    "write_computation_times": False,
    "show_memory": False,
    "image_scrapers": ("matplotlib",),
}

html_theme = "pydata_sphinx_theme"
html_title = f"cuflash {version}"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
}
html_static_path: list = []
html_show_sourcelink = False
