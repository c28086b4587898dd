"""``regather bench --torchtitan`` run twice the same way through the console script: the allocator column
repeats, variants that save the same bytes show the same allocator figure, and the output carries no
framework chatter (regather.core.allocated says why the column used to change; regather.tools.cpu.quiet
lists what is kept out). The smallest shapes of test_bench_titan.py, four variants, two steps."""

import json

import pytest
from regather_console import NOT_INSTALLED, regather, script

from regather.tools.cpu import torchtitan_models

if torchtitan_models.missing():
    pytest.skip(torchtitan_models.missing(), allow_module_level=True)
if script() is None:
    pytest.skip(NOT_INSTALLED, allow_module_level=True)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

ARGV = ["bench", "--torchtitan", "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
        "--vocab", "256", "--seq", "32", "--micro-batch", "2", "--steps", "2", "--warmup", "1",
        "--strategies", "gather,regather,regather-recompute"]
CHATTER = ("Warning", "warn(", "USDT", "profiler_start", "CPUAllocator", "Traceback")


def test_allocator_column_repeats_and_the_output_is_quiet(tmp_path):
    columns = []
    for run in range(2):
        out = tmp_path / f"run{run}"
        done = regather(*ARGV, "--out", str(out), timeout=500)
        assert done.returncode == 0, done.stderr[-3000:]
        progress = [line for line in done.stderr.replace("\r", "\n").splitlines() if line.strip()]
        assert all(line.lstrip().startswith("[") and "step" in line for line in progress), progress
        assert not [c for c in CHATTER if c in done.stdout + done.stderr], done.stdout + done.stderr
        assert max(map(len, done.stdout.splitlines())) <= 120
        head = done.stdout.split("\n\n")[0]  # what ran, on what, the columns: before the tables (issue 48)
        assert head.startswith("regather bench --torchtitan: torchtitan llama3, 2 layers, dim 64") and "columns:" in head
        assert "measured on CPU (gloo): 2 ranks" in head and "torchtitan 0.3.0" in head
        assert head.endswith("CPU times show relative cost only; absolute times need a GPU.")
        rows = json.loads((out / "bench.json").read_text())["strategies"]
        columns.append({name: r["allocated_over_frozen"] for name, r in rows.items()})
        # beside the saved-tensor count the allocator sees only autograd's few bytes of bookkeeping per variant
        extra = {name: r["allocated_over_frozen"] - r["lora_bytes_over_frozen"] for name, r in rows.items()}
        assert len(set(extra.values())) == 1 and 0 <= extra["gather"] < 1024, extra
    assert columns[0] == columns[1], columns
    assert columns[0]["gather"] == columns[0]["torchtitan"]  # the same saved bytes, bit-identical results
