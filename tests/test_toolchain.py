"""The suite's own guard against quiet skips (conftest.missing_tools): a missing compiler is named with what to
install."""

import conftest


def test_a_missing_compiler_is_named(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert any("g++" in line for line in conftest.missing_tools())

