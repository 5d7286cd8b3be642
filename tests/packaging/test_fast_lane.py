"""`make check`'s lane (tests/conftest.py): under ``-m unit`` alone, a module with no unit test is not even
imported, and the lane still collects every unit test a run over all modules would."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: a folder of mixed modules (UNIT_TESTS) and integration ones (Spark, a cluster); a folder, as `make check` names
#: none: pytest asks pytest_ignore_collect about the files it finds, not about those named on its command line
FOLDER = "tests/pipeline"


def _collect(markexpr: str) -> tuple[list[str], int]:
    """The test ids collected under `-m markexpr`, and how many tests pytest found before deselecting."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-m", markexpr, FOLDER],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    found = re.search(r"(\d+)/(\d+) tests collected|(\d+) tests collected", out.stdout)
    assert found, out.stdout
    total = int(found[2] or found[3])
    return sorted(line for line in out.stdout.splitlines() if "::" in line), total


def test_the_unit_lane_leaves_integration_modules_out_and_keeps_every_unit_test():
    lane, lane_total = _collect("unit")
    everything, all_total = _collect("(unit)")  # the same tests, but not the lane's exact expression
    assert lane == everything and any("test_pipeline_ledger.py" in test for test in lane)
    assert any("test_pipeline_ingest.py" in test for test in lane)
    assert not any("test_pipeline_cluster.py" in test for test in lane)
    assert lane_total < all_total  # the cluster module's tests were never collected to be deselected
