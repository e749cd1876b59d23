"""The documentation site: every public name's docstring has numpydoc's Parameters, Returns and Examples sections
and its Examples run and give what they show (doctest, here: the docstring is their one source), and the site
builds with Sphinx, warnings as errors, with a reference page for every public name. The build runs once, with
the gallery's examples, in one child process: the README's command with another output folder (about 12 s of CPU,
15 to 30 s on a busy 2-core machine)."""

import doctest
import importlib
import inspect
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PUBLIC_MODULES = ("cuflash", "cuflash.mods", "cuflash.tiling", "cuflash.torch", "cuflash.dask")
BUILD = ("-W", "-b", "html")  # the README's command: warnings are errors
MODS = ("alibi", "alibi_slopes", "softcap", "documents", "prefix_lm", "relative_bias", "causal", "sliding_window",
        "and_masks", "or_masks", "cuda_source", "TraceError")
PLANNER = ("plan", "backward_plans", "not_supported_reasons", "Plan", "Shape")  # what the guide tells users to call
CHOSEN = {"cuflash.mods": MODS, "cuflash.tiling": PLANNER}


def public_names():
    """(qualified name, object) of every public function and class: each module's __all__ (cuflash.mods: its
    built-in patterns; cuflash.tiling: the planner's calls the guide names)."""
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in CHOSEN[module_name] if module_name in CHOSEN else module.__all__:
            obj = getattr(module, name)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                yield f"{module_name}.{name}", obj


NAMES = dict(public_names())


def test_the_public_names_are_found():
    assert {"cuflash.attention", "cuflash.attention_backward", "cuflash.merge", "cuflash.block_mask",
            "cuflash.BlockMask", "cuflash.attention_varlen", "cuflash.attention_paged", "cuflash.dropout_mask",
            "cuflash.last_seed", "cuflash.BlockConfig", "cuflash.mods.alibi", "cuflash.torch.attention",
            "cuflash.dask.attention"} <= set(NAMES)


@pytest.mark.parametrize("name", sorted(NAMES))
def test_docstring_has_numpydoc_sections(name):
    doc = inspect.getdoc(NAMES[name]) or ""
    sections = ["Examples"]
    if inspect.isfunction(NAMES[name]):
        sections += ["Returns"] + (["Parameters"] if inspect.signature(NAMES[name]).parameters else [])
    for section in sections:
        assert f"\n{section}\n{'-' * len(section)}\n" in doc, f"{name}: no {section} section"


@pytest.mark.parametrize("name", sorted(NAMES))
def test_docstring_examples_run(name):
    finder = doctest.DocTestFinder(recurse=False)
    tests = [t for t in finder.find(NAMES[name], name) if t.examples]
    assert tests, f"{name}: its docstring has no example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed (printed above)"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built once, warnings as errors, into a temporary folder (the gallery's generated pages go to
    docs/auto_examples, which git ignores)."""
    assert f"python -m sphinx {' '.join(BUILD)} docs docs/_build/html" in (ROOT / "README.md").read_text(), \
        "the README's build command is not the one tested"
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, MPLBACKEND="Agg")
    result = subprocess.run([sys.executable, "-m", "sphinx", *BUILD, "-q", "-d", str(out / "doctrees"), str(DOCS),
                             str(out / "html")], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert result.returncode == 0, f"the site does not build:\n{result.stdout}\n{result.stderr}"
    return out / "html"


@pytest.mark.parametrize("name", sorted(NAMES) + ["cuflash.bfloat16"])
def test_every_public_name_has_a_reference_page(site, name):
    page = site / "reference" / f"{name}.html"
    assert page.is_file(), f"{name} has no reference page (docs/reference/{name}.rst, listed in its index)"
    assert f'id="{name}"' in page.read_text(), f"the page of {name} does not document it"


def test_the_guide_and_the_gallery_are_built(site):
    for name in ("getting-started", "semantics", "patterns", "sequences", "training", "dask", "kernels", "proof",
                 "benchmarks", "architecture"):
        assert (site / "guide" / f"{name}.html").is_file(), name
    examples = sorted(p.stem for p in (DOCS / "examples").glob("plot_*.py"))
    assert len(examples) >= 4
    for name in examples:
        page = (site / "auto_examples" / f"{name}.html").read_text()
        assert f"sphx_glr_{name}_001.png" in page, f"the gallery's {name} draws no figure"
