"""regather on torchtitan as it runs by default: the ``spmd_types`` backend (plain tensors, layouts
declared by the sharding configs), through torchtitan's own ``parallelize_llama`` with FSDP2 — on
the real torchtitan 0.3.0, llama3 debugmodel cut to 2 layers, TP2 + SP, 2 gloo ranks, LoRA r8 on
every linear, both LoRAs with their base frozen (torchtitan's with its #4267 applied:
regather.torchtitan.frozen). Bytes: the allocator's, alive at the end of the forward, over the
frozen model, per rank (the smallest of 5 steps). Three spawns by cost (workers_titan_ac.SPMD_GROUPS):
eager with every AC setting, compile, compile + AC.

Measured here on torch 2.14.1 (KiB over the frozen model): eager torchtitan's LoRA +1,872, regather
+1,360, regather + recompute +80, lowrank +1,360; SelectiveAC torchtitan +2,080, every regather
variant +0.1; FullAC +0.1 for all; compile (inductor) torchtitan +1,872, regather and lowrank
+1,360, regather + recompute +80; compile + FullAC and compile + SelectiveAC: regather runs
torchtitan's LoRA-A inside the checkpoint, at torchtitan's bytes (+0.0 and +1,568).

torchtitan 0.3.0's spmd_types with FSDP2 needs torch 2.14 (on 2.13 fully_shard refuses plain
parameters): skipped there with the reason; test_titan_frozen.py runs spmd_types on both.
"""

import pytest

from regather.tools.cpu import torchtitan_models

if torchtitan_models.missing():
    pytest.skip(torchtitan_models.missing(), allow_module_level=True)
if torchtitan_models.fsdp_unsupported("spmd_types"):
    pytest.skip(torchtitan_models.fsdp_unsupported("spmd_types"), allow_module_level=True)

import torch
import workers_titan_ac as W
from tests.harness.numerics import check_rounding
from tests.harness.spawn_groups import SpawnGroups

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1500)]
T = 2
B, S, H = W.H.B, W.H.S, W.H.DEFAULT.hidden
RANK_R_ONE = B * S * 8 * 4            # one rank-r tensor [b, s, r] fp32: 8 KiB
RANK_R_MODEL = 10 * RANK_R_ONE         # the ten of the model: 80 KiB
SHARD = B * S * H * 4 // T             # one sequence shard [b, s/t, h] fp32: 128 KiB
W2_INPUT = B * S * W.H.DEFAULT.ffn * 4 // T  # w2's input [b, s, ffn/t]: 384 KiB
LAYERS = W.H.LAYERS
# torchtitan's LoRA per layer: wqkv's and w1/w3's gathered inputs, w2's input, five rank-r tensors
TITAN_LORA = LAYERS * (2 * T * SHARD + W2_INPUT + 5 * RANK_R_ONE)   # 1,872 KiB
NOT_ACTIVATIONS = 1024  # the allocator also sees a few bytes that are no activation (80 B measured)
LORA = sorted(f"layers.{i}.{m}.lora_{ab}.weight" for i in range(LAYERS) for ab in "ab"
              for m in ("attention.qkv_linear.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
                        "feed_forward.w3"))


@pytest.fixture(scope="module")
def spawns():
    return SpawnGroups(W.spmd_group_suite, T, W.SPMD_GROUPS, timeout=600)


def _setting(spawns, setting: str) -> list[dict]:
    return [ranks[setting] for ranks in spawns.ranks(setting)]


def _over_frozen(runs: dict, name: str) -> int:
    return runs[name]["alive"] - runs["frozen"]["alive"]


def _plain(name: str) -> str:
    """A parameter name without the wrappers' segments (checkpoint_wrapper's, torch.compile's)."""
    return ".".join(p for p in name.split(".") if p not in ("_checkpoint_wrapped_module", "_orig_mod"))


def _bit_identical(got: dict, want: dict, what: str) -> None:
    assert torch.equal(got["loss"], want["loss"]), what
    assert got["grads"].keys() == want["grads"].keys(), what
    for n, g in want["grads"].items():
        assert torch.equal(got["grads"][n], g), (what, n)


def _within_rounding(got: dict, titan: dict, fp64: dict, what: str) -> None:
    """``got``'s LoRA gradients against fp64, bounded by torchtitan's own error in the same setting."""
    ref64 = {_plain(n): g for n, g in fp64["grads"].items()}
    assert {_plain(n) for n in got["grads"]} == ref64.keys(), what
    for n, g in got["grads"].items():
        check_rounding(g.double(), titan["grads"][n].double(), ref64[_plain(n)], f"{what} {n}", dtype=torch.float32)


