"""bench/sequences.py, packed against padded and paged decoding against gathered pages: its smoke run records both,
each matching its peer's result."""

import json

from bench import sequences


def test_tiny_run_records_packed_and_paged(tmp_path):
    assert sequences.main(["--tiny", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["schema"] == sequences.SCHEMA
    packed, decode = report["records"]
    assert packed["max_abs_difference"] < 1e-5 and decode["max_abs_difference"] < 1e-5
    assert 0 < packed["ideal_ratio"] < 1 and packed["ratio"] > 0
    assert decode["tokens_per_s"] > 0 and decode["gathered_tokens_per_s"] > 0
    assert "| packed against padded |" in (tmp_path / "results.md").read_text()
