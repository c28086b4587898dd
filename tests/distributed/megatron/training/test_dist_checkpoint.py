"""megatron-core distributed checkpoints (``dist_checkpointing.save`` / ``load``) of regather models.

Real dist_checkpointing (default ``torch_dist`` strategies), real gloo ranks, real GPTModel
(2 layers, h=64, ffn=128, 4 heads, vocab 256), LoRA r=16 on all four targets with non-zero
LoRA-B. Checkpoints are written at TP=2 and read back at TP=2, TP=1 and TP=4 (three spawns,
workers_ckpt.py); ``tests.harness.megatron_ckpt`` makes dist_checkpointing run on CPU.

Parity:
- same TP size: bit-exact. A model loaded under strategy ``s_load`` is compared with the
  *saving* model switched to ``s_load`` (same weights, same GEMMs).
- other TP sizes: fp32 ``rtol=atol=1e-5`` against the saving model. The weights are the same,
  but the GEMMs are split differently and row-parallel partial sums are reduced over another
  number of ranks, so the logits differ by rounding (measured: max 2.1e-7 at TP=1, 1.8e-7 at
  TP=4 for the plain GPT, logits of order 1).
- adapter weights (TP-gathered ``A [r, h]``, ``B [o, r]``) and per-rank shards: always exact.

A gated (SwiGLU) GPT too: ``linear_fc1``'s LoRA-B is ``[gate_i; up_i]`` on rank ``i``, so its
global ``[2 * ffn, r]`` is all gate rows then all up rows (megatron's SwiGLU sharded factory, as
for the base fc1 weight and in Megatron Bridge), not the ranks' shards one after another.
"""

import pytest
import torch
from workers_ckpt import FC1, GATED_PAIRS, GATED_STRATEGIES, RANK_R, SHAPE, STRATEGIES, load_side, save_side

from regather.tools.cpu.dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

PAIRS = [f"{a}->{b}" for a in STRATEGIES for b in STRATEGIES]
# Other TP size: same weights, other GEMM split and reduction order (see module docstring).
RESHARD = dict(rtol=1e-5, atol=1e-5)
L, H, FFN, QKV = SHAPE.num_layers, SHAPE.hidden_size, SHAPE.ffn_hidden_size, 3 * SHAPE.hidden_size


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dist-ckpt"))


@pytest.fixture(scope="module")
def saved(root):
    return run_ranks(save_side, 2, root, timeout=180)


@pytest.fixture(scope="module")
def reloaded(saved, root):
    """TP size -> rank 0's results of reloading the TP=2 checkpoints there."""
    return {1: run_ranks(load_side, 1, root, timeout=90)[0],
            4: run_ranks(load_side, 4, root, timeout=180)[0]}


def case(res: dict, name: str):
    value = res[name]
    if isinstance(value, dict) and "error" in value:
        pytest.fail(f"case {name!r} raised in the ranks:\n{value['error']}", pytrace=False)
    return value


