"""bench/emulator_profile.py: the tiny run profiles the planner's tensor-core forward on the emulator and reports
it per source line, each line's counts consistent with the kernel's totals."""

import json

import pytest

from cuflash import simt

pytestmark = pytest.mark.skipif(not simt.available(), reason=str(simt.unavailable_reason()))


def test_tiny_run_profiles_the_planned_forward(tmp_path, capsys):
    from bench import emulator_profile

    out = tmp_path / "profile.json"
    assert emulator_profile.main(["--tiny", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["schema"] == emulator_profile.SCHEMA
    [row] = report["rows"]
    assert row["kind"] == "forward" and row["kernel"].startswith("cuflash::fwd_mma<__half")
    totals, lines = row["totals"], row["lines"]
    assert totals["ldsm_requests"] > 0 and totals["global_load_sectors"] > 0 and totals["barriers"] > 0
    for key in ("wavefronts", "ideal", "sectors"):
        assert sum(line[key] for line in lines) == totals[key]
    assert sum(line["conflicts"] for line in lines) == totals["conflicts"]
    assert all(line["file"].startswith("cuflash/kernels/") for line in lines), lines
    text = capsys.readouterr().out
    assert "fwd_mma<__half" in text and "bank conflicts:" in text


def test_a_block_masks_forward_visits_exactly_the_tiles_it_shows():
    """The profile counts the tensor-core forward's visits (its per-visit barrier): through a block mask of causal
    packed documents they are the tiles the mask shows, fewer than causal alone would visit."""
    from bench import emulator_profile

    result = emulator_profile.visits_check(n=256)
    assert result["tiles_visited"] == result["tiles_shown"] < result["causal_tiles"], result
