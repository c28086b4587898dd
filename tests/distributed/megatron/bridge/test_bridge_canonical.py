"""``regather.CanonicalLoRA`` against Megatron Bridge 0.6.2's ``CanonicalLoRA`` (separate q, k, v,
gate, up adapters) on a tiny megatron-core GPT with GQA (4 heads, 2 query groups), a gated SwiGLU
MLP and no biases, TP=2 + SP, fp32 (workers_bridge_canonical.canonical_worker: one spawn).

Every regather model holds Bridge's adapter weights (copied through a state dict). Where Bridge is
wrong, a test asserts Bridge's behaviour (its docstring says what and why) and regather is compared
against a correct reference instead: Bridge at TP=1, Bridge's full model with the missing
adapters' LoRA-B zeroed, or the weights Bridge holds in memory.

Findings (details and numbers in each test):
- (a) ``LoRALinearSplitQKV._interleave_qkv`` reshapes the *local* q/k/v with the *global* head
  counts: this folds t tokens into one row and is right whenever the token count s*b is a multiple
  of t (always so with SP); it raises when it is not (SP off, odd token count).
- (b) Bridge declares each canonical gate/up adapter's LoRA-B (one half of fc1) through megatron's
  SwiGLU factory, so its checkpoint holds a TP-dependent row permutation: Bridge's own TP=2
  checkpoint loads wrong at TP=1 (and its TP=1 one at TP=2), and gate/up LoRA-B do not cross-load
  with regather's plain layout at TP=2 (both directions); everything else does, exactly.
- (c) Bridge's CanonicalLoRA with a subset of q/k/v or gate/up crashes in forward.
- a non-gated linear_fc1 with gate/up targets is TP-dependent in Bridge as in regather.
"""

import pytest
import torch
import workers_bridge_canonical as WC
from tests.harness.bridge_env import INSTALL_HINT, bridge_available
from tests.harness.numerics import check_rounding

from regather.tools.cpu.dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.skipif(not bridge_available(), reason=INSTALL_HINT),
              pytest.mark.timeout(600)]

T, L = WC.TP, WC.SHAPE.num_layers
S, B, H = WC.SHAPE.seq_length, WC.MICRO_BATCH, WC.SHAPE.hidden_size
FP32 = 4
X_FULL, X_LOCAL = S * B * H * FP32, S * B * H * FP32 // T
X_GATHER = X_FULL * (T - 1) // T
# TP=1 vs TP=2 (fp32 logits, measured 9.5e-7 apart on one machine, 2.4e-6 on another, norm-relative) are other summation orders: the
# TP=2 (or other) result against the TP=1 run's function in fp64, within three times the TP=1 fp32
# run's own error plus 4 ulps (tests.harness.numerics, ``reshard``)
QKV, FC1 = "self_attention.linear_qkv", "mlp.linear_fc1"
# a lean row-parallel adapter (linear_proj, linear_fc2; regather's default) keeps its mid [s/t, b, r] for
# [s, b, r] and sums LoRA-B's weight gradient in another order (docs/design.md §3.7)
ROW_B = (".linear_proj.adapter.linear_out.", ".linear_fc2.adapter.linear_out.")
ROW_MID_CUT = L * 2 * (S * B * WC.DIM - S * B * WC.DIM // T) * FP32


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(WC.canonical_worker, T, str(tmp_path_factory.mktemp("bridge-canonical")), timeout=300)


def case(res: dict, name: str):
    value = res[name]
    if isinstance(value, dict) and "error" in value:
        pytest.fail(f"case {name!r} raised in the ranks:\n{value['error']}", pytrace=False)
    return value


def rel_err(got, ref) -> float:
    got, ref = got.double(), ref.double()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def reshard(got, ref, ref64, what: str):
    """``got`` (TP=2, or another path) against ``ref64``, the fp64 run of the function whose TP=1 fp32
    run is ``ref`` (tests.harness.numerics)."""
    assert ref64.dtype == torch.float64, what
    check_rounding(got, ref, ref64, what)


def identical(a: dict, b: dict, what: str):
    for k in ("logits", "loss", "input_grad"):
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=lambda m: f"{what}: {k}: {m}")
    assert a["grads"].keys() == b["grads"].keys(), what
    for name, g in b["grads"].items():
        torch.testing.assert_close(a["grads"][name], g, rtol=0, atol=0, msg=lambda m: f"{what}: {name}: {m}")


