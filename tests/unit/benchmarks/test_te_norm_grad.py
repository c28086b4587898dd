"""benchmarks/gpu/te_norm_grad.py (does TE add the gradient of its returned gathered LayerNorm output?)
on CPU: the classification on plain-torch gradients, the stand-in run of the whole comparison on a
real one-rank gloo group, and "not available" with its reason where TE or CUDA is missing. What it
finds about TE needs a CUDA machine with TE (benchmarks/gpu/device_run.sh)."""

import importlib.util
import json
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu" / "te_norm_grad.py"


@pytest.fixture(scope="module")
def mod():
    """The script's functions (run as a file: benchmarks/ is no package)."""
    return SimpleNamespace(**runpy.run_path(str(SCRIPT), run_name="te_norm_grad"))


@pytest.fixture(scope="module")
def grads(mod):
    t = mod.inputs("cpu")
    exact = mod.plain_grads({k: v.double() for k, v in t.items()})
    same = mod.plain_grads(t)
    return exact, same


@pytest.mark.parametrize("rule", ["added", "dropped"])
def test_each_plain_torch_gradient_is_recognised(mod, grads, rule):
    exact, same = grads
    r = mod.classify(same[rule].clone(), exact, same)
    assert r["verdict"] == mod.VERDICTS[rule] == f"gradient into the gathered ln_out {rule}", r
    assert r["nearer"] == rule and r["within_rounding_bound"], r
    # the dropped term is O(1) of the gradient: far beyond any rounding bound
    assert r["separation"] > 100 * max(r["bounds"].values()), r


def test_near_one_reference_but_outside_the_bound_says_so(mod, grads):
    exact, same = grads
    got = same["added"] + 0.01 * (exact["dropped"] - exact["added"]).float()
    r = mod.classify(got, exact, same)
    assert r["verdict"].startswith(mod.VERDICTS["added"] + " (outside the rounding bound: error "), r
    assert not r["within_rounding_bound"]


@pytest.mark.parametrize("case", ["halfway", "negated", "nan", "no separation"])
def test_anything_else_is_inconclusive(mod, grads, case):
    exact, same = grads
    if case == "halfway":
        got = 0.5 * (same["added"] + same["dropped"])
    elif case == "negated":
        got = -same["added"]
    elif case == "nan":
        got = same["added"].clone()
        got[0, 0, 0] = float("nan")
    else:
        got, exact, same = same["added"], {"added": exact["added"], "dropped": exact["added"]}, \
            {"added": same["added"], "dropped": same["added"]}
    verdict = mod.classify(got, exact, same)["verdict"]
    assert verdict.startswith("inconclusive: "), verdict
    expected = {"nan": "not finite", "no separation": "differ by only"}.get(case, "against the added reference")
    assert expected in verdict, verdict


def test_bad_input_names_the_values(mod, grads):
    exact, same = grads
    with pytest.raises(ValueError, match=r"shapes differ: got \(4,\)"):
        mod.classify(torch.zeros(4), exact, same)
    with pytest.raises(ValueError, match="need keys 'added' and 'dropped', got \\['added'\\]"):
        mod.classify(same["added"], {"added": exact["added"]}, same)


def test_markdown_states_the_verdict_and_the_numbers(mod, grads):
    exact, same = grads
    report = {"verdict": "not available: no CUDA device", "check": "the check", "note": mod.TE_SOURCE_NOTE,
              "stand_in": {"dropped": mod.classify(same["dropped"], exact, same)}}
    md = mod.markdown(report)
    assert "**Verdict: not available: no CUDA device**" in md
    assert "| stand-in (dropped, dry run) |" in md and "gradient into the gathered ln_out dropped |" in md
    assert "ce0b46c4d" in md


def _run(tmp_path, *args):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), *args], capture_output=True,
                          text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / "te_norm_grad.json").read_text()), proc.stdout


@pytest.mark.timeout(300)
def test_cpu_dry_run_classifies_both_stand_ins_on_a_one_rank_group(tmp_path):
    report, stdout = _run(tmp_path, "--cpu-dry-run")
    for rule in ("dropped", "added"):
        r = report["stand_in"][rule]
        assert r["verdict"] == f"gradient into the gathered ln_out {rule}" and r["within_rounding_bound"], r
        assert r["ln_out_requires_grad"] and set(r["forward_errors"]) == {"ln_out", "out"}, r
    assert f"te_norm_grad: {report['verdict']}" in stdout
    assert (tmp_path / "te_norm_grad.md").read_text().startswith("## Transformer Engine")


@pytest.mark.timeout(300)
def test_without_te_or_cuda_it_reports_not_available_with_the_reason(tmp_path):
    if torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("CUDA and transformer_engine here: the script would run for real")
    report, _ = _run(tmp_path)
    assert report["verdict"].startswith("not available: "), report
    if not torch.cuda.is_available():
        assert "no CUDA device" in report["verdict"]
    if importlib.util.find_spec("transformer_engine") is None:
        assert "transformer_engine.pytorch does not import (ModuleNotFoundError" in report["verdict"]
    assert "stand_in" not in report and "errors" not in report
