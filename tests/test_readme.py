"""The Python examples of the README and of the user guide (docs/guide/*.md) run as written, and every attention
they compute is right: neither can drift from the code, nor show a result the reference disagrees with."""

import pathlib
import re

import numpy as np
import pytest

import cuflash
from reference import assert_accurate

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs" / "guide").glob("*.md"))]
ARCHITECTURE = ROOT / "docs" / "guide" / "architecture.md"
OPTIONS = ("scale", "causal", "window", "mask", "bias")


def examples(page):
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def test_the_readme_and_the_guide_have_examples():
    assert examples(README), "the README has no Python example"
    assert all(examples(ROOT / "docs" / "guide" / name) for name in (
        "getting-started.md", "patterns.md", "sequences.md", "training.md", "dask.md", "semantics.md"))


@pytest.mark.parametrize("page", [page for page in PAGES if examples(page)], ids=lambda page: page.name)
def test_examples_run_and_are_right(monkeypatch, page):
    blocks = examples(page)
    calls = []
    real = cuflash.attention

    def recorded(q, k, v, **kw):
        result = real(q, k, v, **kw)
        calls.append((q, k, v, kw, result))
        return result

    monkeypatch.setattr(cuflash, "attention", recorded)
    for block in blocks:
        if "cuflash.attention(q, k, v, /" in block:  # the signature, not an example
            continue
        exec(compile(block, str(page), "exec"), {})
    for q, k, v, kw, result in calls:
        out, lse = result if kw.get("return_lse") else (result, None)
        if kw.get("dropout_p"):
            check_dropout_call(q, k, v, kw, out, lse)
            continue
        if any(kw.get(key) is not None for key in PATTERNS):
            check_pattern_call(q, k, v, kw, out, lse)
            continue
        assert_accurate(out, q, k, v, lse=lse, **{key: kw[key] for key in OPTIONS if key in kw})


PATTERNS = ("score_mod", "mask_mod", "block_mask", "sinks")


def check_pattern_call(q, k, v, kw, out, lse):
    """A call with mods against the same functions evaluated densely on the whole grid (test_mods' reference)."""
    from test_mods import assert_close, dense_reference

    mask_mod = kw.get("mask_mod") or (kw["block_mask"].function if kw.get("block_mask") is not None else None)
    expected, expected_lse = dense_reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                             score_mod=kw.get("score_mod"), mask_mod=mask_mod,
                                             sinks=kw.get("sinks"), causal=kw.get("causal", False))
    assert_close(out, expected, np.float32)
    if lse is not None:
        assert_close(lse, expected_lse, np.float32)


def check_dropout_call(q, k, v, kw, out, lse):
    """A call with dropout: the reference's weights (its attention over an identity of values) times the elements
    dropout_mask keeps, over 1 - p, times v; lse untouched by dropout."""
    from cuflash.reference import attention_reference
    options = {key: kw[key] for key in OPTIONS if key in kw}
    m = k.shape[-2]
    weights, expected_lse = attention_reference(q, k, np.eye(m), **options)
    p = kw["dropout_p"]
    keep = cuflash.dropout_mask(weights.shape[:-2], q.shape[-2], m, p=p, seed=kw["seed"])
    np.testing.assert_allclose(out, (weights * keep / (1 - p)) @ v.astype(np.float64), rtol=1e-5, atol=1e-6)
    if lse is not None:
        np.testing.assert_allclose(lse, expected_lse, rtol=1e-6)


def test_architecture_section_names_files_that_exist():
    """Every file the architecture page's table names is in the package, and every module of the package is
    named."""
    section = ARCHITECTURE.read_text()
    root = pathlib.Path(cuflash.__file__).resolve().parent
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    named = {name for row in rows for name in re.findall(r"`([\w/]+(?:\.\w+)?)`", row.split("|")[1] + row.split("|")[2])
             if "." in name or name.endswith("/")}
    for name in named:
        assert (root / name).exists() or (root / "kernels" / name).exists(), name
    modules = {p.name for p in root.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    assert modules <= named, f"modules the table does not name: {sorted(modules - named)}"
    headers = {p.name for p in (root / "kernels").glob("*.cuh")}
    assert headers <= named, f"kernel files the table does not name: {sorted(headers - named)}"