def is_gate_up_b(name: str) -> bool:
    return name.endswith(WC.GATE_UP_B)


def checkpoint_rows(b: torch.Tensor, t: int) -> torch.Tensor:
    """The global rows Bridge's SwiGLU factory writes for a gate/up LoRA-B ``b`` (the true
    ``[ffn, r]``) split over t ranks: rank i holds chunks ``2i, 2i+1`` of 2t; the factory puts the
    first at ``i`` ("gate" part), the second at ``t+i`` ("up" part)."""
    c = b.chunk(2 * t, 0)
    return torch.cat([c[2 * i] for i in range(t)] + [c[2 * i + 1] for i in range(t)])


def read_through_factory(g: torch.Tensor, t: int) -> torch.Tensor:
    """What t ranks of Bridge hold (put together) after reading the global ``g`` through the
    factory: rank i gets chunks ``i`` and ``t+i`` of 2t."""
    c = g.chunk(2 * t, 0)
    return torch.cat([x for i in range(t) for x in (c[i], c[t + i])])


# -- outputs and gradients ----------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["gather", "early-classic", "plain-classic"])
def test_outputs_and_gradients_bit_identical_to_bridge(runs, variant):
    """Logits, per-token loss, decoder-input gradient and all 28 adapter gradients: regather's
    gather and regather (early, plain) with the classic output (``lean_transients=False``) ==
    Bridge's CanonicalLoRA (gather), bit for bit."""
    for res in runs:
        p = case(res, "parity")
        identical(p[f"regather/{variant}"], p["bridge/gather"], f"rank {res['rank']} regather/{variant}")


@pytest.mark.parametrize("variant", ["early", "plain"])
def test_lean_regather_bit_identical_to_bridge_but_the_row_lora_b_gradients(runs, variant):
    """regather's default (lean, docs/design.md §3.7): logits, per-token loss, decoder-input gradient
    and every adapter gradient bit for bit with Bridge's, but linear_proj's and linear_fc2's LoRA-B
    weight gradients, summed over each rank's tokens then reduce-scattered (another order than
    Bridge's one GEMM): against the fp64 model within three times Bridge's own error
    (tests.harness.numerics)."""
    for res in runs:
        p = case(res, "parity")
        mine, ref, ref64 = p[f"regather/{variant}"], p["bridge/gather"], p["fp64"]
        rounded = [n for n in ref["grads"] if any(b in n for b in ROW_B)]
        assert len(rounded) == 2 * L, rounded
        keep = {"grads": {n: g for n, g in ref["grads"].items() if n not in rounded}}
        identical({**mine, "grads": {n: mine["grads"][n] for n in keep["grads"]}}, {**ref, **keep},
                  f"rank {res['rank']} regather/{variant}")
        for name in rounded:
            check_rounding(mine["grads"][name], ref["grads"][name], ref64["grads"][name], f"regather/{variant} {name}")


def test_the_comparison_is_not_empty(runs):
    for res in runs:
        p = case(res, "parity")
        grads = p["bridge/gather"]["grads"]
        assert sorted(grads) == p["bridge_names"] and len(grads) == 2 * 7 * L
        for name, g in grads.items():
            assert g.abs().max() > 0, f"{name}: all-zero gradient"
        assert rel_err(p["bridge_logits"], p["frozen_logits"]) > 0.05  # the adapters matter


