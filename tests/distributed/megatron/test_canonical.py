"""``regather.CanonicalLoRA`` (one adapter per q, k, v, gate, up) on a real megatron-core GPT with
GQA (4 heads, 2 query groups), a gated SwiGLU MLP and no biases, TP=2 + SP on two gloo ranks.
One spawn (workers_canonical.canonical_suite) computes everything; megatron-core 0.16.1 here,
0.19.2 under ``make test-compat``.

Tolerances:
- gather vs regather (early and plain), also vs each other: bit-exact (rtol=atol=0) — the same
  GEMMs on the same operands; every strategy computes each adapter's own GEMMs. Every build is lean
  (``workers_canonical.LEAN``), the gather path too: the classic gather path sums the row-parallel
  targets' LoRA-B weight gradient in another order (docs/design.md §3.7).
- results that are not the same GEMMs — lowrank vs gather (another summation order), TP=1 vs TP=2
  (same full weights: other GEMM splits, other TP reductions) and the fused rank-3r reference at
  TP=1 — agree only to rounding, and how much depends on the machine's kernels (1e-6 and 1e-5 of
  the largest entry, the bounds here before, were each crossed with another BLAS path). Each is held
  against the gather path run in fp64 from the same weights (fp32's, or bf16's for bf16): its error
  within 3x the error of the computation it replaces (gather, TP=1) plus 4 ulps
  (tests.harness.numerics). A misplaced projection moves the logits by ~20 %, a missing TP sum of
  dA is O(1).
- merge: rtol=atol=1e-5 as test_merge (one fp32 rounding of W + scale*B@A).

Bytes (fp32, s=32, b=2, h=64, t=2): ``x_full = s*b*h*4 = 16384`` B, ``x_local = 8192`` B per
adapter input; an all-gather of x receives ``x_full*(t-1)/t = 8192`` B per rank.
"""

import pytest
import torch
import workers_canonical as W
from tests.harness.numerics import check_rounding

from regather.tools.cpu.dist import run_ranks

T = W.TP
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

L = W.SHAPE.num_layers
S, B, H = W.SHAPE.seq_length, W.MICRO_BATCH, W.SHAPE.hidden_size
FP32 = 4
X_FULL = S * B * H * FP32
X_LOCAL = X_FULL // T
X_GATHER = X_FULL * (T - 1) // T  # bytes one all-gather of x brings to a rank
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QKV_MEMBERS, FC1_MEMBERS = ("linear_q", "linear_k", "linear_v"), ("linear_fc1_gate", "linear_fc1_up")
WRAPPER_OF = {**dict.fromkeys(QKV_MEMBERS, "linear_qkv"), **dict.fromkeys(FC1_MEMBERS, "linear_fc1")}


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return run_ranks(W.canonical_suite, T, str(tmp_path_factory.mktemp("canonical")), timeout=300)


def case(res: dict, name: str):
    value = res[name]
    if isinstance(value, dict) and "error" in value:
        pytest.fail(f"case {name!r} raised in the ranks:\n{value['error']}", pytrace=False)
    return value


