"""bench/dask_scaling.py: its smoke run on a real two-process cluster records the in-process call and the
cluster's, the same result, and the chunk-pair tasks the causal visibility allows."""

import json

from bench import dask_scaling


def test_tiny_run_records_both(tmp_path):
    assert dask_scaling.main(["--tiny", "--workers", "2", "--repeats", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["schema"] == dask_scaling.SCHEMA
    base, cluster = report["records"]
    assert base["name"] == "in process" and cluster["workers"] == 2
    p = dask_scaling.point(tiny=True)
    chunks = p.n // p.chunk
    assert cluster["pair_tasks"] == chunks * (chunks + 1) // 2  # causal: the chunk pairs on or below the diagonal
    assert cluster["max_abs_diff"] < 1e-5 and cluster["time_s"] > 0 and cluster["speedup"] > 0
    assert "| dask, 2 workers |" in (tmp_path / "results.md").read_text()
