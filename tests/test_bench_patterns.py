"""bench/patterns.py, patterns as functions against dense arrays: its smoke run records every pattern, each
matching the dense call."""

import json

from bench import patterns


def test_tiny_run_records_every_pattern(tmp_path):
    assert patterns.main(["--tiny", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["schema"] == patterns.SCHEMA
    assert report["backend"] == "numpy" and report["timing"] == patterns.TIMING["numpy"]
    names = [r["name"] for r in report["records"]]
    assert names == list(patterns.patterns(256, tiny=True))
    for r in report["records"]:
        assert r["max_abs_difference"] < 1e-5, r
        assert r["time_ms"] > 0 and r["plain_ms"] > 0
    assert {r["name"] for r in report["records"] if "target" in r} == set(patterns.TARGETS)
    assert "| documents |" in (tmp_path / "results.md").read_text()