def test_lowrank_matches_bridge_to_summation_order(runs):
    for res in runs:
        p = case(res, "parity")
        # another summation order than Bridge's gather path (measured 5.8e-7 apart): both against the
        # same function in fp64 (tests.harness.numerics: within 3x the gather path's own error + 4 ulps)
        mine, ref, ref64 = p["regather/lowrank"], p["bridge/gather"], p["fp64"]
        for k in ("logits", "loss", "input_grad"):
            check_rounding(mine[k], ref[k], ref64[k], k)
        assert ref["grads"].keys() == ref64["grads"].keys()
        for name, g in ref["grads"].items():
            got = mine["grads"][name]
            got = got.chunk(T, 0)[res["rank"]] if got.shape != g.shape else got  # replicated LoRA-A
            check_rounding(got, g, ref64["grads"][name], name)


# -- bytes -----------------------------------------------------------------------------------------


def test_retained_bytes_bridge_five_x_full_per_layer_regather_two_x_local(runs):
    """Counted by storage inside each adapter's forward: Bridge keeps 3 x_full ``[s, b, h]`` on
    linear_qkv (q, k, v) and 2 on linear_fc1 (gate, up) per layer — each adapter gathers and keeps
    its own; regather's gather path the same; regather and lowrank keep one x_local ``[s/t, b, h]``
    per fused linear, shared by its adapters. Totals: equal on gather, 5 x_full - 2 x_local lower per
    layer otherwise (539,200 -> 408,128 B here), and lean (the default but for gather) the row
    adapters' mid on their sequence shard on top."""
    for res in runs:
        p = case(res, "parity")
        bridge = p["bridge/gather"]
        for layer in range(L):
            prefix = f"decoder.layers.{layer}."
            assert bridge["x_saved"][prefix + QKV] == {"x_full": 3, "x_local": 0}
            assert bridge["x_saved"][prefix + FC1] == {"x_full": 2, "x_local": 0}
            assert p["regather/gather"]["x_saved"][prefix + QKV] == bridge["x_saved"][prefix + QKV]
            assert p["regather/gather"]["x_saved"][prefix + FC1] == bridge["x_saved"][prefix + FC1]
            for variant in ("early", "plain", "lowrank"):
                for wrapper in (QKV, FC1):
                    assert p[f"regather/{variant}"]["x_saved"][prefix + wrapper] == {"x_full": 0, "x_local": 1}
        assert p["regather/gather"]["saved"] == bridge["saved"]
        for variant in ("early", "plain", "lowrank"):
            assert bridge["saved"] - p[f"regather/{variant}"]["saved"] == L * (5 * X_FULL - 2 * X_LOCAL) + ROW_MID_CUT
        for variant in ("early-classic", "plain-classic"):
            assert bridge["saved"] - p[f"regather/{variant}"]["saved"] == L * (5 * X_FULL - 2 * X_LOCAL)


def test_collectives_gather_equal_regather_one_gather_per_input(runs):
    """Gather: the same collectives as Bridge (bytes and calls). Regather: 3 fewer forward all-gathers
    of x per layer (one per input instead of one per adapter), 2 backward re-gathers per layer. With the
    classic output, as Bridge's (a lean row adapter reduce-scatters mid and gathers LoRA-B's weight)."""
    for res in runs:
        p = case(res, "parity")
        bridge = p["bridge/gather"]
        assert p["regather/gather"]["comm"] == bridge["comm"] and p["regather/gather"]["calls"] == bridge["calls"]
        for variant in ("early-classic", "plain-classic"):
            r = p[f"regather/{variant}"]
            assert bridge["comm_forward"]["all_gather"] - r["comm_forward"]["all_gather"] == 3 * L * X_GATHER
            assert bridge["comm"]["all_gather"] - r["comm"]["all_gather"] == (3 - 2) * L * X_GATHER
            assert bridge["calls"]["all_gather"] - r["calls"]["all_gather"] == (3 - 2) * L
            for kind in ("reduce_scatter", "all_reduce"):
                assert r["comm"][kind] == bridge["comm"][kind] and r["calls"][kind] == bridge["calls"][kind]


