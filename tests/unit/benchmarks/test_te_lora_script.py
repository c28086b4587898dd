"""benchmarks/gpu/te_lora.py (regather's LoRA on a real TE base: input gradient vs fp64, recompute's
bytes) on CPU: the verdict logic, and the whole check on the CPU model of TE (TE >= 2.4) in its dry
run, "not available" with the reason where TE or CUDA is missing. What it finds about TE needs a CUDA
machine with TE (benchmarks/gpu/device_run.sh, step te_lora)."""

import importlib.util
import json
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu" / "te_lora.py"


@pytest.fixture(scope="module")
def mod():
    return SimpleNamespace(**runpy.run_path(str(SCRIPT), run_name="te_lora"))


def _row(mod, strategy="regather", recompute=True, err=1e-7, bound=1e-6, extra=None, rebuilt=True,
         decision="regather, input recomputed from the fused LayerNorm of the TE base"):
    rank_r = mod.S * mod.B * mod.R * 4
    extra = rank_r if extra is None else extra
    return {"strategy": strategy, "recompute": recompute, "decision": decision, "dx_err": err, "dx_bound": bound,
            "dx_ok": err <= bound, "extra_bytes": extra, "rank_r_bytes": rank_r, "rebuilt": rebuilt,
            "bytes_ok": (extra == rank_r) if rebuilt else None}


def test_verdicts(mod):
    assert mod.verdict([_row(mod), _row(mod, recompute=False, rebuilt=False)]) == mod.OK
    wrong = mod.verdict([_row(mod, err=0.9)])
    assert wrong.startswith("wrong: regather-recompute: dx error 0.9 > 1e-06"), wrong
    assert "LoRA over the frozen base 99 B" in mod.verdict([_row(mod, extra=99)])
    kept = mod.verdict([_row(mod, rebuilt=False, extra=10 ** 6, decision="regather, input kept (recompute asked: "
                             "recomputing the fused LayerNorm of the TE base does not reproduce the adapter input)")])
    assert kept.startswith(mod.OK + " where rebuilt; regather-recompute kept its input (recomputing"), kept


@pytest.mark.timeout(300)
def test_cpu_dry_run_on_the_te_model(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--cpu-dry-run"],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "te_lora.json").read_text())
    model = report["te_model"]
    assert model["verdict"] == "right gradients; recompute: rank-r bytes only", model
    assert len(model["rows"]) == 6 and all(r["dx_ok"] for r in model["rows"])
    assert all(r["rebuilt"] and r["bytes_ok"] for r in model["rows"] if r["recompute"])
    if not (torch.cuda.is_available() and importlib.util.find_spec("transformer_engine")):
        assert report["verdict"].startswith("not available: "), report["verdict"]
    assert f"te_lora: {report['verdict']}" in proc.stdout
    assert "| regather | on |" in (tmp_path / "te_lora.md").read_text()
