"""The README's Python examples run as written, so the README cannot drift from the code."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no Python example"
    for block in blocks:
        if "cuflash.attention(q, k, v, /" in block:  # the signature, not an example
            continue
        exec(compile(block, str(README), "exec"), {})
