"""The README's Python examples run as written, and every attention they compute is right: the README cannot
drift from the code, nor show a result the reference disagrees with."""

import pathlib
import re

import cuflash
from reference import assert_accurate

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
OPTIONS = ("scale", "causal", "window", "mask", "bias")


def test_readme_examples_run_and_are_right(monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no Python example"
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
        exec(compile(block, str(README), "exec"), {})
    assert calls, "no README example calls cuflash.attention"
    for q, k, v, kw, result in calls:
        out, lse = result if kw.get("return_lse") else (result, None)
        assert_accurate(out, q, k, v, lse=lse, **{key: kw[key] for key in OPTIONS if key in kw})
