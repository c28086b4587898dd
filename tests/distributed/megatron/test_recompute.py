"""``LoRA(recompute_adapter_inputs=True)`` (issue 9) on a real megatron-core GPT (local spec),
TP=2 on 2 gloo ranks (TP=1 and SP off too), every variant against the gather path without
recompute in the same spawn.

Every variant is built lean (``LoRA(lean_transients=True)``, the gather path too: a lean row-parallel
adapter sums LoRA-B's weight gradient in another order than the classic gather path, docs/design.md
§3.7), but in the setup ``classic``: the defaults, the gather path classic.

Bit-exact (``rtol=0, atol=0``) for regather (early, plain, shared) and the gather path with
recompute (only fc2 recomputes there); lowrank against gather within the stated tolerance
(norm-relative per tensor: fp32 1e-6, bf16 2e-2, as tests/distributed/megatron/test_lowrank.py) and
bit-exact against lowrank without recompute. Compared: loss, per-token losses, every wrapped
linear's output, the gradient of every wrapped linear's input, dA, dB (or ``main_grad`` and
``grad_added_to_main_grad`` with gradient-accumulation fusion), the decoder input's gradient
where it requires grad. Bytes: ``SavedBytes`` at the end of forward, exact; collectives:
``CollectiveBytes`` of forward + backward, equal to the same strategy without recompute.

Two tables: ``MATRIX`` (precision, fusion, strategies, producers, schedules, TP=1 / SP off)
and ``FALLBACKS`` (every refusal and its reason, plus the Transformer Engine routing on the TE
model, tests.harness.te_model, at both TE behaviours), each run in spawns of a few setups (``spawn_groups``).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from tests.harness.spawn_groups import SpawnGroups, group_by_cost
from workers_recompute import TE_NORMS, Setup, Shape

from regather.core.recompute.graph import SOURCE_NOT_KEPT

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
T = 2
SHAPE = Shape()
L = SHAPE.num_layers

# -- the matrix -------------------------------------------------------------------------------------

ALL = ("gather", "gather-rc", "regather", "regather-rc", "regather-plain", "regather-plain-rc", "lowrank",
       "lowrank-rc", "gather-shared", "gather-shared-rc", "regather-shared", "regather-shared-rc")
CORE = ("gather", "gather-rc", "regather", "regather-rc", "regather-plain-rc", "lowrank", "lowrank-rc")
SMALL = ("gather", "gather-rc", "regather-rc", "lowrank", "lowrank-rc")
SWIGLU = dict(gated_linear_unit=True, activation_func=F.silu)
# TP = 1 or SP off: every strategy falls back to the replicated path; each with recompute
REPLICATED_VARIANTS = ("gather", "gather-rc", "regather-rc", "regather-plain-rc", "lowrank", "lowrank-rc")
MATRIX = {
    "fp32": Setup(ALL),
    "bf16": Setup(CORE, dtype="bfloat16"),
    "fp32_fused": Setup(ALL, fusion=True),
    "bf16_fused": Setup(CORE, dtype="bfloat16", fusion=True),
    "input_grad": Setup(CORE + ("regather-shared-rc", "gather-shared"), input_grad=True),
    "rmsnorm": Setup(SMALL, model=dict(normalization="RMSNorm", layernorm_epsilon=1e-3)),
    "layernorm_eps": Setup(SMALL, model=dict(layernorm_epsilon=1e-2)),
    "gelu_nobias": Setup(SMALL, model=dict(add_bias_linear=False)),
    "gelu_fused": Setup(SMALL, model=dict(bias_activation_fusion=True)),  # megatron fuses gelu with a bias only
    "swiglu": Setup(SMALL, model=dict(SWIGLU, add_bias_linear=False)),
    "swiglu_bias": Setup(SMALL, model=dict(SWIGLU)),
    "swiglu_fused": Setup(SMALL, model=dict(SWIGLU, add_bias_linear=False, bias_activation_fusion=True)),
    "swiglu_fused_bias": Setup(SMALL, model=dict(SWIGLU, bias_activation_fusion=True)),
    "swiglu_fused_bf16_fusion": Setup(SMALL, dtype="bfloat16", fusion=True,
                                      model=dict(SWIGLU, add_bias_linear=False, bias_activation_fusion=True)),
    "interleaved": Setup(CORE, schedule="interleaved"),
    "interleaved_fused": Setup(CORE, schedule="interleaved", fusion=True),
    "retain_graph": Setup(CORE + ("regather-shared-rc", "gather-shared"), schedule="retain", input_grad=True),
    "eval": Setup(SMALL, schedule="eval"),
    "no_grad": Setup(SMALL, schedule="no_grad"),
    "phases": Setup(SMALL, schedule="steps"),
    "dropout_pre": Setup(SMALL, lora=dict(dropout=0.1)),
    "dropout_post": Setup(SMALL + ("regather-plain-rc",), lora=dict(dropout=0.1, dropout_position="post")),
    "tp1": Setup(REPLICATED_VARIANTS, tp=1),
    "tp1_swiglu_fused": Setup(("gather", "gather-rc"), tp=1,
                              model=dict(SWIGLU, add_bias_linear=False, bias_activation_fusion=True)),
    "sp_off": Setup(REPLICATED_VARIANTS, sp=False),
    # Bridge's shipped layouts (issue 33): TP = 1 (the 1-GPU recipes) and TP > 1 with SP off (the 70B
    # ones), the decoder input requiring grad as under Bridge's recompute, beside the frozen model
    "tp1_input_grad": Setup(REPLICATED_VARIANTS, tp=1, input_grad=True, frozen_baseline=True),
    "sp_off_input_grad": Setup(REPLICATED_VARIANTS, sp=False, input_grad=True, frozen_baseline=True),
    # a Llama-like MLP in bf16 (LayerNorm: torch's bf16 RMSNorm keeps an fp32 copy on CPU, FALLBACKS)
    "sp_off_swiglu_bf16": Setup(("gather", "gather-rc", "regather-rc", "lowrank", "lowrank-rc"), sp=False,
                                dtype="bfloat16", input_grad=True, frozen_baseline=True,
                                model=dict(SWIGLU, add_bias_linear=False, bias_activation_fusion=True)),
    # TP2 + SP beside the frozen model: a lean row adapter keeps its mid on its sequence shard
    "sp_input_grad": Setup(SMALL, input_grad=True, frozen_baseline=True),
    # every setup above builds every variant lean (workers_recompute.Setup.lean); here the defaults: the
    # classic gather path (Megatron Bridge's), with and without recompute
    "classic": Setup(("gather", "gather-rc"), input_grad=True, frozen_baseline=True, lean=None),
}
BYTES_SCHEDULES = ("plain", "interleaved")


# One spawn per group of setups of at most this many variants (6 + 3 spawns; the module alone took
# 84 s on 2 cores, 44.5 s of it in MATRIX's setups), run by the first test that asks for one of its
# setups (tests.harness.spawn_groups says why).
BUDGET = 30


def spawn_groups(table: str) -> SpawnGroups:
    """``table``'s setups in spawns of at most ``BUDGET`` variants; ``FALLBACKS`` also runs the
    Transformer Engine cases, as the item ``"te"``, in a spawn of their own."""
    setups = TABLES[table]
    groups = group_by_cost({n: len(s.variants) for n, s in setups.items()}, BUDGET)
    return SpawnGroups(_run_group, T, groups + ([["te"]] if table == "FALLBACKS" else []), table, timeout=180)


@pytest.fixture(scope="module")
def matrix():
    return spawn_groups("MATRIX")


def _run_group(rank, world, names, table):
    from workers_recompute import run_many

    setups = {n: TABLES[table][n] for n in names if n != "te"}
    return run_many(rank, world, setups, "te" in names)


def te_results(spawns):
    """Per rank: the Transformer Engine cases (``workers_recompute.run_te``)."""
    return [r["te"] for r in spawns.ranks("te")]


def variant_results(spawns, setup, variant):
    out = []
    for rank, r in enumerate(spawns.ranks(setup)):
        got = r["results"][setup][variant]
        if "error" in got:
            pytest.fail(f"{setup}/{variant} rank {rank}: {got['error']}", pytrace=False)
        out.append(got)
    return out


# -- comparisons ----------------------------------------------------------------------------------

TOL = {"float32": 1e-6, "bfloat16": 2e-2}


def reference_of(variant: str) -> str:
    """The run without recompute a variant is held bit-exact to."""
    if "shared" in variant:
        return "gather-shared"
    if variant.startswith("lowrank"):
        return "lowrank"
    return "gather"


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def same(got, ref, what, rel=None):
    """Bit-identical when ``rel`` is None, else norm-relative error <= ``rel`` per tensor."""
    if isinstance(got, torch.Tensor) or isinstance(ref, torch.Tensor):
        assert isinstance(got, torch.Tensor) and isinstance(ref, torch.Tensor), f"{what}: {got!r} vs {ref!r}"
        assert got.shape == ref.shape and got.dtype == ref.dtype, f"{what}: {got.shape} {got.dtype} vs {ref.shape} {ref.dtype}"
        if rel is None:
            torch.testing.assert_close(got, ref, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")
        else:
            err = _rel(got, ref)
            assert err <= rel, f"{what}: relative error {err:.3g} > {rel:g}"
    elif isinstance(got, dict):
        assert got.keys() == ref.keys(), f"{what}: {sorted(got)} vs {sorted(ref)}"
        for k in ref:
            same(got[k], ref[k], f"{what} {k}", rel)
    elif isinstance(got, (list, tuple)):
        assert len(got) == len(ref), f"{what}: {len(got)} vs {len(ref)}"
        for i, (g, r) in enumerate(zip(got, ref)):
            same(g, r, f"{what}[{i}]", rel)
    else:
        assert got == ref, f"{what}: {got!r} != {ref!r}"


NUMERICS = ("loss", "per_token", "out", "dx", "input_dx", "grads", "grads_first", "dx_first", "phases")


def check_numerics(got, ref, what, rel=None):
    for key in NUMERICS:
        if key in ref:
            value = ref[key]
            if key == "phases":  # per phase: outputs only (decisions differ by design)
                same([p["per_token"] for p in got[key]], [p["per_token"] for p in value], f"{what} phases", rel)
                continue
            same(got[key], value, f"{what} {key}", rel)
    if "grads" in ref and any(isinstance(g, torch.Tensor) for g in ref["grads"].values()):
        nonzero = [k for k, g in ref["grads"].items() if isinstance(g, torch.Tensor) and g.abs().sum() > 0]
        assert len(nonzero) >= 2 * 4 * L - 2, f"{what}: only {len(nonzero)} non-zero LoRA grads (an empty check)"


PAIRS = [(s, v) for s, setup in MATRIX.items() for v in setup.variants if v != reference_of(v)]


@pytest.mark.parametrize("setup,variant", PAIRS, ids=[f"{s}-{v}" for s, v in PAIRS])
def test_matches_the_path_without_recompute(matrix, setup, variant):
    """Bit-exact against the run of the same strategy without recompute (lowrank: against
    lowrank), and for every variant against plain gather (exact, or lowrank's tolerance)."""
    ref_name = reference_of(variant)
    dtype = MATRIX[setup].dtype
    for rank, (got, ref, gather) in enumerate(zip(variant_results(matrix, setup, variant),
                                                  variant_results(matrix, setup, ref_name),
                                                  variant_results(matrix, setup, "gather"))):
        check_numerics(got, ref, f"rank {rank} {setup}/{variant} vs {ref_name}")
        if ref_name == "lowrank":
            check_numerics(got, gather, f"rank {rank} {setup}/{variant} vs gather", TOL[dtype])
        elif ref_name == "gather-shared":  # the shared gather sums dX in another order than unshared
            check_numerics(got, gather, f"rank {rank} {setup}/{variant} vs gather", TOL[dtype])


@pytest.mark.parametrize("setup", [s for s in MATRIX if MATRIX[s].fusion])
def test_fusion_fills_main_grad_and_sets_the_flag(matrix, setup):
    for variant in MATRIX[setup].variants:
        for r in variant_results(matrix, setup, variant):
            flags = {k: v for k, v in r["grads"].items() if k.endswith(".flag")}
            assert flags and all(flags.values()), (variant, flags)


def test_retain_graph_second_backward_doubles(matrix):
    for variant in MATRIX["retain_graph"].variants:
        for rank, r in enumerate(variant_results(matrix, "retain_graph", variant)):
            assert r["second_error"] is None, f"{variant}: {r['second_error']}"
            for k, first in r["grads_first"].items():
                if isinstance(first, torch.Tensor):
                    same(r["grads"][k], first * 2, f"rank {rank} {variant} {k}: second backward = 2x first")


# -- decisions ----------------------------------------------------------------------------------------

NO_PRODUCER = "linear_proj has no recomputable producer (only linear_qkv, linear_fc1 and linear_fc2 do)"
FROZEN_INPUT = "input_layernorm: it keeps nothing for its backward (neither its input nor its weights need a gradient)"
GATHER_PATH = ("the gather path keeps its input as it is (recompute of a column-parallel adapter's input needs "
               "regather or lowrank)")
DROPOUT_PRE = "dropout is applied to the adapter input (dropout_position='pre')"


def recomputed(name):
    return f", input recomputed from {name}"


def kept(reason):
    return f", input kept (recompute asked: {reason})"


def activation_name(model: dict) -> str:
    gated = model.get("gated_linear_unit", False)
    fn = "silu" if gated else "gelu"
    return f"the MLP activation ({fn}{', gated' if gated else ''}{', fused' if model.get('bias_activation_fusion') else ''})"


def expected_tail(setup: Setup, variant: str, path: str) -> str:
    """The recompute part of a training forward's decision (after the strategy part)."""
    if not variant.endswith("-rc"):
        return ""
    strategy = variant.split("-")[0]
    name = path.rsplit(".", 1)[-1]
    layer = int(path.split(".")[2])
    # TP = 1 or SP off: the replicated path, which rebuilds qkv / fc1 inputs from the norm as
    # regather and lowrank do under SP, whatever strategy was asked
    replicated = setup.tp == 1 or not setup.sp
    if "dropout" in setup.lora and setup.lora.get("dropout_position", "pre") == "pre":
        if name in ("linear_qkv", "linear_fc1") and strategy == "gather" and not replicated:
            pass  # the path's own reason comes first
        else:
            return kept(DROPOUT_PRE)
    if name == "linear_proj":
        return kept(NO_PRODUCER)
    if name == "linear_fc2":
        return recomputed(activation_name(setup.model))
    if strategy == "gather" and not replicated:
        return kept(GATHER_PATH)
    if name == "linear_qkv" and layer == 0 and not setup.input_grad:
        return kept(FROZEN_INPUT)
    return recomputed("input_layernorm" if name == "linear_qkv" else "pre_mlp_layernorm")


def expected_head(setup: Setup, variant: str, path: str) -> str:
    strategy = variant.split("-")[0]
    name = path.rsplit(".", 1)[-1]
    if strategy == "gather":
        return "gather"
    if name in ("linear_proj", "linear_fc2"):
        return (f"gather (asked {strategy}: base layer {name!r} is row-parallel (its input is split over "
                f"hidden, not sequence))")
    if setup.tp == 1 or not setup.sp:
        return f"gather (asked {strategy}: sequence parallelism is off for {name!r})"
    return strategy


TRAINING = [(s, v) for s, setup in MATRIX.items() for v in setup.variants
            if setup.schedule in ("plain", "interleaved", "retain")]


@pytest.mark.parametrize("setup,variant", TRAINING, ids=[f"{s}-{v}" for s, v in TRAINING])
def test_decisions_name_the_producer_or_the_reason(matrix, setup, variant):
    st = MATRIX[setup]
    for rank, r in enumerate(variant_results(matrix, setup, variant)):
        assert len(r["decisions"]) == 4 * L
        for path, decision in r["decisions"].items():
            want = expected_head(st, variant, path) + expected_tail(st, variant, path)
            assert decision == want, f"rank {rank} {path}"
            # every forward of the step decided the same (two micro-batches, retain_graph)
            assert set(r["seen"][path]) == {want}, (path, r["seen"][path])
        if variant.endswith("-rc"):
            # one INFO line per distinct reason (expected reasons), covering every adapter that keeps
            # its input once, its count in the text
            keeps = [p for p, d in r["decisions"].items() if "input kept" in d]
            lines = [f for f in r["fallbacks"] if f[1].startswith("recompute_adapter_inputs requested")]
            assert sorted(p for f in lines for p in f[3]) == sorted(keeps)
            assert len({f[2] for f in lines}) == len(lines)
            assert all(f" on {len(f[3])} adapter" in f[4] and f[3][0] in f[4] for f in lines)
            assert all(f[0] == "INFO" for f in lines)


def test_decisions_before_a_forward(matrix):
    """``regather.decisions`` before any forward: the static part (the frozen-embedding check of
    layer 0 needs a forward; it says recomputed there, the forward then says kept)."""
    r = variant_results(matrix, "fp32", "regather-rc")[0]
    assert r["before"]["decoder.layers.0.self_attention.linear_qkv"] == "regather" + recomputed("input_layernorm")
    assert r["decisions"]["decoder.layers.0.self_attention.linear_qkv"] == "regather" + kept(FROZEN_INPUT)
    assert r["after"]["decoder.layers.1.mlp.linear_fc1"] == "regather" + recomputed("pre_mlp_layernorm")


@pytest.mark.parametrize("setup", ["eval", "no_grad"])
def test_eval_and_no_grad_save_nothing_new_and_decide_without_recompute(matrix, setup):
    reason = "module is in eval mode" if setup == "eval" else "autograd is disabled (torch.no_grad / inference_mode)"
    for variant in MATRIX[setup].variants:
        for r, g in zip(variant_results(matrix, setup, variant), variant_results(matrix, setup, "gather")):
            strategy = variant.split("-")[0]
            for path, decision in r["decisions"].items():
                want = "gather" if strategy == "gather" else f"gather (asked {strategy}: {reason})"
                assert decision == want, (variant, path, decision)
                assert r["eval_before"][path] == want
            assert r["saved_total"] == g["saved_total"] and r["saved_adapter_input"] == g["saved_adapter_input"]
            if setup == "no_grad":
                assert r["saved_total"] == 0


def test_eval_train_no_grad_train_phases(matrix):
    """Stale producer state from an eval / no_grad forward never leaks into the next training one."""
    for variant in MATRIX["phases"].variants:
        for r, _g in zip(variant_results(matrix, "phases", variant), variant_results(matrix, "phases", "gather")):
            assert [p["phase"] for p in r["phases"]] == ["eval", "train", "no_grad", "train"]
            train = [p for p in r["phases"] if p["phase"] == "train"]
            assert train[0]["decisions"] == train[1]["decisions"]
            if variant.endswith("-rc"):
                assert train[1]["decisions"]["decoder.layers.1.mlp.linear_fc2"].endswith(
                    recomputed("the MLP activation (gelu)"))


def test_norm_epsilon_is_the_configured_one(matrix):
    assert variant_results(matrix, "layernorm_eps", "regather-rc")[0]["norm_eps"] == [1e-2] * L
    assert variant_results(matrix, "rmsnorm", "regather-rc")[0]["norm_eps"] == [1e-3] * L


# -- bytes -----------------------------------------------------------------------------------------------


def elt(setup: Setup) -> int:
    return torch.empty((), dtype=setup.torch_dtype).element_size()


def adapter_input_bytes(setup: Setup, variant: str, decisions: dict) -> int:
    """What each adapter's LoRA-A keeps, per micro-batch in flight, from its decision."""
    s, b, h, t = SHAPE.seq_length, setup.micro_batch, SHAPE.hidden_size, setup.tp
    ffn_local = SHAPE.ffn_hidden_size // t  # fc2's input width per rank (gated or not)
    total = 0
    for path, d in decisions.items():
        name = path.rsplit(".", 1)[-1]
        if "input recomputed" in d:
            continue
        if name == "linear_proj":
            total += s * b * h // t
        elif name == "linear_fc2":
            total += s * b * ffn_local
        elif not setup.sp or t == 1:
            total += s * b * h  # the replicated path: x [s, b, h] on every rank
        elif d.startswith(("regather", "lowrank")):
            total += s * b * h // t  # x_local
        else:
            total += s * b * h  # x_full
    return total * elt(setup)


def saving_vs_gather(setup: Setup, decisions: dict) -> int:
    """Total retained bytes below the gather run: s*b*h per recomputing qkv/fc1 (x_full under SP,
    the replicated x without), x_full - x_local per qkv/fc1 that keeps x_local, s*b*ffn_local per
    recomputing fc2."""
    s, b, h, t = SHAPE.seq_length, setup.micro_batch, SHAPE.hidden_size, setup.tp
    ffn_local = SHAPE.ffn_hidden_size // t
    total = 0
    for path, d in decisions.items():
        name = path.rsplit(".", 1)[-1]
        if name in ("linear_qkv", "linear_fc1"):
            if "input recomputed" in d:  # x_full under SP, the replicated x otherwise: s*b*h
                total += s * b * h
            elif setup.sp and t > 1 and d.startswith(("regather", "lowrank")):
                total += s * b * h - s * b * h // t
        elif name == "linear_fc2" and "input recomputed" in d:
            total += s * b * ffn_local
    return total * elt(setup)


BYTES = [(s, v) for s, setup in MATRIX.items() for v in setup.variants
         if setup.schedule in BYTES_SCHEDULES and "shared" not in v]


@pytest.mark.parametrize("setup,variant", BYTES, ids=[f"{s}-{v}" for s, v in BYTES])
def test_retained_bytes_exact(matrix, setup, variant):
    st = MATRIX[setup]
    in_flight = 2 if st.schedule == "interleaved" else 1
    for rank, (r, g) in enumerate(zip(variant_results(matrix, setup, variant),
                                      variant_results(matrix, setup, "gather"))):
        assert r["saved_adapter_input"] == in_flight * adapter_input_bytes(st, variant, r["decisions"]), \
            (rank, r["saved_by_label"])
        assert g["saved_total"] - r["saved_total"] == in_flight * saving_vs_gather(st, r["decisions"]), rank
        if variant.endswith("-rc"):  # every adapter that recomputes holds 0 bytes of its own
            for path, _d in r["decisions"].items():
                base = path.rsplit(".", 1)[-1]
                if all("input recomputed" in dd for p, dd in r["decisions"].items() if p.endswith(base)):
                    assert r["saved_by_label"].get(f"adapter_input:{base}", 0) == 0, (path, r["saved_by_label"])


def test_qwen_like_saving_is_the_whole_adapter_input(matrix):
    """With the embedding output requiring grad every qkv/fc1/fc2 adapter recomputes: the only
    adapter bytes left are linear_proj's (no producer)."""
    st = MATRIX["input_grad"]
    s, b, h, t, e = SHAPE.seq_length, st.micro_batch, SHAPE.hidden_size, T, elt(st)
    for variant in ("regather-rc", "regather-plain-rc", "lowrank-rc"):
        for r in variant_results(matrix, "input_grad", variant):
            labels = {k: v for k, v in r["saved_by_label"].items() if k != "other" and v}
            assert labels == {"adapter_input:linear_proj": L * s * b * h // t * e}, r["saved_by_label"]


FROZEN = [(s, v) for s, setup in MATRIX.items() for v in setup.variants if setup.frozen_baseline]


def lean(setup: Setup, variant: str) -> bool:
    """Whether ``variant``'s adapters are lean (``LoRA(lean_transients=setup.lean)``; None: all but gather's)."""
    return variant.split("-")[0] != "gather" if setup.lean is None else setup.lean


def rank_r_bytes(setup: Setup, variant: str) -> int:
    """What every adapter adds besides its LoRA-A input: LoRA-B's input ``mid [s, b, r]`` (the
    rank-r activation, gathered over r for a column-parallel adapter, reduced for a row-parallel
    one; lean, scaled first), one per adapter; a lean row-parallel adapter under SP keeps it on its
    sequence shard, ``[s/t, b, r]`` (regather.core.peak.row)."""
    s, b, r, t = SHAPE.seq_length, setup.micro_batch, 8, setup.tp  # LoRA dim 8 (workers_recompute.build)
    row_s = s // t if lean(setup, variant) and setup.sp and t > 1 else s
    return L * (2 * s + 2 * row_s) * b * r * elt(setup)  # per layer: qkv and fc1; proj and fc2


@pytest.mark.parametrize("setup,variant", FROZEN, ids=[f"{s}-{v}" for s, v in FROZEN])
def test_lora_over_the_frozen_model(matrix, setup, variant):
    """TP = 1 and TP > 1 with SP off (Bridge's shipped layouts), and TP2 + SP, the decoder input requiring grad:
    LoRA adds over the frozen model (no LoRA, every weight frozen, same step) exactly its LoRA-A
    inputs plus one rank-r tensor per adapter; with recompute the LoRA-A inputs are linear_proj's
    alone (the local spec's attention keeps no output: its input is new bytes), every qkv / fc1 /
    fc2 input rebuilt from what the norm and the activation keep. Counted with saved-tensor hooks."""
    st = MATRIX[setup]
    s, b, h, t = SHAPE.seq_length, st.micro_batch, SHAPE.hidden_size, st.tp
    for rank, r in enumerate(variant_results(matrix, setup, variant)):
        frozen = matrix.ranks(setup)[rank]["results"][setup]["frozen"]
        extra = r["saved_total"] - frozen["saved_total"]
        assert frozen["saved_total"] > 0 and r["input_dx"] and frozen["input_dx"][0] is not None
        assert extra == adapter_input_bytes(st, variant, r["decisions"]) + rank_r_bytes(st, variant), \
            (rank, extra, r["saved_by_label"], frozen["saved_by_label"])
        # every input but linear_proj's rebuilt; not the gather path's qkv / fc1 inputs under SP, which it
        # keeps (adapter_input_bytes counts them above)
        if variant.endswith("-rc") and not (st.sp and t > 1 and variant.startswith("gather")):
            assert r["saved_adapter_input"] == L * s * b * h // t * elt(st), r["saved_by_label"]
            assert extra == L * s * b * h // t * elt(st) + rank_r_bytes(st, variant)


RC_TWINS = [(s, v) for s, setup in MATRIX.items() for v in setup.variants
            if v.endswith("-rc") and v[:-3] in setup.variants and setup.schedule == "plain"]


@pytest.mark.parametrize("setup,variant", RC_TWINS, ids=[f"{s}-{v}" for s, v in RC_TWINS])
def test_collective_bytes_unchanged_by_recompute(matrix, setup, variant):
    for r, twin in zip(variant_results(matrix, setup, variant), variant_results(matrix, setup, variant[:-3])):
        assert r["comm"] == twin["comm"]
        assert r["comm_forward"] == twin["comm_forward"]


# -- fallbacks -----------------------------------------------------------------------------------------------

V = ("gather", "regather-rc", "lowrank-rc")
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
FALLBACKS = {
    "selective_layernorm": Setup(V, prepare="no_layernorm_checkpoint",
                                 model=dict(recompute_granularity="selective", recompute_modules=["layernorm"])),
    "full_recompute": Setup(V, input_grad=True, model=FULL),
    "spec_layer_forward": Setup(V, spec="layer_forward"),
    "spec_mlp_forward": Setup(V, spec="mlp_forward"),
    "spec_attention_path": Setup(V, spec="attention_path"),
    "inplace_after_producer": Setup(V, prepare="inplace_after_norm", input_grad=True),
    "inplace_before_lora": Setup(V, prepare="inplace_before_lora", input_grad=True),
    "fp8_input_store": Setup(V, model=dict(SWIGLU, add_bias_linear=False, activation_func_fp8_input_store=True)),
    "fp8_input_store_fused": Setup(V, model=dict(SWIGLU, add_bias_linear=False, bias_activation_fusion=True,
                                                 activation_func_fp8_input_store=True)),
    "unfaithful_norm": Setup(V, prepare="unfaithful_norm"),
    # torch's rms_norm in bf16 on CPU is composite: it saves an fp32 copy of its input, not the input
    "rmsnorm_bf16": Setup(("gather", "regather-rc"), dtype="bfloat16", input_grad=True,
                          model=dict(normalization="RMSNorm")),
    "unfaithful_activation": Setup(V, prepare="unfaithful_act"),
    "late_fc2_prehook": Setup(("gather", "regather-rc"), prepare="late_fc2_prehook", schedule="two_steps"),
    "late_norm_inplace": Setup(("gather", "regather-rc"), prepare="late_inplace_before_lora",
                               schedule="two_steps", input_grad=True),
}


@pytest.fixture(scope="module")
def fallbacks():
    return spawn_groups("FALLBACKS")


TABLES = {"MATRIX": MATRIX, "FALLBACKS": FALLBACKS}


def _bit_for_bit(name):
    # the reason is one sentence for every layer (logged once); the measured difference is its detail
    return re.compile(re.escape(f", input kept (recompute asked: recomputing {name} does not reproduce the adapter "
                                f"input bit for bit; the input is kept (max |diff| ") + r"[0-9.e-]+" + re.escape("))"))


QKV, FC1, FC2 = "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2"
LN = recomputed("input_layernorm")
PRE_MLP = recomputed("pre_mlp_layernorm")
GELU = recomputed("the MLP activation (gelu)")
SEL = "selective recompute covers 'layernorm' (recompute_modules=['layernorm'])"
# setup -> {(layer, adapter): expected recompute part, or a compiled pattern}
FALLBACK_TAILS = {
    "selective_layernorm": {(i, QKV): kept(SEL) for i in range(L)} | {(i, FC1): kept(SEL) for i in range(L)}
    | {(i, FC2): GELU for i in range(L)},
    "spec_layer_forward": {(i, a): kept(f"{a.split('.')[1]} is not inside a megatron TransformerLayer running its own "
                                        f"forward (custom spec)") for i in range(L) for a in (QKV, FC1)}
    | {(i, FC2): GELU for i in range(L)},
    "spec_mlp_forward": {(0, QKV): kept(FROZEN_INPUT), (1, QKV): LN}
    | {(i, a): kept(f"{a.split('.')[1]}'s parent is a CustomMLP, not megatron's MLP running its own forward")
       for i in range(L) for a in (FC1, FC2)},
    "spec_attention_path": {(i, QKV): kept("the adapter input is not input_layernorm's output of this forward")
                            for i in range(L)} | {(i, FC1): PRE_MLP for i in range(L)} | {(i, FC2): GELU for i in range(L)},
    "inplace_after_producer": {(i, QKV): kept("input_layernorm's output was modified in place before the adapter "
                                              "read it") for i in range(L)}
    | {(i, FC1): PRE_MLP for i in range(L)} | {(i, FC2): GELU for i in range(L)},
    # the producer's hook runs first (prepend): the user's in-place change shows as a new version
    "inplace_before_lora": {(i, QKV): kept("input_layernorm's output was modified in place before the adapter "
                                           "read it") for i in range(L)}
    | {(i, FC1): PRE_MLP for i in range(L)} | {(i, FC2): GELU for i in range(L)},
    "fp8_input_store": {(0, QKV): kept(FROZEN_INPUT), (1, QKV): LN} | {(i, FC1): PRE_MLP for i in range(L)}
    | {(i, FC2): kept("the activation stores its input in fp8 (activation_func_fp8_input_store=True)") for i in range(L)},
    "unfaithful_norm": {(0, QKV): kept(FROZEN_INPUT), (1, QKV): _bit_for_bit("input_layernorm")}
    | {(i, FC1): PRE_MLP for i in range(L)} | {(i, FC2): GELU for i in range(L)},
    "unfaithful_activation": {(0, QKV): kept(FROZEN_INPUT), (1, QKV): LN} | {(i, FC1): PRE_MLP for i in range(L)}
    | {(i, FC2): _bit_for_bit("the MLP activation (gelu)") for i in range(L)},
}
FALLBACK_TAILS["rmsnorm_bf16"] = ({(i, QKV): kept(f"input_layernorm: {SOURCE_NOT_KEPT}") for i in range(L)}
                                  | {(i, FC1): kept(f"pre_mlp_layernorm: {SOURCE_NOT_KEPT}") for i in range(L)}
                                  | {(i, FC2): GELU for i in range(L)})
FALLBACK_TAILS["fp8_input_store_fused"] = FALLBACK_TAILS["fp8_input_store"]
FB_PAIRS = [(s, v) for s in FALLBACKS for v in FALLBACKS[s].variants if v != "gather"]


@pytest.mark.parametrize("setup,variant", [p for p in FB_PAIRS if not p[0].startswith("late_")],
                         ids=[f"{s}-{v}" for s, v in FB_PAIRS if not s.startswith("late_")])
def test_fallback_numerics_unchanged(fallbacks, setup, variant):
    rel = None if variant.startswith("regather") else TOL["float32"]
    for rank, (got, ref) in enumerate(zip(variant_results(fallbacks, setup, variant),
                                          variant_results(fallbacks, setup, "gather"))):
        check_numerics(got, ref, f"rank {rank} {setup}/{variant}", rel)


@pytest.mark.parametrize("setup,variant", [p for p in FB_PAIRS if p[0] in FALLBACK_TAILS],
                         ids=[f"{s}-{v}" for s, v in FB_PAIRS if s in FALLBACK_TAILS])
def test_fallback_reasons_exact(fallbacks, setup, variant):
    strategy = variant.split("-")[0]
    for rank, r in enumerate(variant_results(fallbacks, setup, variant)):
        for (layer, adapter), want in FALLBACK_TAILS[setup].items():
            path = f"decoder.layers.{layer}.{adapter}"
            decision = r["decisions"][path]
            head = strategy if adapter != FC2 else (
                f"gather (asked {strategy}: base layer 'linear_fc2' is row-parallel (its input is split over hidden, "
                f"not sequence))")
            assert decision.startswith(head), (rank, path, decision)
            tail = decision[len(head):]
            if isinstance(want, str):
                assert tail == want, (rank, path)
            else:
                assert want.fullmatch(tail), (rank, path, tail)
                # the unfaithful producer is switched off: later decisions say so without a forward
                assert want.fullmatch(r["after"][path][len(head):]), r["after"][path]
        assert r["decisions"]["decoder.layers.0.self_attention.linear_proj"].endswith(kept(NO_PRODUCER))
        # a rerun that is not bit-identical is a WARNING, the other reasons INFO; each logged once
        lines = [f for f in r["fallbacks"] if f[1].startswith("recompute_adapter_inputs requested")]
        for lvl, _, reason, _, _ in lines:
            assert lvl == ("WARNING" if "bit for bit" in reason else "INFO"), reason
        # one line per reason, each adapter in one line at most
        assert len({f[2] for f in lines}) == len(lines)
        paths = [p for f in lines for p in f[3]]
        assert len(paths) == len(set(paths))


@pytest.mark.parametrize("setup", ["unfaithful_norm", "unfaithful_activation", "inplace_before_lora"])
def test_fallback_adapter_bytes(fallbacks, setup):
    """An adapter whose producer was switched off keeps its input, counted as its own bytes."""
    st = FALLBACKS[setup]
    for r in variant_results(fallbacks, setup, "regather-rc"):
        assert r["saved_adapter_input"] == adapter_input_bytes(st, "regather-rc", r["decisions"]), r["saved_by_label"]


@pytest.mark.parametrize("setup", ["unfaithful_norm", "unfaithful_activation", "inplace_before_lora"])
def test_failed_verification_adds_no_bytes(fallbacks, setup):
    """The first-forward check of a rerun leaves no graph behind (it once counted +4100 B per
    failing qkv, +8196 B per fc2): the saving against gather is exactly the recomputed inputs'."""
    st = FALLBACKS[setup]
    for r, g in zip(variant_results(fallbacks, setup, "regather-rc"), variant_results(fallbacks, setup, "gather")):
        assert g["saved_total"] - r["saved_total"] == saving_vs_gather(st, r["decisions"]), r["saved_by_label"]


def test_full_recompute_keeps_every_input_in_its_recompute_pass(fallbacks):
    """Full recompute: the checkpointed forward runs without grad; its recompute in backward keeps
    every input (the strategy part says why for qkv/fc1, the recompute part for fc2)."""
    ckpt = "running inside activation checkpointing (its recompute must save what forward saved)"
    for variant in ("regather-rc", "lowrank-rc"):
        strategy = variant.split("-")[0]
        for r in variant_results(fallbacks, "full_recompute", variant):
            for path, seen in r["seen"].items():
                name = path.rsplit(".", 1)[-1]
                first = f"gather (asked {strategy}: autograd is disabled (torch.no_grad / inference_mode))"
                again = f"gather (asked {strategy}: {ckpt})"
                if name in ("linear_qkv", "linear_fc1"):
                    again += kept(GATHER_PATH)
                else:  # row-parallel: the path could recompute, activation checkpointing comes first
                    again += kept(ckpt)
                assert seen == [first, again], (path, seen)
            assert r["saved_adapter_input"] == 0  # nothing inside the checkpointed forward is kept


def test_full_recompute_decisions_do_not_promise_recompute(fallbacks):
    """decisions() before a forward says what every forward will do under full recompute: each runs
    inside the checkpoint, so no input is recomputed (fc2 once promised it)."""
    for r in variant_results(fallbacks, "full_recompute", "regather-rc"):
        assert all("input recomputed" not in d for d in r["before"].values()), r["before"]
        for path, d in r["before"].items():
            if path.endswith("linear_fc2"):
                assert d.endswith(kept("running inside activation checkpointing (its recompute must save what "
                                       "forward saved)")), (path, d)


def test_gated_bias_unfused_fc2_recomputes(matrix):
    """SwiGLU + add_bias_linear without fusion: the activation keeps views of ``fc1_out + bias``
    (silu's half, the linear half); fc2 recomputes from their base, which adds no bytes (the
    numerics and byte tests of the matrix cover the case too)."""
    for r in variant_results(matrix, "swiglu_bias", "regather-rc"):
        for i in range(L):
            assert r["decisions"][f"decoder.layers.{i}.mlp.linear_fc2"].endswith(
                recomputed("the MLP activation (silu, gated)"))


LATE_REASON = {
    "late_fc2_prehook": "the adapter input is not the MLP activation (gelu)'s output (linear_fc2's input was replaced)",
    "late_norm_inplace": "input_layernorm's output was modified in place before the adapter read it",
}


@pytest.mark.parametrize("setup", ["late_fc2_prehook", "late_norm_inplace"])
def test_input_changed_after_verification_is_never_recomputed_wrongly(fallbacks, setup):
    """A hook that starts changing the adapter input after the first (verified) forward: the
    producer checks of every forward see it (fc2: the input is not what MLP handed linear_fc2;
    norm: the producer's hook runs first, so a later in-place change is a new version); the
    input is kept from then on and the gradients equal gather's bit for bit."""
    for rank, (got, ref) in enumerate(zip(variant_results(fallbacks, setup, "regather-rc"),
                                          variant_results(fallbacks, setup, "gather"))):
        same(got["grads_first"], ref["grads_first"], f"rank {rank} step 1")
        same(got["grads"], ref["grads"], f"rank {rank} step 2 (hook on)")
        changed = [p for p, seen in got["seen"].items() if seen and seen[-1].endswith(kept(LATE_REASON[setup]))]
        assert changed, (setup, got["seen"])


# -- Transformer Engine routing (the TE model, both behaviours) -------------------------------------------


TE_FUSED = "the fused LayerNorm of the TE base"
TE_BEHAVIOURS = ("te<=2.3", "te2.8-2.20")


@pytest.mark.parametrize("behaviour", TE_BEHAVIOURS)
@pytest.mark.parametrize("norm", sorted(TE_NORMS))
@pytest.mark.parametrize("strategy", ["gather", "regather", "lowrank"])
def test_te_layernorm_base(fallbacks, behaviour, norm, strategy):
    """Recompute on the TE model under SP: bit-identical results and collectives; regather / lowrank
    rebuild the shard from the norm's input TE keeps, and TE's own copy of it (which it keeps because
    LoRA asked for it) is released: the allocator sees the shard gone. Saved-tensor hooks count TE's
    save of the shard either way (they see saves, not the release), and never as the adapter's: it is
    TE's storage."""
    s, b, h, t, e = 8, 2, 16, T, 4
    for rank, r in enumerate(te_results(fallbacks)):
        got, ref = r[(behaviour, norm, strategy, True)], r[(behaviour, norm, strategy, False)]
        for k in ("out", "out2", "dx", "dA", "dB"):
            same(got[k], ref[k], f"rank {rank} {norm}/{strategy} {k}")
        assert got["comm"] == ref["comm"]
        assert got["producer"] == "TELayerNormProducer"
        assert got["saved_total"] == ref["saved_total"]
        if strategy == "gather":
            assert got["decision"] == "gather" + kept(GATHER_PATH)
            assert got["alive"] == ref["alive"]
        else:
            assert got["decision"] == strategy + recomputed(TE_FUSED)
            assert (got["saved_adapter_input"], ref["saved_adapter_input"]) == (0, 0)
            assert ref["alive"] - got["alive"] == s // t * b * h * e


@pytest.mark.parametrize("behaviour", TE_BEHAVIOURS)
@pytest.mark.parametrize("strategy", ["gather", "regather"])
def test_te_sp_off_recomputes_from_the_fused_norm(fallbacks, behaviour, strategy):
    """SP off (the replicated path): the TE base's input is rebuilt from its fused norm on every
    strategy, as under SP; numerics and collectives unchanged, TE's copy of the whole norm output
    released."""
    s, b, h, e = 8, 2, 16, 4
    for rank, r in enumerate(te_results(fallbacks)):
        got, ref = r[(behaviour, "sp_off", strategy, True)], r[(behaviour, "sp_off", strategy, False)]
        for k in ("out", "out2", "dx", "dA", "dB"):
            same(got[k], ref[k], f"rank {rank} sp_off/{strategy} {k}")
        assert got["comm"] == ref["comm"]
        head = "gather" if strategy == "gather" else (
            f"gather (asked {strategy}: sequence parallelism is off for 'linear_qkv')")
        assert got["decision"] == head + recomputed(TE_FUSED)
        assert (got["saved_adapter_input"], ref["saved_adapter_input"]) == (0, 0)
        assert ref["alive"] - got["alive"] == s * b * h * e


@pytest.mark.parametrize("behaviour", TE_BEHAVIOURS)
@pytest.mark.parametrize("strategy", ["regather", "lowrank"])
def test_te_frozen_input_keeps(fallbacks, behaviour, strategy):
    for rank, r in enumerate(te_results(fallbacks)):
        got, ref = r[(behaviour, "no_x_grad", strategy, True)], r[(behaviour, "no_x_grad", strategy, False)]
        assert got["decision"] == strategy + kept(
            f"{TE_FUSED}: it keeps nothing for its backward (neither its input nor its weights need a gradient)")
        for k in ("out", "dA", "dB"):
            same(got[k], ref[k], f"rank {rank} {k}")
        assert got["saved_total"] == ref["saved_total"] and got["alive"] == ref["alive"]


def test_every_setup_ran_once_in_its_group(matrix, fallbacks):
    """The groups split each table exactly (no setup lost or run twice), each within the budget,
    and each spawn ran exactly its group's setups; -rP shows where the time went."""
    for table, spawns in (("MATRIX", matrix), ("FALLBACKS", fallbacks)):
        setups = TABLES[table]
        items = [n for g in spawns.groups for n in g]
        assert sorted(items) == sorted(list(setups) + (["te"] if table == "FALLBACKS" else [])), items
        assert all(sum(len(setups[n].variants) for n in g if n != "te") <= BUDGET for g in spawns.groups)
        secs = {}
        for i, ranks in spawns.run_all().items():
            for r in ranks:
                assert set(r["seconds"]) == set(spawns.groups[i]), (spawns.groups[i], sorted(r["seconds"]))
            secs.update(ranks[0]["seconds"])
        print(f"{table}: {len(spawns.groups)} spawns, {sum(secs.values()):.1f} s in setups; "
              f"slowest {sorted(secs.items(), key=lambda kv: -kv[1])[:3]}")


def test_decisions_after_a_forward_say_what_it_found(matrix):
    """After a forward, ``regather.decisions`` reports what only a forward can find out: layer 0's
    ``input_layernorm`` keeps nothing under frozen embeddings, so that input was kept (the forward
    itself asks the norm again next time: the decision is not frozen)."""
    r = variant_results(matrix, "fp32", "regather-rc")[0]
    assert r["after"]["decoder.layers.0.self_attention.linear_qkv"] == (
        "regather" + kept(FROZEN_INPUT)[:-1] + " (in the last forward))")
    assert r["after"]["decoder.layers.1.self_attention.linear_qkv"] == "regather" + recomputed("input_layernorm")
