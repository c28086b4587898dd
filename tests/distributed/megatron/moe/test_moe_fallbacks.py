"""Expert fc1 inputs under ``recompute_adapter_inputs`` where they cannot come from the router's input
(issue 16): every refusal that runs on CPU, on megatron's own MoE layers (0.16.1 and 0.19.2).

Each case trains the gather path and the asking variant (``regather-rc-rd``: re-dispatch asked for
SequentialMLP's per-expert LoRA-A; ``regather-rc``: grouped experts' shared LoRA-A) two SGD steps at
TP2+SP x EP2 and checks that the expert fc1 adapters concerned keep their input with the reason
``regather.decisions`` gives, that the others still rebuild theirs, that numerics are the gather
path's bit for bit, and that a model logs each reason once. Refusals that need a GPU stack (the
flex / DeepEP dispatcher, fp8 padding, Transformer Engine's selective ``layernorm`` recompute) are
unit-tested on their configuration rules (tests/unit/megatron/moe/test_expert_inputs.py).
"""

from __future__ import annotations

import pytest
import torch
from tests.harness.spawn_groups import SpawnGroups
from workers_moe import Case, case_worker

from regather.megatron.dense.eligibility import IN_CHECKPOINT
from regather.megatron.moe.inputs import PREDISPATCH, REDISPATCH
from regather.tools.cpu.moe_models import TinyMoE
from regather.tools.estimate import ROUTER_KEEPS_NOTHING  # estimate's and doctor's sentence: the adapters' own

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

RD = ("gather", "regather-rc-rd")
TOP1 = (("moe_router_pre_softmax", True),)
ROUTE_CHECK = "sending the router's input along this forward's route does not reproduce the dispatched tokens"

# name -> (case, {layer: expected reason (None: rebuilt)} for every MoE layer)
CASES = {
    # frozen embeddings, no adapter before layer 0's MLP: its MoE input needs no gradient, so the router
    # keeps nothing there; layer 1's input comes from layer 0's adapters and is rebuilt
    "router_keeps_nothing": (Case(ep=2, etp=1, targets=("linear_fc1", "linear_fc2"), variants=RD),
                             {0: ROUTER_KEEPS_NOTHING, 1: None}),
    "router_keeps_nothing_grouped": (Case(ep=2, etp=1, shape=TinyMoE(experts="grouped"),
                                          targets=("linear_fc1", "linear_fc2"), variants=("gather", "regather-rc")),
                                     {0: ROUTER_KEEPS_NOTHING, 1: None}),
    "probs_on_input": (Case(ep=2, etp=1, shape=TinyMoE(topk=1), model=TOP1 + (("moe_apply_probs_on_input", True),),
                            variants=RD),
                       dict.fromkeys((0, 1), "moe_apply_probs_on_input=True: the experts scale their input by the probs before " "linear_fc1")),
    "drop_and_pad": (Case(ep=2, etp=1, model=(("moe_expert_capacity_factor", 1.0),
                                              ("moe_pad_expert_input_to_capacity", True)), variants=RD),
                     dict.fromkeys((0, 1), "capacity drop-and-pad (moe_pad_expert_input_to_capacity=True) pads each expert's tokens")),
    "moe_recompute": (Case(ep=2, etp=1, model=(("recompute_granularity", "selective"), ("recompute_modules", ["moe"])),
                           variants=RD),
                      dict.fromkeys((0, 1), IN_CHECKPOINT)),
    # rank 1's route check fails (test-only fault): both ranks keep their inputs, so they keep sending alike
    "route_check_fails_on_one_rank": (Case(ep=2, etp=1, fault_rank=1, variants=RD),
                                      dict.fromkeys((0, 1), ROUTE_CHECK)),
}
RUNS = SpawnGroups(case_worker, 2, [list(CASES)], {n: c for n, (c, _) in CASES.items()}, timeout=300)


def ranks(name):
    return [r[name] for r in RUNS.ranks(name)]


def _layer(path: str) -> int:
    return int(path.split("decoder.layers.")[1].split(".")[0])


@pytest.mark.parametrize("name", CASES)
def test_expert_fc1_keeps_its_input_with_the_reason(name):
    case, expected = CASES[name]
    asked = case.variants[1]
    rebuilt = PREDISPATCH if case.shape.experts == "grouped" else REDISPATCH
    for rank, res in enumerate(ranks(name)):
        fc1 = {p: d for p, d in res[asked]["decisions"].items() if ".experts." in p and p.endswith("linear_fc1")}
        assert {_layer(p) for p in fc1} == set(expected), fc1
        for p, d in fc1.items():
            why = expected[_layer(p)]
            tail = f", input recomputed from {rebuilt}" if why is None else f", input kept (recompute asked: {why}"
            assert tail in d, (rank, p, d)
            if why == ROUTE_CHECK:  # each rank says whose check failed
                assert ("on this rank" if rank == case.fault_rank else "on another rank") in d, d


@pytest.mark.parametrize("name", CASES)
def test_numerics_are_the_gather_paths(name):
    """A kept input changes nothing: bit-identical to gather (where some layers still rebuild from the
    router, the re-dispatched ones are bit-identical too; a shared LoRA-A before the dispatch is not)."""
    case, expected = CASES[name]
    asked = case.variants[1]
    for res in ranks(name):
        ref, run = res["gather"], res[asked]
        if case.shape.experts == "grouped" and None in expected.values():
            torch.testing.assert_close(torch.tensor(run["loss"]), torch.tensor(ref["loss"]), rtol=1e-5, atol=0)
            continue
        assert run["loss"] == ref["loss"], name
        for key in ("grads", "final"):
            for n, t in ref[key].items():
                torch.testing.assert_close(run[key][n], t, rtol=0, atol=0, msg=lambda m: f"{name} {key} {n}: {m}")


@pytest.mark.parametrize("name", CASES)
def test_each_reason_logged_once(name):
    case, expected = CASES[name]
    for res in ranks(name):
        run = res[case.variants[1]]
        keep = [(w, r) for _, w, r, _ in run["fallbacks"] if w.startswith("recompute_adapter_inputs")]
        assert len(keep) == len(set(keep)), keep
        for why in {w for w in expected.values() if w is not None and w != IN_CHECKPOINT}:
            lines = [r for _, w, r, _ in run["fallbacks"] if why in r]
            assert len(lines) == 1, (why, lines)
