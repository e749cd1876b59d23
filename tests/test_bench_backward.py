"""bench/backward.py, the CPU backward comparison: its smoke run writes every peer's record, each accurate."""

import json

from bench import backward


def test_tiny_run_records_every_peer(tmp_path):
    assert backward.main(["--tiny", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["schema"] == backward.SCHEMA
    records = report["records"]
    assert {r["name"] for r in records} == set(backward.PEERS)
    assert len(records) == len(backward.points(tiny=True)) * len(backward.PEERS)
    for r in records:
        assert r["status"] == "ok", r
        assert r["dq_rel_error"] < 1e-5 and r["time_ms"] > 0 and r["cuflash_speedup"] > 0
    assert "| cuflash |" in (tmp_path / "results.md").read_text()


def test_flops_count_five_matmuls_and_causal_pairs():
    dense, causal = backward.Point(1, 4, 2, False), backward.Point(1, 4, 2, True)
    assert dense.flops() == 2.5 * 4 * 4 * 4 * 2  # 2.5 x (2 (d + e) per visible pair x 16 pairs)
    assert causal.flops() == 2.5 * 4 * 2 * 10  # 10 visible pairs of 16