def same(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def rel_err(got, ref) -> float:
    got, ref = got.double(), ref.double()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _rows(grad, ref, rank):
    """A replicated (lowrank) LoRA-A gradient ``[r, h]`` against a rank shard ``[r/t, h]``."""
    return grad.chunk(T, 0)[rank] if grad.shape != ref.shape else grad


def identical(got: dict, ref: dict, what: str):
    for k in ("logits", "loss", "input_grad"):
        same(got[k], ref[k], f"{what}: {k}")
    assert got["grads"].keys() == ref["grads"].keys(), what
    for name, g in ref["grads"].items():
        same(got["grads"][name], g, f"{what}: {name}")


def within_rounding(got: dict, ref: dict, ref64: dict, what: str, rank: int = 0, dtype=torch.float32):
    """Logits, loss, decoder-input gradient and every adapter gradient of ``got`` within rounding of
    ``ref``'s (a computation of the same function with other GEMMs), against the fp64 run ``ref64``."""
    for k in ("logits", "loss", "input_grad"):
        check_rounding(got[k], ref[k], ref64[k], f"{what}: {k}", dtype=dtype)
    assert got["grads"].keys() == ref["grads"].keys(), what
    for name, g in ref["grads"].items():
        check_rounding(_rows(got["grads"][name], g, rank), g, ref64["grads"][name], f"{what}: {name}", dtype=dtype)


def qkv(saved: dict) -> int:
    return saved.get("adapter_input:linear_qkv", 0)


def fc1(saved: dict) -> int:
    return saved.get("adapter_input:linear_fc1", 0)


# -- numerics at TP=2 -----------------------------------------------------------------------------


@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_regather_bit_exact_with_gather(suite, dtype, fuse):
    """Loss, logits, decoder-input gradient and every adapter's gradient (``main_grad`` with
    gradient-accumulation fusion): early and plain regather == gather, bit for bit."""
    for rank, res in enumerate(suite):
        runs = case(res, "parity")
        gather = runs[(dtype, fuse, "gather")]
        assert len(gather["grads"]) == 2 * 7 * L  # A and B of 7 adapters per layer
        for name, g in gather["grads"].items():
            assert g.abs().max() > 0, f"{name}: all-zero gradient (the comparison would be empty)"
        for variant in ("plain", "early"):
            identical(runs[(dtype, fuse, variant)], gather, f"rank {rank} {dtype} fuse={fuse} {variant}")
        identical(runs[(dtype, fuse, "plain")], runs[(dtype, fuse, "early")], f"rank {rank} plain vs early")


@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lowrank_within_rounding_of_gather(suite, dtype, fuse):
    for rank, res in enumerate(suite):
        runs = case(res, "parity")
        within_rounding(runs[(dtype, fuse, "lowrank")], runs[(dtype, fuse, "gather")], runs["fp64"][dtype],
                        f"rank {rank} {dtype} fuse={fuse} lowrank", rank, DTYPES[dtype])


def test_fused_main_grad_equals_unfused_grad(suite):
    """fp32: ``main_grad`` accumulated through the fused path holds what ``.grad`` holds unfused."""
    for rank, res in enumerate(suite):
        runs = case(res, "parity")
        for variant in ("gather", "early", "plain"):
            fused, plain = runs[("float32", True, variant)], runs[("float32", False, variant)]
            for name, g in plain["grads"].items():
                same(fused["grads"][name], g, f"rank {rank} {variant} {name}")


# -- placement: TP=1 vs TP=2, and an independent per-projection reference --------------------------


def test_tp1_equals_tp2_on_the_same_full_weights(suite):
    """Placement by query group (q: 2 heads, k and v: 1 head per group, GQA) and by gate/up halves
    per TP shard is right iff TP=1 and TP=2 compute the same function from the same full weights."""
    for res in suite:
        tp1 = case(res, "tp1")
        assert tp1["canonical_weights_equal"]
        ref64 = case(res, "parity")["fp64"]["float32"]["full"]
        for variant in ("gather", "early"):
            tp2 = case(res, "parity")[("float32", False, variant)]["full"]
            within_rounding(tp2, tp1["canonical"], ref64, f"TP=2 {variant} vs TP=1")
        # the adapters matter: not the frozen model's logits
        effect = rel_err(case(res, "parity")[("float32", False, "gather")]["logits"], case(res, "parity")["base_logits"])
        assert effect > 0.05, effect


def test_canonical_equals_a_fused_rank_3r_lora_built_per_projection(suite):
    """TP=1: one fused LoRA of rank 3r whose ``A = [A_q; A_k; A_v]`` and block-diagonal ``B`` place
    each projection's rows where megatron's fused qkv has them (per group: query heads, key head,
    value head), and gate rows before up rows for fc1 — written out in the worker apart from
    regather's placement code. Same logits, input gradient and per-projection gradients."""
    for res in suite:
        tp1 = case(res, "tp1")
        within_rounding(tp1["canonical"], tp1["fused_reference"], case(res, "parity")["fp64"]["float32"]["full"],
                        "CanonicalLoRA vs the fused rank-3r reference")


# -- subsets of the targets ------------------------------------------------------------------------


@pytest.mark.parametrize("subset", list(W.SUBSETS))
def test_missing_projections_contribute_zeros(suite, subset):
    """Only linear_q + linear_v (or only linear_fc1_up): exactly the full model whose other
    adapters' LoRA-B are zero, for gather and regather; lowrank within its tolerance."""
    for rank, res in enumerate(suite):
        runs = case(res, "subsets")[subset]
        members = [m for m in QKV_MEMBERS + FC1_MEMBERS
                   if any(f".adapter.adapter_{m.split('_')[-1]}." in n for n in runs["names"])]
        assert members == {"q+v": ["linear_q", "linear_v"], "fc1_up": ["linear_fc1_up"]}[subset]
        ref = runs["reference"]
        for variant in ("gather", "early"):
            got = runs[variant]
            for k in ("logits", "loss", "input_grad"):
                same(got[k], ref[k], f"rank {rank} {subset} {variant}: {k}")
            assert sorted(got["grads"]) == runs["names"]
            for name, g in got["grads"].items():
                same(g, ref["grads"][name], f"rank {rank} {subset} {variant}: {name}")
                assert g.abs().max() > 0, name
            assert sorted(p.rsplit(".", 1)[-1] for p in got["decisions"]) == sorted(members * L)
        lowrank, ref64 = runs["lowrank"], runs["fp64"]
        for name, g in lowrank["grads"].items():
            check_rounding(_rows(g, ref["grads"][name], rank), ref["grads"][name], ref64["grads"][name], name)
        check_rounding(lowrank["logits"], ref["logits"], ref64["logits"], f"rank {rank} {subset} lowrank: logits")
        # not the frozen model
        assert rel_err(ref["logits"], case(res, "parity")["base_logits"]) > 1e-3


@pytest.mark.parametrize("subset", list(W.SUBSETS))
def test_subsets_tp1_equals_tp2(suite, subset):
    for res in suite:
        runs = case(res, "subsets")[subset]
        within_rounding(runs["gather"]["full"], case(res, "tp1")["subsets"][subset], runs["fp64"]["full"],
                        f"{subset} TP=2 vs TP=1")


@pytest.mark.parametrize("subset", list(W.SUBSETS))
def test_subset_bytes_and_gathers(suite, subset):
    """q+v: two adapters on one input share one x_local and one gather each way; fc1_up alone:
    one adapter (no share), x_local instead of x_full."""
    n = {"q+v": 2, "fc1_up": 1}[subset]
    part = {"q+v": qkv, "fc1_up": fc1}[subset]
    for res in suite:
        runs = case(res, "subsets")[subset]
        g, r = runs["gather"], runs["early"]
        assert part(g["saved"]) == L * n * X_FULL
        assert part(r["saved"]) == part(runs["lowrank"]["saved"]) == L * X_LOCAL
        assert g["comm"]["forward"]["calls"]["all_gather"] - r["comm"]["forward"]["calls"]["all_gather"] == L * (n - 1)
        assert r["comm"]["backward"]["calls"]["all_gather"] - g["comm"]["backward"]["calls"]["all_gather"] == L


# -- retained bytes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_adapter_inputs_retained(suite, dtype):
    """Per layer: gather keeps 3 x_full (q, k, v) + 2 x_full (gate, up) — what Bridge's CanonicalLoRA
    keeps; regather and lowrank keep 1 x_local for the three qkv adapters and 1 for the two fc1
    ones; nothing else changes."""
    scale = 1 if dtype == "float32" else 2  # bf16: half the bytes
    full_, local = X_FULL // scale, X_LOCAL // scale
    for res in suite:
        runs = case(res, "parity")
        g = runs[(dtype, False, "gather")]
        assert qkv(g["saved"]) == L * 3 * full_ and fc1(g["saved"]) == L * 2 * full_
        for variant in ("plain", "early", "lowrank"):
            r = runs[(dtype, False, variant)]
            assert qkv(r["saved"]) == L * local and fc1(r["saved"]) == L * local, variant
            assert g["saved_total"] - r["saved_total"] == L * (5 * full_ - 2 * local), variant
            others = {k: v for k, v in r["saved"].items() if not k.endswith(("linear_qkv", "linear_fc1"))}
            assert others == {k: v for k, v in g["saved"].items() if not k.endswith(("linear_qkv", "linear_fc1"))}


def test_recompute_adapter_inputs_saves_nothing_new(suite):
    """With recompute_adapter_inputs: 0 bytes for linear_fc1 (and linear_fc2) on every layer and for
    linear_qkv from layer 1 on; layer 0's qkv keeps its one shared x_local (its norm reads the
    frozen embeddings and saves nothing to recompute from). The gather path keeps its x_full."""
    for res in suite:
        rc, parity = case(res, "recompute"), case(res, "parity")
        gather = parity[("float32", False, "gather")]
        for variant in ("early", "plain", "lowrank"):
            r = rc[variant]
            assert qkv(r["saved"]) == X_LOCAL and fc1(r["saved"]) == 0, variant
            assert r["saved"].get("adapter_input:linear_fc2", 0) == 0
            fc2_kept = gather["saved"]["adapter_input:linear_fc2"]
            assert gather["saved_total"] - r["saved_total"] == L * 5 * X_FULL - X_LOCAL + fc2_kept, variant
            # bit-identical to the same strategy without recompute (regather == gather)
            identical(r, parity[("float32", False, "lowrank" if variant == "lowrank" else "gather")],
                      f"recompute {variant}")
            for path, d in r["decisions"].items():
                member = path.rsplit(".", 1)[-1]
                if member in FC1_MEMBERS or (member in QKV_MEMBERS and ".layers.0." not in path):
                    assert "input recomputed from" in d, (path, d)
        g = rc["gather"]
        assert qkv(g["saved"]) == L * 3 * X_FULL and fc1(g["saved"]) == L * 2 * X_FULL


# -- collectives ------------------------------------------------------------------------------------


def test_one_forward_gather_and_one_backward_regather_per_input(suite):
    """Counted calls and bytes (regather.core.accounting.CollectiveBytes). Against gather, regather makes
    3 fewer forward all-gathers of x per layer (qkv: 3 -> 1, fc1: 2 -> 1) and 2 more in backward
    (one re-gather per input, not per adapter); the scratch pool saw 2 forward and 2 backward
    leases per layer. Reduce-scatters and all-reduces are unchanged. lowrank gathers no x at all."""
    for res in suite:
        runs = case(res, "parity")
        g = runs[("float32", False, "gather")]["comm"]
        for variant in ("plain", "early"):
            r = runs[("float32", False, variant)]["comm"]
            assert g["forward"]["calls"]["all_gather"] - r["forward"]["calls"]["all_gather"] == 3 * L
            assert g["forward"]["bytes"]["all_gather"] - r["forward"]["bytes"]["all_gather"] == 3 * L * X_GATHER
            assert r["backward"]["calls"]["all_gather"] - g["backward"]["calls"]["all_gather"] == 2 * L
            assert r["backward"]["bytes"]["all_gather"] - g["backward"]["bytes"]["all_gather"] == 2 * L * X_GATHER
            for phase in ("forward", "backward"):
                for kind in ("reduce_scatter", "all_reduce"):
                    assert r[phase]["calls"][kind] == g[phase]["calls"][kind], (variant, phase, kind)
                    assert r[phase]["bytes"][kind] == g[phase]["bytes"][kind], (variant, phase, kind)
        lr = runs[("float32", False, "lowrank")]["comm"]
        assert g["forward"]["calls"]["all_gather"] - lr["forward"]["calls"]["all_gather"] == 5 * L
        assert g["forward"]["bytes"]["all_gather"] - lr["forward"]["bytes"]["all_gather"] == 5 * L * X_GATHER
        assert lr["backward"]["calls"]["all_gather"] == g["backward"]["calls"]["all_gather"]
        sched = case(res, "schedules")
        for variant in ("early", "plain"):  # two micro-batches: 2 per layer each way, each
            pool = sched[("interleaved", variant)]["pool"]["acquired"]
            assert pool == {"regather.forward.x_full": 2 * 2 * L, "regather.backward.x_full": 2 * 2 * L}


# -- schedules --------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["early", "plain"])
def test_interleaved_micro_batches(suite, variant):
    """fwd1 fwd2 bwd2 bwd1: accumulated gradients == gather's in the same order; every scratch lease
    returned after each step (forward scratch freed before the forward returns)."""
    for rank, res in enumerate(suite):
        sched = case(res, "schedules")
        got, ref = sched[("interleaved", variant)], sched[("interleaved", "gather")]
        for i in (0, 1):
            same(got["losses"][i], ref["losses"][i], f"micro-batch {i} loss")
        for name, g in ref["grads"].items():
            same(got["grads"][name], g, f"rank {rank} {variant} {name}")
        assert got["in_flight_after"] == {"f1": 0, "f2": 0, "b2": 0, "b1": 0}
        assert got["pool"]["in_flight"] == 0


@pytest.mark.parametrize("variant", ["early", "plain"])
def test_retain_graph_backward_twice(suite, variant):
    """Two backward calls on one graph: the shared gather resets after its last member, so the
    second backward re-gathers again (the same calls as the first) and returns every lease."""
    for rank, res in enumerate(suite):
        sched = case(res, "schedules")
        got, ref = sched[("retain", variant)], sched[("retain", "gather")]
        for step in (0, 1):
            for name, g in ref["grads"][step].items():
                same(got["grads"][step][name], g, f"rank {rank} {variant} backward {step} {name}")
        assert got["in_flight_after"] == [0, 0]
        assert got["backward_all_gathers"][0] == got["backward_all_gathers"][1] == \
            ref["backward_all_gathers"][0] + 2 * L
        assert got["pool"]["acquired"]["regather.backward.x_full"] == 2 * 2 * L


# -- decisions ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("label", ["early", "lowrank", "recompute"])
def test_decisions_per_member_as_for_lora(suite, label):
    """Decisions are listed by Bridge's target names (``…self_attention.linear_q``); each member
    decides as LoRA's fused adapter on the same linear does (train, eval, no_grad; with
    recompute_adapter_inputs also after a forward, incl. layer 0's frozen-embedding reason)."""
    for res in suite:
        table = case(res, "decisions")[label]
        for mode, (canon, fused) in table.items():
            assert len(canon) == 7 * L and len(fused) == 4 * L
            for path, d in canon.items():
                parent, member = path.rsplit(".", 1)
                assert member in W.ALL_TARGETS, path
                assert d == fused[f"{parent}.{WRAPPER_OF.get(member, member)}"], (mode, path, d)
        train = table["train"][0]
        used = {"early": "regather", "recompute": "regather", "lowrank": "lowrank"}[label]
        for path, d in train.items():
            if path.rsplit(".", 1)[-1] in WRAPPER_OF:
                if label == "recompute" and path.startswith("decoder.layers.0.self_attention."):
                    # after the forward: layer 0's norm kept nothing (frozen embeddings), so its
                    # members kept their inputs, and say so for that forward
                    assert d.startswith(f"{used}, input kept (recompute asked: ") and d.endswith(
                        "(in the last forward))"), (path, d)
                else:
                    assert d.startswith(used) and "asked" not in d, (path, d)
            else:
                assert d.startswith(f"gather (asked {used}: base layer"), (path, d)
        assert all("module is in eval mode" in d for d in table["eval"][0].values())
        assert all("autograd is disabled" in d for d in table["no_grad"][0].values())
        if label == "recompute":
            last = table["last"][0]
            assert "keeps nothing for its backward" in last["decoder.layers.0.self_attention.linear_k"]


def test_one_member_falls_back_alone(suite):
    """adapter_k's LoRA-A frozen: linear_k alone runs the gather path (named in the decision and in
    the log), q and v regather sharing one gather; outputs and gradients == the same on gather."""
    for rank, res in enumerate(suite):
        d = case(res, "decisions")
        runs = d["frozen_k"]
        for layer in range(L):
            p = f"decoder.layers.{layer}.self_attention."
            dec = runs["early"]["decisions"]
            assert dec[p + "linear_k"] == "gather (asked regather: LoRA-A weight is frozen (requires_grad=False))"
            assert dec[p + "linear_q"] == dec[p + "linear_v"] == "regather"
        identical(runs["early"], runs["gather"], f"rank {rank} frozen adapter_k")
        # q + v share: one forward and one backward lease per layer for qkv, one each for fc1; per
        # pass, and measure() runs two (the loss, then the decoder-input gradient)
        assert runs["early"]["pool"]["acquired"] == {"regather.forward.x_full": 2 * 2 * L,
                                                    "regather.backward.x_full": 2 * 2 * L}
        assert runs["early"]["pool"]["in_flight"] == 0
        # one line for the reason, counting both layers' linear_k
        assert d["frozen_k_messages"] == [
            f"LoRA: regather requested, using the gather path on {L} adapters: LoRA-A weight is frozen "
            f"(requires_grad=False) (decoder.layers.0.self_attention.linear_k and {L - 1} more; "
            "regather.decisions(model) lists them)"]


# -- checkpoints ---------------------------------------------------------------------------------------


def test_state_dict_keys_are_bridges(suite):
    for res in suite:
        sd = case(res, "state_dict")
        qkv_prefix = "decoder.layers.0.self_attention.linear_qkv."
        fc1_prefix = "decoder.layers.0.mlp.linear_fc1."
        tail = ["linear_in.weight", "linear_in._extra_state", "linear_out.weight", "linear_out._extra_state"]
        assert sd["keys"] == [qkv_prefix + k for k in ["weight", "_extra_state"] + [
            f"adapter.adapter_{x}.{t}" for x in "qkv" for t in tail]]
        assert sd["fc1_keys"] == [fc1_prefix + k for k in ["weight", "_extra_state"] + [
            f"adapter.adapter_{x}.{t}" for x in ("gate", "up") for t in tail]]


@pytest.mark.parametrize("pair", [f"{a}->{b}" for a in ("gather", "early", "lowrank") for b in ("gather", "early", "lowrank")])
def test_state_dict_strict_round_trip_across_strategies(suite, pair):
    src, dst = pair.split("->")
    for res in suite:
        sd = case(res, "state_dict")
        r = sd[(src, dst)]
        assert rel_err(r["before"], sd[("logits", dst)]) > 1e-3  # other weights until the load
        same(r["after"], sd[("logits", dst)], f"{pair} logits")
        assert r["same_state_dict"], f"{pair}: the loaded model writes another state dict"


def test_merge_and_unmerge(suite):
    """regather.megatron.merge on a CanonicalLoRA model: the merged frozen model gives the adapter model's
    logits; unmerge restores the weights (exactly with keep_original)."""
    for res in suite:
        m = case(res, "merge")
        for keep, r in m.items():
            assert len(r["paths"]) == 4 * L and r["adapters_when_merged"] == 0 and r["adapters_after"] == 7 * L
            torch.testing.assert_close(r["merged"], r["before"], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(r["after"], r["before"], rtol=1e-5, atol=1e-5)
            assert rel_err(r["merged"], r["before"]) <= 1e-5
            assert r["exact_restore"] if keep else r["weight_err"] <= 1e-6, (keep, r["weight_err"])
        same(m[True]["after"], m[True]["before"], "keep_original: the adapter model again")


def test_sharded_state_dict_layout(suite):
    """Plain ShardedTensors, split over TP on axis 0 (column LoRA-A, every LoRA-B) or 1 (row LoRA-A);
    gate/up LoRA-B are plain ``[ffn, r]`` tensors (no SwiGLU factory: each holds one half)."""
    r = W.DIM
    shapes = {"self_attention.linear_qkv.adapter.adapter_q": ((r, H), (64, r)),
              "self_attention.linear_qkv.adapter.adapter_k": ((r, H), (32, r)),
              "self_attention.linear_qkv.adapter.adapter_v": ((r, H), (32, r)),
              "mlp.linear_fc1.adapter.adapter_gate": ((r, H), (128, r)),
              "mlp.linear_fc1.adapter.adapter_up": ((r, H), (128, r)),
              "self_attention.linear_proj.adapter": ((r, H), (H, r)),
              "mlp.linear_fc2.adapter": ((r, 128), (H, r))}
    row_parallel = ("linear_proj", "linear_fc2")
    for rank, res in enumerate(suite):
        layout = case(res, "ckpt")["layout"]
        assert len(layout) == 2 * len(shapes)
        for name, (a_shape, b_shape) in shapes.items():
            for part, shape in (("linear_in", a_shape), ("linear_out", b_shape)):
                e = layout[f"decoder.layers.0.{name}.{part}.weight"]
                assert e["type"] == "ShardedTensor" and e["key"] == f"decoder.layers.{name}.{part}.weight"
                assert e["global_shape"] == (L, *shape), (name, part)
                axis = 1 if part == "linear_in" and name.split(".")[1] in row_parallel else 0
                offset = [0, 0]
                offset[axis] = rank * shape[axis] // T
                assert e["global_offset"] == (0, *offset), (name, part, e)


def test_dist_checkpoint_tp2_reloads_and_reshards_to_tp1(suite):
    """Saved at TP=2 (regather), loaded at TP=2 into gather and lowrank models and at TP=1: the
    adapter weights exactly; TP=2 logits exactly (gather) / lowrank and TP=1 within rounding of the saved model's, against its fp64 logits."""
    for res in suite:
        ck = case(res, "ckpt")
        for variant in ("gather", "lowrank"):
            got = ck[("tp2", variant)]
            assert got["weights"].keys() == ck["weights"].keys()
            for name, w in ck["weights"].items():  # a replicated LoRA-A is the full [r, h] already
                assert torch.equal(got["weights"][name], w), (variant, name)
            if variant == "gather":
                same(got["logits"], ck["logits"], "TP=2 reload logits")
            else:
                check_rounding(got["logits"], ck["logits"], ck["logits64"], "TP=2 lowrank reload logits")
        tp1 = case(res, "tp1")["ckpt"]
        assert tp1["weights"].keys() == ck["weights"].keys()
        for name, w in ck["weights"].items():
            assert torch.equal(tp1["weights"][name], w), name
        check_rounding(tp1["logits"], ck["logits"], ck["logits64"], "TP=1 reload logits")


# -- refusals and debug checks ----------------------------------------------------------------------


def test_non_gated_fc1_gate_up_targets_are_refused(suite):
    """linear_fc1_up / linear_fc1_gate on a NON-gated fc1: there are no gate/up halves (rank i holds
    rows [i*ffn/t, (i+1)*ffn/t) of one projection), and placing two per rank would compute another
    function at every TP size (Bridge 0.6.2 does that, tests/distributed/megatron/bridge/test_bridge_canonical.py). Refused
    at TP=1 and TP=2, naming the targets and what to do, before anything changed."""
    for res in suite:
        for tp in ("not_gated_tp1", "not_gated_tp2"):
            got = res[tp]
            assert got.get("error") is not None, got
            msg = got["error"]
            assert "['linear_fc1_gate', 'linear_fc1_up']" in msg and "not gated" in msg, msg
            assert "gated_linear_unit=False" in msg and "regather.LoRA" in msg, msg
            assert got["unchanged"], f"{tp}: the model or the RNG changed before the refusal"


def test_install_shape_checks_on_a_canonical_model(suite):
    """regather.megatron.lora.install_shape_checks on CanonicalLoRA's split wrappers (several adapters, one TP
    group): equal shapes pass; unequal local sequences are named on both ranks before any collective."""
    n_wrappers = L * 4  # qkv, proj, fc1, fc2 per layer
    for rank, res in enumerate(suite):
        got = res["shape_checks"]
        assert "error" not in got, got
        assert got["handles"] == n_wrappers and got["wrapper"] == "LoRALinearSplit", got
        want = f"(rank 0: ({S // T}, {B}, {H}), rank 1: ({S // T - 2}, {B}, {H}))"
        assert got["mismatch"].startswith("ValueError: LoRA linear 'decoder.layers.0.self_attention.linear_qkv'"), got
        assert want in got["mismatch"], (rank, got["mismatch"])
