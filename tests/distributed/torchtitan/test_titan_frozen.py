"""Frozen stays frozen: after ``parallelize``, every parameter regather's converter froze is still
frozen and out of torchtitan's optimizer, on every backend — where torchtitan 0.3.0's own LoRA, on
its default ``spmd_types`` backend, makes its whole base trainable again
(``Module._spmd_distribute_state`` re-registers each sharded state as ``nn.Parameter(tensor)``;
torchtitan #4267, after 0.3.0). Real torchtitan 0.3.0, llama3 debugmodel cut to 2 layers, TP2 + SP,
2 gloo ranks, one spawn (workers_titan.frozen_suite). Runs on torch 2.13 and 2.14: spmd_types
through ``Module.parallelize`` on both, through parallelize_llama with FSDP2 where torch runs it
(2.14); there regather's recipe is also bit-identical to torchtitan's LoRA with #4267 applied.
"""

import pytest

from regather.tools.cpu import torchtitan_models

if torchtitan_models.missing():
    pytest.skip(torchtitan_models.missing(), allow_module_level=True)

import torch
import workers_titan as W

from regather.tools.cpu.dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
LORA = sorted(f"layers.{i}.{m}.lora_{ab}.weight" for i in range(W.H.LAYERS) for ab in "ab"
              for m in ("attention.qkv_linear.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
                        "feed_forward.w3"))
ALL = 37  # the debugmodel's 17 parameters cut to 2 layers, and the 20 LoRA weights


@pytest.fixture(scope="module")
def suite():
    return run_ranks(W.frozen_suite, 2, timeout=240)


def test_torchtitans_lora_trains_its_base_again_on_spmd_types_regathers_stays_frozen(suite):
    for res in suite:
        titan, ours = res["spmd_types"]["torchtitan-0.3.0"], res["spmd_types"]["regather"]
        assert len(titan["trainable"]) == titan["optimized"] == ALL  # torchtitan 0.3.0: the whole base
        assert "layers.0.attention.qkv_linear.wqkv.weight" in titan["with_grad"]
        assert ours["trainable"] == ours["with_grad"] == LORA and ours["optimized"] == len(LORA)
        fsdp = res.get("spmd_types+fsdp")
        if fsdp is not None:  # the same through parallelize_llama: FSDP2 shards what parallelize left trainable
            assert len(fsdp["torchtitan-0.3.0"]["trainable"]) == ALL
            assert fsdp["regather"]["trainable"] == fsdp["regather"]["with_grad"] == LORA
            assert fsdp["regather"]["optimized"] == len(LORA)


def test_partial_dtensor_keeps_both_frozen(suite):
    for res in suite:
        for name in ("torchtitan-0.3.0", "regather"):
            got = res["partial_dtensor"][name]
            assert got["trainable"] == got["with_grad"] == LORA and got["optimized"] == len(LORA), name


def test_spmd_types_without_fsdp_bit_identical_to_torchtitans_lora_with_its_fix(suite):
    """spmd_types through Module.parallelize alone (what runs on torch 2.13): regather's recipe
    gives torchtitan's loss and LoRA gradients (each rank's, TP-partial where torchtitan's are:
    without FSDP nothing reduces them) bit for bit."""
    for res in suite:
        ref, ours = res["spmd_types"]["torchtitan-4267"], res["spmd_types"]["regather"]
        assert ref["trainable"] == LORA
        assert torch.equal(ours["loss"], ref["loss"])
        assert ours["grads"].keys() == ref["grads"].keys() == set(LORA)
        for n, g in ref["grads"].items():
            assert torch.equal(ours["grads"][n], g), n
