"""benchmarks/gpu/device_run.sh — the one command for a lent GPU — keeps running after any move of
modules: its CPU dry run (te_norm_grad.py --cpu-dry-run: TE "not available" with the reason, the
comparison on a plain-torch stand-in; run.sh --dry-run: one tiny layer per strategy and variant;
te_lora.py --cpu-dry-run: TE "not available", the same check on the CPU model of TE;
kernels.sh --cpu-dry-run: the weight-gradient kernels under the Triton interpreter, the overlap
trace's maths) exits 0 with every step, and writes the files the device call brings back (at most
8). What it measures needs a GPU; this only proves the driver and everything it imports still work."""

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "gpu" / "device_run.sh"
FILES = {"summary.txt", "device_run.log", "layer_bench.json", "layer_bench.md", "kernels.json", "kernels.md",
         "results.tar.gz"}
VARIANTS = {"gather", "regather", "regather-plain", "lowrank", "regather-recompute", "lowrank-recompute",
            "gather-recompute", "regather-classic", "gather-lean"}
LONG = {"gather", "gather-lean", "regather-classic", "regather", "regather-recompute", "lowrank"}


@pytest.mark.timeout(1500)
def test_cpu_dry_run_of_the_device_command(tmp_path):
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1450)
    summary = (tmp_path / "summary.txt").read_text() if (tmp_path / "summary.txt").exists() else ""
    assert proc.returncode == 0, summary + proc.stdout[-2000:] + (tmp_path / "device_run.log").read_text()[-4000:]
    step_lines = summary.split("# step  exit  seconds  budget_s\n")[1].split("\n# environment")[0].splitlines()
    steps = {line.split()[0]: line.split()[1] for line in step_lines
             if not line.startswith(("te_norm_grad: ", "te_lora: "))}
    assert steps == {"te": "0", "run": "0", "te_lora": "0", "kernels": "0"}, summary
    files = {p.name for p in tmp_path.iterdir()}
    assert FILES == files and len(files) <= 8, files  # the device brings back at most 8 files
    # the TE check's verdict in every output: without CUDA or TE "not available" with each reason
    te = json.loads((tmp_path / "kernels.json").read_text())["te_norm_grad"]
    verdict = te["verdict"]
    assert f"te_norm_grad: {verdict}\n" in summary, summary
    reasons = [r for r, missing in (("no CUDA device", not torch.cuda.is_available()),
                                    ("transformer_engine.pytorch does not import (",
                                     importlib.util.find_spec("transformer_engine") is None)) if missing]
    if reasons:
        assert verdict.startswith("not available: ") and all(r in verdict for r in reasons), verdict
    else:
        assert verdict.startswith("gradient into the gathered ln_out "), verdict
    assert {r: v["verdict"] for r, v in te["stand_in"].items()} == {
        "dropped": "gradient into the gathered ln_out dropped", "added": "gradient into the gathered ln_out added"}
    assert f"**Verdict: {verdict}" in (tmp_path / "kernels.md").read_text()
    te_lora = json.loads((tmp_path / "kernels.json").read_text())["te_lora"]
    assert f"te_lora: {te_lora['verdict']}\n" in summary, summary
    if reasons:
        assert te_lora["verdict"].startswith("not available: ") and all(r in te_lora["verdict"] for r in reasons), \
            te_lora["verdict"]
    assert te_lora["te_model"]["verdict"] == "right gradients; recompute: rank-r bytes only", te_lora["te_model"]
    with tarfile.open(tmp_path / "results.tar.gz") as tar:
        assert "./te/te_norm_grad.json" in tar.getnames() and "./te_lora/te_lora.json" in tar.getnames()
        long = json.load(tar.extractfile("./run/long/layer_bench.json"))  # run.sh's long-context pass
    assert set(long["results"]) == LONG, sorted(long["results"])
    layer = json.loads((tmp_path / "layer_bench.json").read_text())
    assert layer["args"]["dry_run"] is True and set(layer["results"]) == VARIANTS
    res = layer["results"]
    for name in ("regather", "regather-plain", "regather-recompute"):
        assert res[name]["decisions"]["self_attention.linear_qkv"].startswith("regather"), res[name]["decisions"]
    # bytes are counted, not timed: the dry run's layer keeps less with each step of the feature
    inputs = {name: r["saved_adapter_input_bytes"] for name, r in res.items()}
    assert inputs["regather"] < inputs["gather"] and inputs["regather-recompute"] < inputs["regather"], inputs
    kernels = json.loads((tmp_path / "kernels.json").read_text())
    assert {"dispatch", "shapes", "overlap_trace"} <= set(kernels), sorted(kernels)
