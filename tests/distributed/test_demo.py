"""`make demo` keeps working: a short run of the same command, checked for its promises."""

import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def test_demo_short_run_prints_identical_losses_and_bytes_cut_by_tp():
    proc = subprocess.run(
        [sys.executable, "-m", "regather", "demo", "--steps", "5", "--hidden", "64", "--seq", "32",
         "--micro-batch", "2", "--timeout", "180"],
        capture_output=True, text=True, timeout=220,
    )
    out = proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+(yes|NO)$", out, flags=re.M)
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 5]
    assert all(r[1] == r[2] and r[3] == "yes" for r in rows)
    assert "Losses identical on every rank: yes" in out
    assert "cut by a factor 2 (TP=2)" in out
    assert re.search(r"decoder\.layers\.0\.self_attention\.linear_qkv\s+regather", out)
    assert re.search(r"decoder\.layers\.1\.mlp\.linear_fc2\s+gather \(asked regather: base layer", out)
