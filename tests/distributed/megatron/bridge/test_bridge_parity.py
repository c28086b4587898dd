"""regather against the real Megatron Bridge 0.6.2 on a tiny megatron-core GPT (TP=2 + SP, fp32,
LoRA on linear_qkv, linear_proj, linear_fc1, linear_fc2; every model holds Bridge's adapter
weights): Bridge's ``LoRA`` with and without ``sequence_parallel_input_regather``, ``regather.LoRA``
gather / regather / lowrank, and ``regather.bridge.LoRA`` applied through Bridge's PEFT entry point.

Bridge 0.6.2's regather option has the classic output; regather's regather path is lean by default
(docs/design.md §3.7): the row-parallel adapters (linear_proj, linear_fc2) sum LoRA-B's weight gradient
over each rank's tokens, then reduce-scatter it, another order than Bridge's one GEMM. So the defaults
agree with Bridge bit for bit but in those gradients, which are held against the same function in
float64 (tests.harness.numerics), and ``lean_transients=False`` (the classic output) is bit for bit.

One spawn of two gloo ranks computes everything (workers_bridge.parity_worker)."""

import pytest
import torch
import workers_bridge as W
from tests.harness.bridge_env import INSTALL_HINT, bridge_available
from tests.harness.numerics import check_rounding

from regather.tools.cpu.dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.skipif(not bridge_available(), reason=INSTALL_HINT),
              pytest.mark.timeout(420)]

EXACT = dict(rtol=0, atol=0)
S, B, H, T, L = W.SHAPE.seq_length, W.MICRO_BATCH, W.SHAPE.hidden_size, W.TP, W.SHAPE.num_layers
FP32 = 4
# the lean row adapters' LoRA-B weight gradients: another summation order than Bridge's (module doc)
ROW_B = (".linear_proj.adapter.linear_out.", ".linear_fc2.adapter.linear_out.")


@pytest.fixture(scope="module")
def runs():
    return run_ranks(W.parity_worker, T, timeout=360)


def _same(a: dict, b: dict, what: str, **tol) -> None:
    tol = tol or EXACT
    torch.testing.assert_close(a["logits"], b["logits"], **tol, msg=f"{what}: logits")
    torch.testing.assert_close(a["loss"], b["loss"], **tol, msg=f"{what}: per-token loss")
    torch.testing.assert_close(a["input_grad"], b["input_grad"], **tol, msg=f"{what}: decoder input gradient")
    assert a["grads"].keys() == b["grads"].keys()
    for name, grad in b["grads"].items():
        torch.testing.assert_close(a["grads"][name], grad, **tol, msg=f"{what}: {name}")


@pytest.mark.parametrize("pair", [("regather/gather", "bridge/gather"), ("regather/regather-classic", "bridge/regather"),
                                  ("bridge/regather", "bridge/gather"), ("regather/regather-classic", "bridge/gather"),
                                  ("rb/regather-classic", "bridge/regather"), ("rb/regather", "regather/regather"),
                                  ("rb/lowrank", "regather/lowrank")])
def test_outputs_and_gradients_bit_identical(runs, pair):
    mine, bridge = pair
    for res in runs:
        _same(res[mine], res[bridge], f"rank {res['rank']} {mine} vs {bridge}")


@pytest.mark.parametrize("pair", [("regather/regather", "bridge/regather"), ("regather/regather", "bridge/gather"),
                                  ("rb/regather", "bridge/regather")])
def test_lean_defaults_bit_identical_but_the_row_lora_b_gradients(runs, pair):
    """regather's default (lean) against Bridge's classic output: logits, losses, the decoder input's
    gradient and every LoRA gradient bit for bit (alpha / dim = 2 scales exactly; at TP2 the row
    adapters' reduce-scatter of mid and their dmid add the same two terms as Bridge's all-reduce), but
    the row adapters' LoRA-B weight gradients: against the float64 model within three times Bridge's
    own error (tests.harness.numerics)."""
    mine, bridge = pair
    for res in runs:
        got, ref, ref64, what = res[mine], res[bridge], res["fp64"], f"rank {res['rank']} {mine} vs {bridge}"
        rounded = [n for n in ref["grads"] if any(b in n for b in ROW_B)]
        assert len(rounded) == 2 * L, rounded
        _same({**got, "grads": {n: g for n, g in got["grads"].items() if n not in rounded}},
              {**ref, "grads": {n: g for n, g in ref["grads"].items() if n not in rounded}}, what)
        for name in rounded:
            check_rounding(got["grads"][name], ref["grads"][name], ref64["grads"][name], f"{what}: {name}")


def test_the_comparison_is_not_empty(runs):
    for res in runs:
        grads = res["bridge/gather"]["grads"]
        assert sorted(grads) == res["bridge_trainable"] and len(grads) == 2 * 4 * L
        for name, grad in grads.items():
            assert grad.abs().sum() > 0, f"{name}: all-zero gradient"
        assert res["bridge/gather"]["input_grad"].abs().sum() > 0


