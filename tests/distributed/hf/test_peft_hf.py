"""HF PEFT interop against the real libraries (peft 0.21.2, transformers 5.24.0, CPU, offline).

The megatron side is a Llama-style GPT (RMSNorm, SwiGLU, no biases, rope, untied embeddings,
4 heads in 2 query groups) at TP=2 with SP; the HF side is ``LlamaForCausalLM`` built from a
config with the same base weights (``tests.harness.hf_llama``). One spawn runs every case
(workers_peft_hf.hf_suite); the tests read its results.

Tolerance, fp32 logits (magnitude ~3-4): 1e-5 absolute. The two sides compute the same function
with other GEMM splits and orders (TP=2 partial sums + all-reduce, a fused qkv GEMM vs three,
megatron's vs HF's attention); measured 1.5e-6 for the base models and at most 2.9e-6 with
adapters, while a wrong convention is far above it (a rope base of 500: 0.8; HF's default RMSNorm
eps 1e-6 instead of megatron's 1e-5: 2e-3).
"""

import math
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("peft")
pytest.importorskip("transformers")

import workers_peft_hf as W

from regather.tools.cpu.dist import run_ranks

T = 2
TOL = 1e-5
@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return run_ranks(W.hf_suite, T, str(tmp_path_factory.mktemp("peft_hf")), timeout=240)


def _max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


# -- base models -----------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_base_logits_agree_and_the_check_can_fail(suite):
    r0 = suite[0]
    for rank in range(T):
        assert _max_diff(suite[rank]["base_megatron"], r0["base_hf"]) <= TOL
    assert r0["base_hf"].abs().max() > 1.0
    # the comparison sees the conventions it relies on: another rope base, HF's default eps
    assert _max_diff(r0["base_megatron"], r0["base_hf_rope_theta_500"]) > 0.1
    assert _max_diff(r0["base_megatron"], r0["base_hf_rms_norm_eps_1e-6"]) > 1e-4


# -- regather -> PEFT --------------------------------------------------------------------------

KEY_WARNING_WORDS = ("missing", "unexpected", "not found", "were not used", "newly initialized")


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(W.EXPORTS))
def test_export_loads_in_peft_with_megatrons_logits_and_no_warning(suite, name):
    case = suite[0]["export"][name]
    for rank in range(T):
        assert _max_diff(suite[rank]["export"][name]["megatron"], case["peft"]) <= TOL
    assert _max_diff(case["peft"], suite[0]["base_hf"]) > 0.5  # the adapter changes the model
    for w in case["warnings"]:
        assert not any(word in w.lower() for word in KEY_WARNING_WORDS), w
    # whatever PEFT says when loading its own adapter of the same targets (a transformers
    # deprecation notice), and nothing more
    assert sorted(set(case["warnings"])) == sorted(set(case["peft_own_warnings"]))


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(W.EXPORTS))
def test_export_writes_the_fields_and_tensors_peft_writes(suite, name):
    case = suite[0]["export"][name]
    ours, theirs = case["config"], case["peft_config"]
    assert sorted(ours) == sorted(theirs)
    assert case["keys"] == case["peft_keys"]  # the same modules, so PEFT's own targets match ours
    differ = {k for k in ours if ours[k] != theirs[k]}
    # target_modules: PEFT writes a set's order; peft_version: PEFT stamps its own on load
    assert differ <= {"target_modules", "peft_version", "base_model_name_or_path"}, {
        k: (ours[k], theirs[k]) for k in differ}
    assert sorted(ours["target_modules"]) == sorted(theirs["target_modules"])
    assert ours["base_model_name_or_path"] == "tiny-llama" and ours["peft_version"] is None
    if name == "layer1":
        assert ours["layers_to_transform"] == [1] and ours["layers_pattern"] == "layers"
    if name == "irregular":  # modules on different layers: exact names
        assert all(t.startswith("model.layers.") for t in ours["target_modules"])


# -- PEFT -> regather --------------------------------------------------------------------------


def _load_ids():
    return [f"{a}->{m}" for a, m, _ in W.LOADS]


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(W.LOADS)), ids=_load_ids())
def test_peft_adapter_loads_with_hf_logits_or_is_refused_unchanged(suite, index):
    adapter, model, expect = W.LOADS[index]
    cases = [suite[rank]["load"][index] for rank in range(T)]
    assert cases[0]["adapter"] == adapter and cases[0]["model"] == model
    if expect is None:
        for case in cases:
            assert case["error"] is None, case["error"]
            assert _max_diff(case["megatron"], cases[0]["hf"]) <= TOL
            assert all(case["weights_equal"].values()), [k for k, v in case["weights_equal"].items() if not v]
        assert _max_diff(cases[0]["hf"], suite[0]["base_hf"]) > 0.5
    else:
        for case in cases:
            assert case["error"] is not None, f"{adapter} loaded into {model}"
            assert case["error_type"] == "UnsupportedAdapter"
            assert expect in case["error"], case["error"]
            assert case["unchanged"], "a refused load changed the model's adapter weights or scales"


def _case(suite, adapter, model="lora", rank=0):
    for i, (a, m, _) in enumerate(W.LOADS):
        if (a, m) == (adapter, model):
            return suite[rank]["load"][i]
    raise KeyError((adapter, model))


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_scales_follow_rslora_and_alpha_pattern(suite):
    plain = W.ALPHA / W.R
    assert set(_case(suite, "shared_A")["scales"].values()) == {plain}
    assert set(_case(suite, "rslora")["scales"].values()) == {W.ALPHA / math.sqrt(W.R)}
    scales = _case(suite, "alpha_pattern")["scales"]
    for path, s in scales.items():
        want = 32 / W.R if "linear_qkv" in path else (4 / W.R if path == "decoder.layers.1.mlp.linear_fc2" else plain)
        assert s == want, (path, s)
    for path, s in _case(suite, "alpha_pattern_split", "canonical")["scales"].items():
        assert s == (32 if path.endswith("linear_q") else W.ALPHA) / W.R, (path, s)
    for path, s in _case(suite, "rslora_alpha_pattern")["scales"].items():
        assert s == (4 if path.endswith("linear_fc2") else W.ALPHA) / math.sqrt(W.R), (path, s)


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("adapter", W.ROUND_TRIPS)
def test_loaded_scales_export_back_to_peft(suite, adapter):
    case = _case(suite, adapter)
    assert _max_diff(case["roundtrip"], case["hf"]) <= 1e-6  # HF on both sides, same weights
    for w in case["roundtrip_warnings"]:
        assert not any(word in w.lower() for word in KEY_WARNING_WORDS), w
    config = case["roundtrip_config"]
    if adapter == "rslora":
        assert config["use_rslora"] is True and config["lora_alpha"] == W.ALPHA and config["alpha_pattern"] == {}
    else:
        assert config["use_rslora"] is False and config["lora_alpha"] == W.ALPHA
        assert config["alpha_pattern"] == {"q_proj": 32, "k_proj": 32, "v_proj": 32, "model.layers.1.mlp.down_proj": 4}


# -- PEFT's rules, without ranks -------------------------------------------------------------


