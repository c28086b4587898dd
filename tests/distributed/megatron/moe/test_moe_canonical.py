"""``CanonicalLoRA`` on megatron-core's MoE layers (issue 15): the tiny SwiGLU MoE GPT of
test_moe.py (SequentialMLP experts, every layer MoE) with Bridge's canonical targets — q, k, v,
proj, fc1 gate and up, fc2 — on 2 gloo ranks, two SGD steps from the same full weights.

- each expert's gated ``linear_fc1`` gets a gate and an up adapter of its own (as a dense fc1),
  its ``linear_fc2`` one adapter, Bridge's names;
- regather and regather + ``recompute_adapter_inputs`` are bit-exact against the canonical
  gather path (losses, LoRA gradients, final weights), the expert adapters take the
  dispatcher's path with the expert reason;
- the gather path matches the same model at TP = EP = ETP = 1 (test_moe.py's tolerance).
"""

from __future__ import annotations

import pytest
import torch
from tests.harness.spawn_groups import SpawnGroups
from workers_moe import Case, case_worker, reference_worker

from regather.megatron.dense.eligibility import EXPERT_REASON
from regather.tools.cpu.moe_models import TinyMoE, assemble

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

VARIANTS = ("canonical-gather", "canonical-regather", "canonical-regather-rc")
CASES = {
    "canonical_gated_tp2_ep2": Case(ep=2, etp=1, shape=TinyMoE(gated=True), variants=VARIANTS),
    "canonical_gated_tp2_etp2": Case(ep=1, etp=2, shape=TinyMoE(gated=True, dispatcher="allgather"),
                                     variants=VARIANTS),
}
RUNS = SpawnGroups(case_worker, 2, [list(CASES)], CASES, timeout=240)
REFERENCE = SpawnGroups(reference_worker, 1, [list(CASES)], CASES, timeout=240)
REFERENCE_TOL = 2e-5  # test_moe.py's: fp32 summation orders of the layouts, of the largest entry


def ranks(name):
    return [r[name] for r in RUNS.ranks(name)]


def _rel(got, ref):
    got, ref = got.double(), ref.double()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("name", CASES)
def test_expert_fc1_gets_gate_and_up_adapters(name):
    for res in ranks(name):
        names = res["canonical-gather"]["param_names"]
        for part in ("adapter_gate", "adapter_up"):
            assert [n for n in names if f"local_experts.0.linear_fc1.adapter.{part}.linear_in.weight" in n], part
        assert [n for n in names if n.endswith("local_experts.0.linear_fc2.adapter.linear_in.weight")]
        assert not [n for n in names if "router" in n and ".adapter" in n]


@pytest.mark.parametrize("name", CASES)
def test_canonical_variants_match_canonical_gather(name):
    for rank, res in enumerate(ranks(name)):
        ref = res["canonical-gather"]
        for v in VARIANTS[1:]:
            run, what = res[v], f"{name} rank {rank} {v}"
            assert run["loss"] == ref["loss"], what
            for key in ("grads", "final"):
                assert run[key].keys() == ref[key].keys()
                for n, t in ref[key].items():
                    torch.testing.assert_close(run[key][n], t, rtol=0, atol=0, msg=lambda m: f"{what} {key} {n}: {m}")


@pytest.mark.parametrize("name", CASES)
def test_canonical_expert_decisions(name):
    for res in ranks(name):
        for v in VARIANTS[1:]:
            decisions = res[v]["decisions"]
            experts = {p: d for p, d in decisions.items() if ".experts." in p}
            assert any(p.endswith("linear_fc1_gate") for p in experts), sorted(experts)
            for p, d in experts.items():
                assert d.startswith(f"gather (asked regather: {EXPERT_REASON})"), (v, p, d)
            dense = [d for p, d in decisions.items() if p.endswith("self_attention.linear_q")]
            assert dense and all(d.startswith("regather") for d in dense), dense


@pytest.mark.parametrize("name", CASES)
def test_canonical_matches_single_rank_reference(name):
    per_rank = ranks(name)
    ref = REFERENCE.ranks(name)[0][name]
    torch.testing.assert_close(torch.tensor(per_rank[0]["canonical-gather"]["loss"]), torch.tensor(ref["loss"]),
                               rtol=1e-5, atol=0)
    got = assemble([r["canonical-gather"]["first_grads"] for r in per_rank])
    want = assemble([ref["first_grads"]])
    assert got.keys() == want.keys()
    assert [n for n in want if ".experts." in n and "adapter_gate" in n]
    for n in want:
        assert want[n].abs().max() > 0, f"{n}: the reference gradient is zero (nothing compared)"
        assert _rel(got[n], want[n]) <= REFERENCE_TOL, (name, n, _rel(got[n], want[n]))
