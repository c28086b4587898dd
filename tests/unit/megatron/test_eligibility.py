"""Every eligibility rule (docs/design.md §5), with its exact reason."""

from types import SimpleNamespace

import pytest

from regather.megatron.dense.eligibility import AdapterFacts, RunState, unsupported_reason

OK_FACTS = AdapterFacts(base_name="linear_qkv", column_parallel=True, sequence_parallel=True, tp_size=2)
OK_STATE = RunState(training=True, grad_enabled=True, in_recompute=False, lora_a_trainable=True)


def cfg(**kw):
    base = dict(cpu_offloading=False, cpu_offloading_activations=True, cuda_graph_impl="none",
                enable_cuda_graph=False, external_cuda_graph=False, recompute_granularity=None,
                recompute_modules=["core_attn"])
    base.update(kw)
    return SimpleNamespace(**base)


def reason(facts=OK_FACTS, config=None, state=OK_STATE, **changes):
    fact_changes = {k: v for k, v in changes.items() if k in AdapterFacts.__dataclass_fields__}
    state_changes = {k: v for k, v in changes.items() if k in RunState.__dataclass_fields__}
    facts = AdapterFacts(**{**facts.__dict__, **fact_changes})
    state = RunState(**{**state.__dict__, **state_changes})
    return unsupported_reason(facts, config if config is not None else cfg(), state)


def test_eligible_column_adapter_has_no_reason():
    assert reason() is None
    assert reason(base_name="linear_fc1") is None


@pytest.mark.parametrize(
    "changes, expected",
    [
        (dict(training=False), "module is in eval mode"),
        (dict(grad_enabled=False), "autograd is disabled (torch.no_grad / inference_mode)"),
        (dict(in_recompute=True), "running inside activation checkpointing (its recompute must save what forward saved)"),
        (dict(lora_a_trainable=False), "LoRA-A weight is frozen (requires_grad=False)"),
        (dict(column_parallel=False, base_name="linear_proj"),
         "base layer 'linear_proj' is row-parallel (its input is split over hidden, not sequence)"),
        (dict(sequence_parallel=False), "sequence parallelism is off for 'linear_qkv'"),
        (dict(tp_size=1), "tensor-parallel size is 1"),
        (dict(is_expert=True, base_name="linear_fc1"),
         "expert linear: its input is the token dispatcher's output, not a sequence shard"),
        (dict(explicit_comm=True, base_name="linear_fc1"),
         "base layer 'linear_fc1' leaves its TP communication to its caller (explicit_expert_comm / "
         "parallel_mode=None: a MoE shared expert with overlap)"),
        (dict(a2a_experts=True), "adapter uses all-to-all expert communication (a2a_experts=True)"),
        (dict(activation="silu"), "adapter activation is 'silu', not 'identity'"),
        (dict(base_name="linear_q_down_proj"),
         "base layer 'linear_q_down_proj' is not one of linear_qkv, linear_fc1"),
    ],
)
def test_each_adapter_or_state_rule(changes, expected):
    assert reason(**changes) == expected


@pytest.mark.parametrize(
    "config, expected",
    [
        (cfg(cpu_offloading=True), "CPU activation offloading is on (cpu_offloading=True)"),
        (cfg(fine_grained_activation_offloading=True), "fine-grained activation offloading is on"),
        (cfg(cuda_graph_impl="local"), "CUDA graphs are on (cuda_graph_impl='local')"),
        (cfg(cuda_graph_impl="transformer_engine"), "CUDA graphs are on (cuda_graph_impl='transformer_engine')"),
        (cfg(enable_cuda_graph=True), "CUDA graphs are on (enable_cuda_graph=True)"),
        (cfg(external_cuda_graph=True), "CUDA graphs are on (external_cuda_graph=True)"),
        (cfg(recompute_granularity="full"), "full activation recompute is on (recompute_granularity='full')"),
    ],
)
def test_each_config_rule(config, expected):
    assert reason(config=config) == expected


def test_cpu_offloading_of_weights_only_keeps_regather():
    assert reason(config=cfg(cpu_offloading=True, cpu_offloading_activations=False)) is None


def test_selective_mlp_recompute_only_affects_fc1():
    config = cfg(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])
    assert reason(config=config, base_name="linear_fc1") == (
        "selective recompute covers 'mlp' (recompute_modules=['core_attn', 'mlp'])"
    )
    assert reason(config=config, base_name="linear_qkv") is None
    attn_only = cfg(recompute_granularity="selective", recompute_modules=["core_attn"])
    assert reason(config=attn_only, base_name="linear_fc1") is None


def test_rules_are_checked_in_order():
    # eval mode is reported before a structural reason
    assert reason(training=False, tp_size=1) == "module is in eval mode"
    assert reason(tp_size=1, base_name="linear_proj", column_parallel=False).startswith(
        "base layer 'linear_proj' is row-parallel")
    # an expert says so before any layout rule: an expert-TP group of one (EP > 1, ETP = 1) is not
    # "sequence parallelism is off", and an expert fc2 is an expert before it is row-parallel
    for layout in (dict(tp_size=1, sequence_parallel=False), dict(column_parallel=False, base_name="linear_fc2")):
        assert reason(is_expert=True, explicit_comm=True, **layout).startswith("expert linear:")


def test_missing_config_fields_default_to_eligible():
    assert unsupported_reason(OK_FACTS, SimpleNamespace(), OK_STATE) is None
    assert unsupported_reason(OK_FACTS, None, OK_STATE) is None