def test_eager_every_strategy_bit_identical_to_torchtitans_lora_below_its_bytes(spawns):
    fp64 = _setting(spawns, "fp64")
    for rank, runs in enumerate(_setting(spawns, "none")):
        for name in W.SPMD_SUITE["none"]:  # the base stays frozen through parallelize and FSDP
            want = LORA if name != "frozen" else []
            assert [_plain(n) for n in runs[name]["trainable"]] == want, (rank, name)
        for name in ("gather", "regather", "regather-recompute"):
            _bit_identical(runs[name], runs["torchtitan"], f"{rank} {name}")
        # lowrank sums dA over each rank's rows and reduce-scatters dmid: other sums, same maths
        for name in ("lowrank", "lowrank-recompute"):
            _within_rounding(runs[name], runs["torchtitan"], fp64[rank]["torchtitan"], name)
        over = {name: _over_frozen(runs, name) for name in W.SPMD_SUITE["none"][1:]}
        titan = over["torchtitan"]
        assert 0 <= titan - TITAN_LORA < NOT_ACTIVATIONS, over
        assert over["gather"] == titan
        # per layer: wqkv and the FFN (w1, w3: one storage) keep their shard instead of the gathered input
        for name in ("regather", "lowrank"):
            assert titan - over[name] == LAYERS * 2 * SHARD, (name, over)
        for name in ("regather-recompute", "lowrank-recompute"):  # the rank-r tensors, nothing else
            assert titan - over[name] == TITAN_LORA - RANK_R_MODEL, (name, over)
        decisions = runs["regather-recompute"]["decisions"]
        assert len(decisions) == 10
        assert decisions["layers.0.feed_forward.w1"] == "regather, input recomputed from ffn_norm"
        assert decisions["layers.1.attention.qkv_linear.wqkv"] == "regather, input recomputed from attention_norm"
        assert decisions["layers.0.feed_forward.w2"].endswith("input recomputed from the SwiGLU multiply")


@pytest.mark.parametrize("setting", ["selective", "full"])
def test_activation_checkpointing_every_strategy_bit_identical_at_no_new_bytes(spawns, setting):
    for runs in _setting(spawns, setting):
        titan = _over_frozen(runs, "torchtitan")
        for name in W.SPMD_SUITE[setting][2:]:
            _bit_identical(runs[name], runs["torchtitan"], f"{setting} {name}")  # the same ops, recomputed
            ours = _over_frozen(runs, name)
            assert ours <= RANK_R_MODEL, (setting, name, ours, titan)  # the frozen model's own cache unchanged
        if setting == "selective":  # torchtitan's LoRA matmuls enter the every-second-matmul count
            assert titan > 1024 * 1024
            assert max(_over_frozen(runs, n) for n in W.SPMD_SUITE[setting][2:]) <= 0.05 * titan


def test_compile_fullgraph_every_strategy_traces_below_torchtitans_bytes(spawns):
    fp64 = _setting(spawns, "fp64")
    for rank, runs in enumerate(_setting(spawns, "compile")):
        titan = runs["torchtitan"]
        _bit_identical(runs["regather"], titan, "regather")  # the same GEMMs on the same operands
        # lowrank: other sums; + recompute: dA's input rebuilt by another Inductor kernel
        for name in ("lowrank", "regather-recompute"):
            assert torch.equal(runs[name]["loss"], titan["loss"]), name
            _within_rounding(runs[name], titan, fp64[rank]["torchtitan"], name)
        for name in ("regather", "lowrank"):
            assert _over_frozen(runs, name) <= _over_frozen(runs, "torchtitan") - LAYERS * 2 * SHARD + RANK_R_ONE, name
            assert runs[name]["decisions"]["layers.0.feed_forward.w1"] == name
        ours = _over_frozen(runs, "regather-recompute")
        assert ours <= RANK_R_MODEL + RANK_R_ONE, ours
        for path, decision in runs["regather-recompute"]["decisions"].items():
            assert "recomputed from what the backward reads anyway" in decision, (path, decision)


@pytest.mark.parametrize("setting", ["compile+full", "compile+selective"])
def test_compile_with_activation_checkpointing_runs_at_torchtitans_bytes(spawns, setting):
    """torchtitan's 405B (FullAC) and low-precision 8B (SelectiveAC) configs compile each
    checkpointed block: torchtitan's LoRA runs there on this torch; regather's recipe runs its
    LoRA-A inside the checkpoint (what a compiled block cannot see, the model tells it), bit for bit."""
    for runs in _setting(spawns, setting):
        ours, titan = runs["regather-recompute"], runs["torchtitan"]
        _bit_identical(ours, titan, setting)
        assert abs(ours["alive"] - titan["alive"]) < NOT_ACTIVATIONS, (ours["alive"], titan["alive"])
        for path, decision in ours["decisions"].items():
            assert "running inside activation checkpointing" in decision, (path, decision)
