"""The configuration rules of expert fc1 inputs from the router's input (regather.megatron.moe.inputs):
the refusals the CPU suite cannot run on megatron's MoE layers (they need DeepEP / HybridEP, fp8 or
Transformer Engine), each with its sentence, and the LoRA option's validation. The refusals that do
run on CPU are tested on megatron's own layers in tests/distributed/megatron/moe/test_moe_fallbacks.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from regather import LoRA
from regather.megatron.dense.eligibility import IN_CHECKPOINT
from regather.megatron.moe import dispatch, inputs


def _moe(dispatcher=None, experts=None, **config):
    """The attributes of a megatron ``MoELayer`` the rules read (its config, experts, dispatcher)."""
    if dispatcher is None:
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

        dispatcher = MoEAlltoAllTokenDispatcher.__new__(MoEAlltoAllTokenDispatcher)  # the class is what counts
    cfg = SimpleNamespace(moe_token_dispatcher_type="alltoall", **config)
    return SimpleNamespace(config=cfg, experts=experts or SimpleNamespace(), token_dispatcher=dispatcher)


def test_a_plain_layer_is_accepted():
    assert inputs.static_reason(_moe()) is None


@pytest.mark.parametrize("config, words", [
    (dict(recompute_granularity="full"), IN_CHECKPOINT),
    (dict(recompute_granularity="selective", recompute_modules=["moe"]), IN_CHECKPOINT),
    (dict(recompute_granularity="selective", recompute_modules=["layernorm"]), "selective recompute covers 'layernorm'"),
    (dict(moe_pad_expert_input_to_capacity=True), "capacity drop-and-pad"),
    (dict(moe_router_padding_for_quantization=True), "padded for quantization"),
    (dict(moe_apply_probs_on_input=True), "moe_apply_probs_on_input=True"),
    (dict(fp8="hybrid"), "fp8 / fp4"),
    (dict(fp4="nvfp4"), "fp8 / fp4"),
    (dict(moe_latent_size=128), "moe_latent_size"),
    (dict(moe_input_jitter_eps=0.01), "jittered copy"),
    (dict(cpu_offloading=True), "CPU activation offloading"),
])
def test_configuration_refusals(config, words):
    why = inputs.static_reason(_moe(**config))
    assert why is not None and words in why, why


def test_selective_recompute_of_other_modules_is_fine():
    assert inputs.static_reason(_moe(recompute_granularity="selective", recompute_modules=["moe_act"])) is None


@pytest.mark.parametrize("attr, words", [("offload_expert_fc1", "offloaded"), ("_with_fused_impl", "fused grouped MLP")])
def test_expert_module_refusals(attr, words):
    why = inputs.static_reason(_moe(experts=SimpleNamespace(**{attr: True})))
    assert why is not None and words in why, why


def test_flex_dispatcher_is_refused_by_name():
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    flex = MoEFlexTokenDispatcher.__new__(MoEFlexTokenDispatcher)
    why = dispatch.unsupported_reason(flex, SimpleNamespace(moe_token_dispatcher_type="flex"))
    assert why.startswith("the 'flex' token dispatcher (MoEFlexTokenDispatcher) fuses permutation and exchange"), why


def test_allgather_dispatcher_is_replayable():
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    d = MoEAllGatherTokenDispatcher.__new__(MoEAllGatherTokenDispatcher)
    assert dispatch.unsupported_reason(d, SimpleNamespace(moe_token_dispatcher_type="allgather")) is None


def test_redispatch_needs_recompute():
    with pytest.raises(ValueError, match=r"redispatch_expert_inputs=True.*recompute_adapter_inputs=True"):
        LoRA(redispatch_expert_inputs=True)
    assert LoRA(redispatch_expert_inputs=True, recompute_adapter_inputs=True).redispatch_expert_inputs