def test_lowrank_matches_bridge_to_summation_order(runs):
    """lowrank: replicated LoRA-A, same maths, another summation order (fp32)."""
    for res in runs:
        for name in ("regather/lowrank", "rb/lowrank"):
            mine, ref = res[name], res["bridge/gather"]
            rows = slice(res["rank"] * W.DIM // T, (res["rank"] + 1) * W.DIM // T)
            # a replicated LoRA-A's gradient [r, h] against Bridge's rank shard [r/t, h]
            grads = {n: (g[rows] if g.shape != ref["grads"][n].shape else g) for n, g in mine["grads"].items()}
            _same({**mine, "grads": grads}, ref, f"rank {res['rank']} {name}", rtol=1e-5, atol=1e-6)


def test_retained_bytes_equal_to_bridge(runs):
    eligible_cut = L * 2 * (S * B * H - S * B * H // T) * FP32  # qkv + fc1: x_full -> x_local
    # lean: linear_proj's and linear_fc2's mid on this rank's sequence shard, [s/t, b, r] for [s, b, r]
    row_mid_cut = L * 2 * (S * B * W.DIM - S * B * W.DIM // T) * FP32
    for res in runs:
        assert res["regather/gather"]["saved"] == res["bridge/gather"]["saved"]
        assert res["regather/regather-classic"]["saved"] == res["bridge/regather"]["saved"]
        assert res["rb/regather-classic"]["saved"] == res["bridge/regather"]["saved"]
        assert res["bridge/regather"]["saved"] - res["regather/regather"]["saved"] == row_mid_cut
        assert res["bridge/regather"]["saved"] - res["rb/regather"]["saved"] == row_mid_cut
        assert res["bridge/gather"]["saved"] - res["bridge/regather"]["saved"] == eligible_cut


def test_collective_bytes_gather_equal(runs):
    for res in runs:
        g, b = res["regather/gather"], res["bridge/gather"]
        assert g["comm"] == b["comm"] and g["calls"] == b["calls"]


def test_bridge_regather_sends_one_reduce_scatter_more(runs):
    """Bridge's re-gather runs LoRA-A as megatron's SP ColumnParallelLinear, whose backward
    reduce-scatters its input gradient even where the input needs none (the first layer's
    linear_qkv reads the LayerNorm output of frozen embeddings). regather skips it. With the classic
    output, as Bridge's (the lean row adapters reduce-scatter mid and gather LoRA-B's weight instead)."""
    first_qkv_input = S * B * H * (T - 1) // T * FP32
    for res in runs:
        for mine in ("regather/regather-classic", "rb/regather-classic"):
            m, b = res[mine], res["bridge/regather"]
            assert m["comm"]["all_gather"] == b["comm"]["all_gather"]
            assert m["comm"]["all_reduce"] == b["comm"]["all_reduce"]
            assert b["comm"]["reduce_scatter"] - m["comm"]["reduce_scatter"] == first_qkv_input
            assert b["calls"]["reduce_scatter"] - m["calls"]["reduce_scatter"] == 1
            assert m["comm_forward"] == b["comm_forward"]  # the difference is all in backward
        # and regather's re-gather costs exactly its backward all-gathers over gather
        regather, gather = res["regather/regather-classic"]["comm"], res["regather/gather"]["comm"]
        assert regather["all_gather"] - gather["all_gather"] == L * 2 * S * B * H * (T - 1) // T * FP32
        assert regather["reduce_scatter"] == gather["reduce_scatter"]


def test_regather_bridge_lora_through_bridge_protocol(runs):
    for res in runs:
        for strategy in ("regather", "lowrank"):
            p = res[f"rb/{strategy}/protocol"]
            assert p["is_bridge_lora"] and p["returned_list"] and p["training"]
            assert p["wrapper_types"] == ["regather.megatron.dense.wrapper.LoRALinear"]
            # set_params_to_save / adapter_key_filter (Bridge's own) pick exactly the adapter weights,
            # by the same names as in Bridge's model
            assert p["params_to_save"] == p["trainable"] == res["bridge_trainable"]
            assert p["filtered_keys"] == res["bridge_trainable"]
        decisions = {"regather": res["rb/regather"]["decisions"], "lowrank": res["rb/lowrank"]["decisions"]}
        for strategy, table in decisions.items():
            assert len(table) == 4 * L
            for path, decision in table.items():
                if path.endswith(("linear_qkv", "linear_fc1")):
                    assert decision == strategy, (path, decision)
                else:
                    assert decision.startswith(f"gather (asked {strategy}: base layer"), (path, decision)


def test_bridge_disable_adapter_runs_the_frozen_base(runs):
    """Bridge's ``peft.disable_adapter(model)`` reaches regather's wrappers
    (``LoRALinear.disable_adapter_layers``): the frozen model's logits, exactly; enabled again after."""
    for res in runs:
        for strategy in ("regather", "lowrank"):
            got = res[f"rb/{strategy}/disable_adapter"]
            torch.testing.assert_close(got["disabled"], got["frozen"], rtol=0, atol=0)
            assert not torch.equal(got["enabled"], got["frozen"])  # non-zero LoRA-B: the adapter was on
