"""regather's torchtitan front end on other layouts, against torchtitan 0.3.0 on 2 gloo ranks (one
spawn, workers_titan.layouts_suite):

- qwen3 debugmodel (dense, QK norm, head_dim 128): bit-identical to torchtitan's LoRA, fewer bytes;
- what the front end does not change: sequence parallelism off, torchtitan's full activation
  checkpointing, eval and no_grad — torchtitan's own path with the reason, bit-identical;
- a model parallelized by hand (SequenceParallel, ColwiseParallel(input_layouts=Shard(1)),
  RowwiseParallel(output_layouts=Shard(1))) with regather.torchtitan.apply_lora; and one left
  unparallelized (plain weights: the classic path with its reason).
"""

import pytest

from regather.tools.cpu import torchtitan_models

if torchtitan_models.missing():
    pytest.skip(torchtitan_models.missing(), allow_module_level=True)

import torch
import workers_titan as W

from regather.tools.cpu.dist import run_ranks

KIB = 1024
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def suite():
    return run_ranks(W.layouts_suite, 2, timeout=240)


def _same(got, ref) -> bool:
    return torch.equal(got["loss"], ref["loss"]) and sorted(got["grads"]) == sorted(ref["grads"]) and all(
        torch.equal(got["grads"][n], g) for n, g in ref["grads"].items())


def test_qwen3_bit_identical_and_recompute_adds_only_rank_r(suite):
    for res in suite:
        frozen, titan = res["qwen3/frozen"]["saved"], res["qwen3/torchtitan"]
        for name in ("regather", "regather+recompute"):
            assert _same(res[f"qwen3/{name}"], titan), name
        assert (titan["saved"] - frozen, res["qwen3/regather"]["saved"] - frozen) == (4176 * KIB, 3664 * KIB)
        assert res["qwen3/regather+recompute"]["saved"] - frozen == 80 * KIB  # the ten rank-r tensors
        assert "recomputed from attention_norm" in res["qwen3/regather+recompute"]["decisions"][
            "layers.0.attention.qkv_linear.wqkv"]  # not qwen3's q_norm / k_norm beside it


def test_sequence_parallelism_off_is_torchtitans_path_with_the_reason(suite):
    from regather.torchtitan import reasons

    for res in suite:
        assert _same(res["nosp/regather"], res["nosp/torchtitan"])
        # w2's input rebuilt from the SwiGLU operands in this layout too (bit-identical above)
        assert res["nosp/torchtitan"]["saved"] - res["nosp/regather"]["saved"] == 2 * 2 * 128 * 768 * 4 // 2
        wqkv = res["nosp/regather"]["decisions"]["layers.0.attention.qkv_linear.wqkv"]
        assert wqkv.startswith(f"gather (asked regather: {reasons.NOT_THIS_GATHER})"), wqkv
    reasons_logged = [r["reason"] for r in suite[0]["nosp/regather"]["logs"]]
    assert reasons.NOT_THIS_GATHER in reasons_logged and len(reasons_logged) == len(set(reasons_logged))


def test_full_activation_checkpointing_is_torchtitans_path(suite):
    from regather.torchtitan import reasons

    for res in suite:
        assert _same(res["ac/regather"], res["ac/torchtitan"])
        assert res["ac/regather"]["saved"] == res["ac/torchtitan"]["saved"]
        assert all(reasons.IN_CHECKPOINT in d for d in res["ac/regather"]["decisions"].values())


def test_eval_and_no_grad_are_torchtitans_outputs(suite):
    from regather.torchtitan import reasons

    for res in suite:
        modes = res["modes"]
        assert torch.equal(modes["no_grad/regather"], modes["no_grad/torchtitan"])
        assert torch.equal(modes["eval/regather"], modes["eval/torchtitan"])
        assert all(reasons.NO_GRAD in d for d in modes["decisions"]["no_grad"].values())
        assert all(reasons.EVAL in d for d in modes["decisions"]["eval"].values())


def test_hand_parallelized_model(suite):
    from regather.torchtitan import reasons

    for res in suite:
        hand = res["hand"]
        ref, frozen = hand["gather"], hand["frozen"]["saved"]
        for name in ("regather", "regather+recompute"):
            got = hand[name]
            assert torch.equal(got["loss"], ref["loss"]) and torch.equal(got["dx"], ref["dx"]), name
            assert sorted(got["grads"]) == sorted(ref["grads"]) == sorted(
                f"layers.{i}.{w}.lora_{x}.weight" for i in range(2) for w in ("w1", "w2", "w3") for x in "ab")
            assert all(torch.equal(got["grads"][n], g) for n, g in ref["grads"].items()), name
        # ColwiseParallel gathers per linear: w1 and w3 each keep the gathered input under gather
        # (2 x 512 KiB per layer) and share the norm's output shard under regather (256 KiB)
        assert (ref["saved"] - frozen, hand["regather"]["saved"] - frozen) == (1840 * KIB, 1072 * KIB)
        assert hand["regather+recompute"]["saved"] - frozen == 816 * KIB  # the shard rebuilt from the norm
        assert hand["regather"]["decisions"]["layers.0.w1"] == "regather"
        assert hand["regather+recompute"]["decisions"]["layers.0.w1"] == "regather, input recomputed from norm"
        lowrank = hand["lowrank"]
        assert torch.allclose(lowrank["loss"], ref["loss"], rtol=1e-6, atol=0)
        assert hand["plain"]["layers.0.w1"] == f"gather (asked regather: {reasons.NOT_DTENSOR})"