# -- state dicts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["gather", "early", "lowrank"])
def test_bridge_state_dict_loads_strictly_into_regather(runs, variant):
    """``load_state_dict(bridge.state_dict(), strict=True)``; regather then writes the same mapping
    (Bridge lists fc1's ``adapter_up`` before ``adapter_gate``, regather gate first: order only)."""
    for res in runs:
        sd = case(res, "state_dict")
        r = sd[f"bridge->{variant}"]
        assert rel_err(r["before"], r["ref"]) > 0.1  # other weights until the load
        if variant == "lowrank":  # another summation order: within rounding, against fp64
            check_rounding(r["after"], r["ref"], sd["bridge->fp64"], "lowrank logits after the load")
        else:
            assert torch.equal(r["after"], r["ref"])
        assert r["same_mapping"]
        assert sorted(r["keys"]) == sorted(sd["bridge_keys"]) and r["keys"] != sd["bridge_keys"]


def test_regather_state_dict_loads_into_bridge_the_bridge_way(runs):
    """The base into the unwrapped model (strict), then Bridge's CanonicalLoRA and the adapter keys
    Bridge's filter selects (strict=False, as Bridge's resume does): nothing missing or unexpected;
    Bridge then computes regather's logits exactly."""
    for res in runs:
        r = case(res, "state_dict")["regather->bridge"]
        assert r["base_missing"] == r["base_unexpected"] == r["missing_adapter_keys"] == r["unexpected"] == []
        assert r["n_filtered"] == 2 * 7 * L
        assert rel_err(r["before"], r["ref"]) > 0.1
        torch.testing.assert_close(r["after"], r["ref"], rtol=0, atol=0)


# -- (c) subsets ------------------------------------------------------------------------------------


@pytest.mark.parametrize("subset", list(WC.SUBSETS))
def test_bridge_canonical_subset_of_a_fused_linear_crashes(runs, subset):
    """Bridge 0.6.2: ``CanonicalLoRA(target_modules=["linear_q", "linear_v"])`` (or only
    ``linear_fc1_up``) builds ``ModuleDict({"adapter_k": None, ...})`` and its wrapper calls every
    entry: ``TypeError: 'NoneType' object is not callable`` in forward (canonical_lora.py,
    ``LoRALinearSplitQKV.forward`` / ``LoRALinearSplitFC1UpGate.forward``). Documents Bridge."""
    for res in runs:
        assert case(res, "subsets")[subset]["bridge"] == "TypeError: 'NoneType' object is not callable"


@pytest.mark.parametrize("subset", list(WC.SUBSETS))
def test_regather_subset_equals_bridge_with_the_other_adapters_zeroed(runs, subset):
    """The reference Bridge can run: its full CanonicalLoRA with every adapter outside the subset
    given LoRA-B = 0. regather's subset model (gather and regather) holds the subset's Bridge
    weights: identical outputs and gradients; one shared x_local per fused linear on regather."""
    n = {"q+v": 2, "fc1_up": 1}[subset]
    wrapper = {"q+v": QKV, "fc1_up": FC1}[subset]
    for res in runs:
        s = case(res, "subsets")[subset]
        ref = s["reference"]
        for variant in ("gather", "early"):
            got = s[variant]
            for k in ("logits", "loss", "input_grad"):
                torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0)
            assert sorted(got["grads"]) == s["names"] and len(s["names"]) == 2 * n * L
            for name, g in got["grads"].items():
                torch.testing.assert_close(g, ref["grads"][name], rtol=0, atol=0)
        for layer in range(L):
            key = f"decoder.layers.{layer}.{wrapper}"
            assert s["gather"]["x_saved"][key] == {"x_full": n, "x_local": 0}
            assert s["early"]["x_saved"][key] == {"x_full": 0, "x_local": 1}


# -- (a) the qkv interleave ------------------------------------------------------------------------


def test_bridge_interleave_is_right_at_tp2_with_sequence_parallel(runs):
    """Suspicion (a) checked: ``_interleave_qkv`` reshapes the local ``[N, (np/t)*hd]`` query output
    to ``[-1, np, hd]`` with the *global* head count. That folds t consecutive tokens into one row,
    and row group g is token ``g // (ng/t)``'s local group g mod ng/t, whose query heads are exactly
    heads ``g*hpg ...`` of the row: the interleave is right token by token. Evidence: Bridge at TP=1
    and TP=2 on the same full weights agree to rounding (9.5e-7 to 2.4e-6 of the largest logit, by machine; held against fp64) and regather agrees."""
    for res in runs:
        tp1, p = case(res, "tp1"), case(res, "parity")
        reshard(p["bridge_logits"], tp1["bridge"]["logits"], tp1["fp64"], "Bridge TP=2 vs TP=1")
        reshard(tp1["regather"]["logits"], tp1["bridge"]["logits"], tp1["fp64"], "regather vs Bridge at TP=1")


