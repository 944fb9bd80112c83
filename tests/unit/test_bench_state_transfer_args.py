"""scripts/bench_state_transfer.py refuses a link rate it cannot shape with one sentence, before it builds anything."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]  # each case starts the script (torch imported)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_state_transfer.py"


@pytest.mark.parametrize("rate", ["0", "-5"])
def test_a_link_rate_that_is_not_positive_is_refused_in_one_sentence(rate: str) -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--testbed-mbit", rate], capture_output=True, text=True, timeout=100
    )
    assert out.returncode != 0
    assert f"--testbed-mbit must be a positive rate in Mbit/s, got {float(rate)}." in out.stderr
    assert "Traceback" not in out.stderr
