"""Expert adapters through megatron's ``dist_checkpointing`` across expert layouts (issue 15):
saved at TP2 x EP2 (ETP1), loaded strict at TP2 x EP1 x ETP2 (the experts split over the TP ranks
instead of spread over them) and at TP2 x EP2 x ETP2 (4 ranks), for SequentialMLP experts and
grouped experts with one shared adapter or an adapter per expert (SwiGLU: gate and up halves).

Every parameter (base and LoRA), reassembled into its full tensor from the ranks, equals what was
saved, bit for bit; the load side started from other values, so a key that did not load fails.
"""

from __future__ import annotations

import functools

import pytest
import torch
from workers_moe_ckpt import KINDS, load_side, save_side

from regather.tools.cpu.dist import run_ranks
from regather.tools.cpu.moe_models import assemble

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]
SAVE = (2, 2, 1)  # tp, ep, etp
LOADS = {"tp2_ep1_etp2": (2, 1, 2), "tp2_ep2_etp2": (2, 2, 2)}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("moe_ckpt"))


@pytest.fixture(scope="module")
def saved(root):
    tp, ep, etp = SAVE
    return run_ranks(save_side, max(tp, ep * etp), root, tp, ep, etp, timeout=240)


@functools.cache
def _load(root, layout):
    tp, ep, etp = LOADS[layout]
    return run_ranks(load_side, max(tp, ep * etp), root, tp, ep, etp, timeout=240)


@pytest.mark.parametrize("layout", LOADS)
@pytest.mark.parametrize("kind", KINDS)
def test_saved_at_ep2_loads_strict_elsewhere(root, saved, layout, kind):
    want = assemble([r[kind] for r in saved])
    per_rank = _load(root, layout)
    for r in per_rank:
        assert r[kind]["unexpected"] == [] and r[kind]["missing"] == [], r[kind]
    before = assemble([r[kind]["before"] for r in per_rank])
    got = assemble([r[kind]["after"] for r in per_rank])
    assert got.keys() == want.keys()
    lora = [n for n in want if ".adapter." in n and ".experts." in n]
    assert lora, "no expert adapter in the checkpoint"
    for n in want:
        assert not torch.equal(before[n], want[n]), f"{n}: the load side started from the saved values"
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, msg=lambda m: f"{kind} {layout} {n}: {m}")