def test_bridge_interleave_raises_when_tokens_do_not_split_over_tp(runs):
    """... but the fold needs s*b divisible by t: TP=2 without SP, one sequence of 31 tokens ->
    ``RuntimeError: shape '[-1, 4, 16]' is invalid for input of size 992`` (31 tokens x 2 local
    heads x 16). Documents Bridge. regather runs it (gather path: SP is off) and matches the correct
    reference, Bridge at TP=1 on the same weights."""
    for res in runs:
        odd = case(res, "odd_tokens")
        assert odd["bridge"] == "RuntimeError: shape '[-1, 4, 16]' is invalid for input of size 992"
        tp1 = case(res, "tp1")
        reshard(odd["regather"], tp1["bridge_odd"], tp1["fp64_odd"], "regather TP=2 odd tokens vs Bridge TP=1")
        for path, d in odd["decisions"].items():
            if path.endswith(("linear_q", "linear_k", "linear_v", "linear_fc1_gate", "linear_fc1_up")):
                assert "sequence parallelism is off" in d, (path, d)


# -- (b) distributed checkpoints -------------------------------------------------------------------------


def _wrong_entries(got: dict, want: dict) -> list:
    assert got.keys() == want.keys()
    return sorted(n for n in want if not torch.equal(got[n], want[n]))


def test_bridge_gate_up_checkpoint_does_not_reshard(runs):
    """Suspicion (b) confirmed. ``ParallelLinearAdapter.sharded_state_dict`` (Bridge 0.6.2,
    peft/utils.py) applies megatron's ``apply_swiglu_sharded_factory`` to every adapter whose base
    name contains "linear_fc1" in a gated model — also to CanonicalLoRA's adapter_gate/adapter_up,
    whose LoRA-B ``[ffn/t, r]`` holds plain rows of one half. The checkpoint's global ``[ffn, r]`` is
    therefore ``checkpoint_rows(B, t)``, a TP-dependent permutation: Bridge's TP=2 checkpoint read
    by Bridge at TP=1 gives every gate/up LoRA-B permuted (the rest exact) and other logits; its
    TP=1 checkpoint read at TP=2 likewise. Same TP: exact. Documents Bridge."""
    for res in runs:
        ck, tp1, back = case(res, "ckpt"), case(res, "tp1"), case(res, "tp2_from_tp1")
        want = ck["bridge_weights"]
        assert _wrong_entries(ck["bridge_tp2->bridge"]["weights"], want) == []  # same TP: fine
        got = tp1["bridge_tp2->bridge"]["weights"]
        wrong = _wrong_entries(got, want)
        assert wrong == sorted(n for n in want if is_gate_up_b(n)) and len(wrong) == 2 * L
        for name in wrong:
            assert torch.equal(got[name], checkpoint_rows(want[name], T)), name
        assert rel_err(tp1["bridge_tp2->bridge"]["logits"], ck["bridge_logits"]) > 0.1
        got = back["bridge"]["weights"]  # Bridge's TP=1 checkpoint (true rows) read at TP=2
        assert _wrong_entries(got, want) == wrong
        for name in wrong:
            assert torch.equal(got[name], read_through_factory(want[name], T)), name


def test_regather_gate_up_checkpoint_reshards(runs):
    """regather declares gate/up LoRA-B as plain TP-split ShardedTensors: TP=2 -> TP=1 exact, and
    the TP=1 logits equal the TP=2 ones to rounding (``reshard``)."""
    for res in runs:
        ck, tp1 = case(res, "ckpt"), case(res, "tp1")
        assert _wrong_entries(ck["regather_tp2->regather"]["weights"], ck["mine_weights"]) == []
        assert _wrong_entries(tp1["regather_tp2->regather"]["weights"], ck["mine_weights"]) == []
        reshard(ck["mine_logits"], tp1["regather_tp2->regather"]["logits"], tp1["fp64_mine"], "regather TP=2 vs TP=1")


