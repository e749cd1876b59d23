"""What holds the project's files to its conventions: code fits 120 columns, bench/results/ keeps one current file
per report (regenerated in place; git keeps the history, so no dated copies), and every result file the READMEs
cite exists."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE = ("*.py", "*.cuh", "*.h", "*.cu", "*.sh", "*.toml")
READMES = ("README.md", "bench/README.md", "cuflash/simt/README.md",
           *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "guide").glob("*.md")))


def tracked(*patterns):
    try:
        listed = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in listed if (ROOT / name).is_file()]


def test_code_fits_120_columns():
    long = [f"{path.relative_to(ROOT)}:{number}" for path in tracked(*CODE)
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if len(line) > 120]
    assert not long, f"lines past 120 columns: {long}"


def test_results_are_one_current_file_per_report():
    dated = [str(p.relative_to(ROOT)) for p in tracked("bench/results") if re.search(r"\d{4}-\d{2}-\d{2}", str(p))]
    assert not dated, f"dated copies under bench/results (regenerate the report in place instead): {dated}"


def test_every_result_file_the_readmes_cite_exists():
    cited = set()
    for readme in READMES:
        text = (ROOT / readme).read_text()
        cited |= set(re.findall(r"bench/results/[\w./-]+\.(?:txt|json|md)", text))
        if readme == "bench/README.md":
            cited |= {"bench/" + x for x in re.findall(r"(?<![\w/])results/[\w./-]+\.(?:txt|json|md)", text)}
    assert cited, "the READMEs and the guide cite no result file"
    missing = sorted(x for x in cited if not (ROOT / x).is_file())
    assert not missing, f"cited but not under bench/results: {missing}"
