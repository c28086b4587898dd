"""`make demo` keeps working: a short run of the same command, checked for its promises."""

import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def _row(out: str, label: str) -> list[int]:
    """The three byte columns (gather, regather, +recompute) of a table row."""
    m = re.search(rf"^\s+{re.escape(label)}\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s", out, flags=re.M)
    assert m, (label, out)
    return [int(v.replace(",", "")) for v in m.groups()]


def test_demo_short_run_prints_identical_losses_and_bytes_cut_by_tp():
    proc = subprocess.run(
        [sys.executable, "-m", "regather", "demo", "--steps", "5", "--hidden", "64", "--seq", "32",
         "--micro-batch", "2", "--timeout", "180"],
        capture_output=True, text=True, timeout=220,
    )
    out = proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(yes|NO)$", out, flags=re.M)
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 5]
    assert all(r[1] == r[2] == r[3] and r[4] == "yes" for r in rows)  # gather, regather, +recompute
    assert "Losses identical on every rank: yes" in out
    assert "cut by a factor 2 (TP=2)" in " ".join(out.split())
    # the third column: every recomputing qkv/fc1 and fc2 adapter input at 0 new bytes
    s, b, h, ffn, t, e = 32, 2, 64, 256, 2, 4
    assert _row(out, "the 3 that +recompute rebuilds") == [3 * s * b * h * e, 3 * s * b * h // t * e, 0]
    assert _row(out, "fc2 (row-parallel)") == [2 * s * b * ffn // t * e] * 2 + [0]
    assert _row(out, "the 1 that +recompute keeps") == [s * b * h * e, s * b * h // t * e, s * b * h // t * e]
    total = _row(out, "retained activations, total")
    inputs = _row(out, "of which LoRA-A inputs")
    assert total[0] - total[2] == inputs[0] - inputs[2]  # nothing else retained changes
    assert max(map(len, out.splitlines())) <= 120  # long lines wrap, their continuations indented
    flat = " ".join(out.split())  # the report's text with its wrapping undone
    assert "save 0 new bytes for it" in flat
    assert re.search(r"decoder\.layers\.0\.self_attention\.linear_qkv\s+regather, input kept \(recompute asked: "
                     r"input_layernorm: it keeps nothing for its backward", flat)
    assert re.search(r"decoder\.layers\.1\.self_attention\.linear_qkv\s+regather, input recomputed from "
                     r"input_layernorm", flat)
    assert re.search(r"decoder\.layers\.1\.mlp\.linear_fc2\s+gather \(asked regather: base layer.*?input "
                     r"recomputed from the MLP activation \(gelu\)", flat)
    assert "keeps its input: decoder.layers.0.self_attention.linear_qkv: input_layernorm" in flat
    # time: what the recompute itself took, clocked; no step-time ratio offered as its cost (issue 48)
    assert re.search(r"the \+recompute run spent [\d.]+ ms a step rebuilding its inputs, [\d.]+ % of its step", flat)
    assert "The step times themselves are not a cost" in flat and "0.44 % of a step" in flat
    assert not re.search(r"median step time \(ms\)(\s+[\d.]+){4}", out)  # three times, no ratio column
    assert re.search(r"^\s+of which rebuilding inputs \(ms\)\s+-\s+-\s+[\d.]+$", out, flags=re.M)


def test_demo_stopped_by_its_timeout_says_so_in_one_line():
    """A --timeout the run exceeds ends the command with one line naming it, not a TimeoutError traceback."""
    proc = subprocess.run([sys.executable, "-m", "regather", "demo", "--steps", "5", "--hidden", "64", "--seq", "32",
                           "--micro-batch", "2", "--timeout", "0.01"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    # regather's own words: one line. The ranks may print their stack's warnings before it (on torch's CUDA
    # build, cpp_extension's "No CUDA runtime is found"; a megatron module compiled at import, a SyntaxWarning)
    ours = [line for line in proc.stderr.splitlines() if line.startswith("regather")]
    assert len(ours) == 1 and ours[0].startswith("regather demo: ranks"), proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ours[0], proc.stderr
    assert "--timeout 0.01" in proc.stderr