def test_dist_checkpoints_cross_load_at_tp2_except_gate_up_lora_b(runs):
    """Same TP (2), both directions, each side loading the way it loads: every adapter weight but
    the gate/up LoRA-B exact. Those differ by Bridge's factory permutation, in the direction each
    side reads it (Bridge -> regather: ``checkpoint_rows``; regather -> Bridge: ``read_through_factory``),
    so the loaded model computes another function. Regather keeps its TP-invariant layout (see
    test_bridge_gate_up_checkpoint_does_not_reshard); the working paths are the next test's."""
    for res in runs:
        ck = case(res, "ckpt")
        for direction, want, rows in (("bridge_tp2->regather", ck["bridge_weights"], checkpoint_rows),
                                      ("regather_tp2->bridge", ck["mine_weights"], read_through_factory)):
            got = ck[direction]["weights"]
            wrong = _wrong_entries(got, want)
            assert wrong == sorted(n for n in want if is_gate_up_b(n)) and len(wrong) == 2 * L, direction
            for name in wrong:
                assert torch.equal(got[name], rows(want[name], T)), (direction, name)
            ref = ck["bridge_logits"] if direction.startswith("bridge") else ck["mine_logits"]
            assert rel_err(ck[direction]["logits"], ref) > 0.1, direction


def test_dist_checkpoints_cross_load_through_tp1(runs):
    """Where Bridge's factory is the identity (TP=1) the layouts agree: Bridge's TP=1 checkpoint
    loads into regather at TP=2 with every weight exact and Bridge's TP=2 logits bit for bit;
    regather's TP=2 checkpoint loads into Bridge at TP=1 exactly (logits to rounding, ``reshard``)."""
    for res in runs:
        ck, tp1, back = case(res, "ckpt"), case(res, "tp1"), case(res, "tp2_from_tp1")
        assert _wrong_entries(back["regather"]["weights"], ck["bridge_weights"]) == []
        torch.testing.assert_close(back["regather"]["logits"], ck["bridge_logits"], rtol=0, atol=0)
        assert _wrong_entries(tp1["regather_tp2->bridge"]["weights"], ck["mine_weights"]) == []
        reshard(ck["mine_logits"], tp1["regather_tp2->bridge"]["logits"], tp1["fp64_mine"],
                "regather TP=2 vs Bridge TP=1 from its checkpoint")
        # and Bridge's TP=2 checkpoint into regather at TP=1 is wrong exactly as into Bridge at TP=1
        assert _wrong_entries(tp1["bridge_tp2->regather"]["weights"], ck["bridge_weights"]) == \
            sorted(n for n in ck["bridge_weights"] if is_gate_up_b(n))


# -- a non-gated fc1 ---------------------------------------------------------------------------------


def test_non_gated_fc1_gate_up_targets_tp_dependent_in_bridge_refused_by_regather(runs):
    """A non-gated MLP with linear_fc1_up / linear_fc1_gate targets: Bridge concatenates the local
    ``[gate_i; up_i]`` (as for a gated fc1), while a non-gated fc1's rank i holds global rows
    ``[i*ffn/t, (i+1)*ffn/t)``: TP=1 and TP=2 compute different functions from the same full weights
    (norm-relative logit difference ~1, as large as the adapters' effect). Documents Bridge;
    regather refuses these targets on a non-gated fc1 (tests/distributed/megatron/test_canonical.py)."""
    for res in runs:
        ng, tp1 = case(res, "not_gated"), case(res, "tp1")
        assert rel_err(tp1["bridge_not_gated"], ng["bridge"]) > 0.1
        assert rel_err(ng["bridge"], ng["frozen"]) > 0.1
        assert ng["regather"] is not None and "is not gated" in ng["regather"], ng["regather"]