def assert_same_adapters(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for path in want:
        for g, w, what in zip(got[path], want[path], ("A", "B")):
            assert torch.equal(g, w), f"{path} LoRA-{what} differs (max {(g - w).abs().max():.3g})"


# -- plain GPT (no LoRA): dist_checkpointing itself on CPU ---------------------------------------

def test_plain_gpt_saved_at_tp2_loads_at_tp1_tp2_tp4(saved, reloaded):
    plain = case(saved[0], "plain")
    assert not torch.equal(plain["before_load"], plain["saved"])  # the load changed the model
    assert torch.equal(plain["loaded"], plain["saved"])
    for tp in (1, 4):
        torch.testing.assert_close(case(reloaded[tp], "plain"), plain["saved"], **RESHARD)


# -- LoRA GPT: every strategy, every saved/loaded strategy pair ----------------------------------

@pytest.mark.parametrize("pair", PAIRS)
def test_lora_checkpoint_reloads_at_tp2_bit_exact(saved, pair):
    s_saved, s_load = pair.split("->")
    saver = case(saved[0], "lora_saved")[s_saved]
    got = case(saved[0], "lora_loaded")[pair]
    assert_same_adapters(got["adapters"], saver["adapters"])
    assert torch.equal(got["logits"], saver["logits"][s_load])


@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("pair", PAIRS)
def test_lora_checkpoint_reshards_to_tp1_and_tp4(saved, reloaded, tp, pair):
    s_saved, s_load = pair.split("->")
    saver = case(saved[0], "lora_saved")[s_saved]
    got = case(reloaded[tp], "lora_loaded")[pair]
    assert_same_adapters(got["adapters"], saver["adapters"])
    torch.testing.assert_close(got["logits"], saver["logits"][s_load], **RESHARD)


# -- what the checkpoint declares ----------------------------------------------------------------

# base layer -> (linear_in: global [r, h_in], split axis), (linear_out: global [o, r], split axis);
# megatron Bridge's layouts (its linear_in / linear_out are megatron Column/RowParallelLinear).
LAYOUT = {
    "self_attention.linear_qkv": (((RANK_R, H), 0), ((QKV, RANK_R), 0)),
    "self_attention.linear_proj": (((RANK_R, H), 1), ((H, RANK_R), 0)),
    "mlp.linear_fc1": (((RANK_R, H), 0), ((FFN, RANK_R), 0)),
    "mlp.linear_fc2": (((RANK_R, FFN), 1), ((H, RANK_R), 0)),
}


def _adapter_entries(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if ".adapter." in k}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sharded_metadata_follows_bridge_layout(saved, strategy):
    T = 2
    for rank in range(T):
        meta = case(saved[rank], "metadata")
        lora, plain = meta[strategy], meta["plain"]
        # the example of the issue, spelled out
        qkv_a = lora["decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight"]
        assert qkv_a["key"] == "decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight"
        assert qkv_a["global_shape"] == (2, 16, 64) and qkv_a["local_shape"] == (8, 64)
        assert qkv_a["global_offset"] == (0, 8 * rank, 0)
        for layer in range(L):
            for base, ((a_shape, a_axis), (b_shape, b_axis)) in LAYOUT.items():
                prefix = f"decoder.layers.{layer}.{base}"
                base_w = lora[f"{prefix}.weight"]
                for part, shape, axis in (("linear_in", a_shape, a_axis), ("linear_out", b_shape, b_axis)):
                    e = lora[f"{prefix}.adapter.{part}.weight"]
                    where = f"{prefix}.adapter.{part}.weight (rank {rank}, {strategy})"
                    assert e["type"] == "ShardedTensor", where
                    assert e["key"] == f"decoder.layers.{base}.adapter.{part}.weight", where
                    assert e["global_shape"] == (L, *shape), where
                    local = list(shape)
                    local[axis] //= T
                    offset = [0, 0]
                    offset[axis] = rank * local[axis]
                    assert e["local_shape"] == tuple(local) and e["prepend_axis_num"] == 1, where
                    assert e["global_offset"] == (layer, *offset), where
                    frag = [1, 1]
                    frag[axis] = T
                    assert e["axis_fragmentations"] == (L, *frag), where
                    # TP ranks hold different shards, each its main replica (DP=1), like the base
                    assert e["replica_id"] == base_w["replica_id"], where
                    assert all(x == 0 for x in e["replica_id"]), where
        # the frozen base keeps megatron's own entries and keys (no "to_wrap.")
        base_part = {k: v for k, v in lora.items() if k not in _adapter_entries(lora)}
        assert base_part == plain
        assert not any("to_wrap" in k or "to_wrap" in str(v["key"]) for k, v in lora.items())
        # every strategy declares the same checkpoint (lowrank's replicated LoRA-A included)
        assert lora == meta["gather"]


# -- attention-only LoRA: each rank gets its own halves back -------------------------------------

@pytest.mark.parametrize("strategy", ["regather", "lowrank"])
def test_attention_only_checkpoint_gives_each_rank_its_halves(saved, strategy):
    per_rank = [case(saved[rank], "attention_only")[strategy] for rank in range(2)]
    assert sorted(per_rank[0]["saved"]) == [f"decoder.layers.{i}.self_attention.{n}" for i in range(L)
                                            for n in ("linear_proj", "linear_qkv")]
    for rank, r in enumerate(per_rank):
        for path, tensors in r["saved"].items():
            for what, want in tensors.items():
                got, before = r["loaded"][path][what], r["before_load"][path][what]
                assert not torch.equal(before, want), f"rank {rank} {path} {what}: load was a no-op"
                assert torch.equal(got, want), f"rank {rank} {path} {what}: not this rank's shard"
    # the halves differ between the ranks, so holding rank 0's would have failed above
    for path, tensors in per_rank[0]["saved"].items():
        for what in tensors:
            assert not torch.equal(per_rank[0]["saved"][path][what], per_rank[1]["saved"][path][what])


# -- a plain megatron checkpoint into a LoRA model -----------------------------------------------

@pytest.mark.parametrize("tp", [2, 1, 4])
def test_pretrained_plain_checkpoint_loads_into_lora_model(saved, reloaded, tp):
    res = saved[0] if tp == 2 else reloaded[tp]
    got = case(res, "pretrained")
    for s in STRATEGIES:
        # LoRA-B is zero: the wrapped model computes the unwrapped one exactly
        assert torch.equal(got[s]["logits"], got["plain"]), s
        assert_same_adapters(got[s]["adapters"], got[s]["adapters_before"])  # base only
    if tp == 2:
        plain_meta = case(saved[0], "metadata")["plain"]
        assert got["loaded_keys"] == sorted(plain_meta)  # every base key, nothing else
    missing, unexpected = got["errors"]["missing"], got["errors"]["unexpected"]
    assert missing is not None and got["removed_key"] in missing, missing
    assert unexpected is not None and "decoder.layers.0.bogus.weight" in unexpected, unexpected


# -- plain state_dict / load_state_dict(strict=True) ---------------------------------------------

@pytest.mark.parametrize("pair", PAIRS)
def test_plain_state_dict_roundtrip_strict(saved, pair):
    s_src = pair.split("->")[0]
    res = case(saved[0], "plain_state_dict")
    assert not any("to_wrap" in k for k in res[f"keys:{s_src}"])
    assert res[f"base_keys:{s_src}"] == res["plain_keys"]  # megatron's own keys for the base
    got = res[pair]
    assert_same_adapters(got["adapters"], got["src_adapters"])
    assert torch.equal(got["logits"], got["ref"])


# -- gated (SwiGLU) linear_fc1: gate and up halves resharded apart -------------------------------

FC1_B = f"decoder.layers.{FC1}.adapter.linear_out.weight"


def swiglu_global(shards: list) -> torch.Tensor:
    """Per-rank ``[gate_i; up_i]`` shards -> the unsharded ``[gate_0; ...; gate_{t-1}; up_0; ...;
    up_{t-1}]`` (``[2 * ffn, r]``); one shard (TP=1) is the unsharded weight itself."""
    halves = [b.chunk(2, 0) for b in shards]
    return torch.cat([g for g, _ in halves] + [u for _, u in halves])


def assert_same_gated_adapters(got: dict, want: dict, tp: int):
    """Every LoRA-A and every LoRA-B but fc1's TP-gathered exact; fc1's LoRA-B exact in the
    global gate-then-up layout, its shards ``[2 * ffn / tp, r]``."""
    assert sorted(got["adapters"]) == sorted(want["adapters"])
    for path, (w_a, w_b) in want["adapters"].items():
        g_a, g_b = got["adapters"][path]
        assert torch.equal(g_a, w_a), f"{path} LoRA-A differs (max {(g_a - w_a).abs().max():.3g})"
        if not path.endswith(FC1):
            assert torch.equal(g_b, w_b), f"{path} LoRA-B differs (max {(g_b - w_b).abs().max():.3g})"
            continue
        shards = got["fc1_b"][path]
        assert len(shards) == tp and all(b.shape == (2 * FFN // tp, RANK_R) for b in shards), path
        g, w = swiglu_global(shards), swiglu_global(want["fc1_b"][path])
        assert g.shape == (2 * FFN, RANK_R)
        assert torch.equal(g, w), f"{path} fc1 LoRA-B differs in the gate/up layout (max {(g - w).abs().max():.3g})"


def test_gated_checkpoint_saved_by_a_gated_model(saved):
    for s in GATED_STRATEGIES:
        shards = case(saved[0], "gated_saved")[s]["fc1_b"]
        assert len(shards) == L
        for path, (b0, b1) in shards.items():
            assert b0.shape == b1.shape == (2 * FFN // 2, RANK_R), path  # [gate_i; up_i], ffn=128
            assert not torch.equal(b0, b1), path


@pytest.mark.parametrize("pair", GATED_PAIRS)
def test_gated_checkpoint_reloads_at_tp2_bit_exact(saved, pair):
    s_saved, s_load = pair.split("->")
    saver = case(saved[0], "gated_saved")[s_saved]
    got = case(saved[0], "gated_loaded")[pair]
    assert_same_gated_adapters(got, saver, 2)
    assert torch.equal(got["logits"], saver["logits"][s_load])


@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("pair", GATED_PAIRS)
def test_gated_checkpoint_reshards_fc1_gate_and_up_apart(saved, reloaded, tp, pair):
    s_saved, s_load = pair.split("->")
    saver = case(saved[0], "gated_saved")[s_saved]
    got = case(reloaded[tp], "gated_loaded")[pair]
    assert_same_gated_adapters(got, saver, tp)
    if tp == 1:  # spelled out: cat(gate_0, gate_1, up_0, up_1), not cat(shard_0, shard_1)
        for path, (b0, b1) in saver["fc1_b"].items():
            (full,) = got["fc1_b"][path]
            half = FFN // 2
            assert torch.equal(full, torch.cat([b0[:half], b1[:half], b0[half:], b1[half:]])), path
            assert not torch.equal(full, torch.cat([b0, b1])), path
    torch.testing.assert_close(got["logits"], saver["logits"][s_load], **RESHARD)


def _assert_swiglu_factory(meta: dict, tp: int, rank: int, where: str):
    """fc1's LoRA-B of every layer: a ShardedTensorFactory building this rank's gate rows at
    ``rank * ffn / tp`` and up rows at ``ffn + rank * ffn / tp`` of the global ``[L, 2 * ffn, r]``,
    exactly as megatron declares the base fc1 weight (``[2 * ffn, h]``)."""
    local = FFN // tp
    for layer in range(L):
        prefix = f"decoder.layers.{layer}.{FC1}"
        e, base, a = meta[f"{prefix}.adapter.linear_out.weight"], meta[f"{prefix}.weight"], \
            meta[f"{prefix}.adapter.linear_in.weight"]
        at = f"{prefix} ({where}, rank {rank})"
        assert base["type"] == "ShardedTensorFactory", at  # the model is gated
        assert e["type"] == "ShardedTensorFactory" and e["key"] == FC1_B, at
        assert a["type"] == "ShardedTensor", at  # LoRA-A is not gated
        gate, up = e["parts"]
        base_gate, base_up = base["parts"]
        for part, base_part, row in ((gate, base_gate, rank * local), (up, base_up, FFN + rank * local)):
            assert part["type"] == "ShardedTensor", at
            assert part["key"] == base_part["key"].replace(f"{FC1}.weight", f"{FC1}.adapter.linear_out.weight"), at
            assert part["global_shape"] == (L, 2 * FFN, RANK_R), at
            assert part["local_shape"] == (local, RANK_R), at
            assert part["global_offset"] == (layer, row, 0), at
            assert part["global_offset"][:2] == base_part["global_offset"][:2], at  # the base's rows
            assert part["axis_fragmentations"] == (L, 2 * tp, 1) == base_part["axis_fragmentations"], at
            assert part["replica_id"] == base_part["replica_id"], at


@pytest.mark.parametrize("strategy", GATED_STRATEGIES)
def test_gated_fc1_lora_b_is_declared_through_swiglu_factory(saved, strategy):
    for rank in range(2):
        _assert_swiglu_factory(case(saved[rank], "gated_saved")[strategy]["meta"], 2, rank, strategy)


@pytest.mark.parametrize("tp", [1, 4])
def test_gated_fc1_lora_b_swiglu_factory_at_tp1_tp4(reloaded, tp):
    s_load = GATED_PAIRS[-1].split("->")[1]  # the last model loaded
    _assert_swiglu_factory(case(reloaded[tp], "gated_loaded")["meta"], tp, 0, s_load)
