"""``regather doctor``'s analytic rules: every adapter's decision for a :class:`Setup`, without building a model.

Adapter decisions come from the same :func:`regather.megatron.dense.eligibility.unsupported_reason`
every adapter runs; the recompute part from :func:`recompute_part`, which writes the sentences the
adapters and their producers give (``regather.megatron.dense.producers``) in the order they check
them — including the per-forward one for layer 0 (frozen embeddings: ``input_layernorm`` keeps
nothing, so layer 0's ``linear_qkv`` keeps its input),
:func:`regather.tools.estimate.producer_inputs_need_grad`. On the TE spec a ``linear_qkv`` /
``linear_fc1`` input comes from the base's fused norm where the run would release TE's ``ln_out``:
:func:`te_release_reason` calls the run's own rule
(:func:`regather.megatron.dense.te_rule.release_reason`).

MoE (``--moe``): expert fc1's recompute outcome is the adapters' (:mod:`regather.megatron.moe.inputs`),
in their order — a per-expert LoRA-A (SequentialMLP, or grouped experts with
``share_expert_adapters=False``) without ``redispatch_expert_inputs`` gets no producer, then
megatron's checkpoint, then the MoE layer's configuration (:func:`regather.megatron.moe.inputs.static_reason`
on a stand-in layer: the flex dispatcher, offloading, ...), then a router whose input needs no
gradient (:func:`regather.tools.estimate.expert_fc1_source`).
"""

from __future__ import annotations

from types import SimpleNamespace

from regather.core.recompute.reasons import NOTHING_KEPT
from regather.megatron.reasons import (
    CPU_OFFLOADING,
    DISPATCHERS,
    ELIGIBLE_BASES,
    IN_CHECKPOINT,
    MOE_ACT_RECOMPUTED,
    NORM_OF,
    REDISPATCH_OPT_IN,
    TE_FUSED_NORM,
    kept_as_is,
    layernorm_recomputed,
    no_recomputable_producer,
)
from regather.tools.doctor.setup import Setup, shares_expert_lora


def config_namespace(setup: Setup):
    """The TransformerConfig attributes eligibility reads."""
    return SimpleNamespace(
        cpu_offloading=setup.cpu_offloading,
        cpu_offloading_activations=True,
        fine_grained_activation_offloading=False,
        cuda_graph_impl="local" if setup.cuda_graphs else "none",
        recompute_granularity=setup.recompute_granularity,
        recompute_method=setup.recompute_method,
        recompute_modules=list(setup.recompute_modules),
    )


def requested_strategy(setup: Setup):
    """The :class:`~regather.core.strategies.Strategy` ``setup.strategy`` names."""
    from regather.core.strategies import Strategy

    return Strategy.parse(setup.strategy)


def analytic_decisions(setup: Setup) -> dict[str, dict]:
    """``{path: {"requested", "used", "reason", "recompute", "recompute_reason"}}`` for every
    adapter, from the eligibility rules and, with ``recompute_adapter_inputs``, the producer
    rules (:func:`recompute_part`); the last two are None when recompute is not asked."""
    from regather.core.strategies import Strategy
    from regather.megatron.dense.eligibility import AdapterFacts, RunState, unsupported_reason
    from regather.tools.estimate import producer_inputs_need_grad

    requested = requested_strategy(setup)
    config = config_namespace(setup)
    state = RunState(training=True, grad_enabled=True, in_recompute=False, lora_a_trainable=True)
    layers = setup.layers // max(setup.pp, 1)
    needs_grad = producer_inputs_need_grad(setup.targets, layers, setup.input_requires_grad)
    out = {}
    for layer in range(layers):
        for name in setup.targets:
            module = "self_attention" if name in ("linear_qkv", "linear_proj") else "mlp"
            facts = AdapterFacts(
                base_name=name, column_parallel=name in ELIGIBLE_BASES,
                sequence_parallel=setup.sp and setup.tp > 1, tp_size=setup.tp,
                is_expert=setup.moe and module == "mlp",
            )
            reason = None if requested == Strategy.GATHER else unsupported_reason(facts, config, state)
            used = Strategy.GATHER if reason else requested
            recompute, why = recompute_part(setup, name, used.value, needs_grad[layer].get(name, False))
            out[f"decoder.layers.{layer}.{module}.{name}"] = {
                "requested": requested.value, "used": used.value, "reason": reason,
                "recompute": recompute, "recompute_reason": why}
    return out


def activation_name(setup: Setup) -> str:
    """The producer name an MLP activation has in ``regather.decisions`` (regather.megatron.dense.producers)."""
    return "the MLP activation (silu, gated)" if setup.activation == "swiglu" else "the MLP activation (gelu)"


def recompute_part(setup: Setup, name: str, used: str, producer_input_needs_grad: bool
                   ) -> tuple[str | None, str | None]:
    """``(producer, None)`` when the adapter on ``name`` recomputes its input, ``(None, reason)``
    when it keeps it — the sentences :meth:`ParallelLinearAdapter.decide` and the producers'
    per-forward checks give (``regather.megatron.dense.producers``), in the same order; ``(None, None)`` when
    recompute is not asked."""
    if not setup.recompute_adapter_inputs:
        return None, None
    if setup.moe and name in ("linear_fc1", "linear_fc2"):  # the dispatched path decides first
        return _expert_recompute_part(setup, name, producer_input_needs_grad)
    sp = setup.sp and setup.tp > 1
    if name in ELIGIBLE_BASES and sp and used == "gather":  # TP = 1 / SP off: the replicated path recomputes
        return None, kept_as_is("gather")
    if name == "linear_proj":
        return None, no_recomputable_producer(name)
    if name == "linear_fc2" and setup.cpu_offloading:
        return None, CPU_OFFLOADING
    modules = list(setup.recompute_modules)
    from regather.megatron.dense.eligibility import checkpointed_by_config

    if checkpointed_by_config(setup, name):  # the Setup has the config's two recompute fields
        return None, IN_CHECKPOINT
    if name == "linear_fc2":
        producer = activation_name(setup)
    elif setup.spec == "te":  # TE's fused norm (TELayerNormProducer): the release rule the run applies
        producer = TE_FUSED_NORM
        refused = te_release_reason(setup)
        if refused:
            return None, refused
    else:
        producer = NORM_OF[name]
        if setup.recompute_granularity == "selective" and "layernorm" in modules:
            return None, layernorm_recomputed(modules)
    if not producer_input_needs_grad:
        return None, f"{producer}: {NOTHING_KEPT}"
    return producer, None


def te_release_reason(setup: Setup) -> str | None:
    """Why a TE ``linear_qkv`` / ``linear_fc1`` adapter of this run cannot release the ``ln_out`` TE keeps
    for it, or None: :func:`regather.megatron.dense.te_rule.release_reason`, the rule the run applies, on
    what the setup knows (its TE version — ``--te-version``, else the installed one, else the newest read —
    and megatron's CPU offload)."""
    from regather.megatron.dense import te_rule
    from regather.tools.estimate.spec import TE_VERSION_DEFAULT

    return te_rule.release_reason(te_rule.ReleaseFacts(version=setup.te_version or TE_VERSION_DEFAULT,
                                                       cpu_offloading=setup.cpu_offloading))


def _expert_recompute_part(setup: Setup, name: str, needs_grad: bool) -> tuple[str | None, str | None]:
    """An expert adapter's recompute outcome: fc1 from the router's input (:func:`_expert_fc1_part`);
    fc2 rebuilds its input from the experts' activation x probs (regather.megatron.moe.producers)."""
    from regather.megatron.dense.eligibility import checkpointed_by_config
    from regather.megatron.moe.producers import grouped_name

    if name == "linear_fc1":
        return _expert_fc1_part(setup, needs_grad)
    modules = list(setup.recompute_modules) if setup.recompute_granularity == "selective" else []
    if checkpointed_by_config(setup, name, expert=True):  # full, or selective 'moe' ('mlp' skips MoE layers)
        return None, IN_CHECKPOINT
    if setup.cpu_offloading:
        return None, CPU_OFFLOADING
    producer = activation_name(setup)
    if setup.experts == "grouped":
        if "moe_act" in modules:
            return None, MOE_ACT_RECOMPUTED
        producer = grouped_name(producer)
    if not needs_grad:
        return None, f"{producer}: {NOTHING_KEPT}"
    return producer, None


def _expert_fc1_part(setup: Setup, router_input_needs_grad: bool) -> tuple[str | None, str | None]:
    """Expert fc1 in the adapter's order (``ParallelLinearAdapter._recompute_unsupported``): a
    per-expert LoRA-A without the re-dispatch opt-in has no producer (``REDISPATCH_OPT_IN``), then
    megatron's checkpoint (full, or selective ``moe``: ``IN_CHECKPOINT``, as for fc2), then
    the MoE layer's configuration (:func:`moe_static_reason`), then the router's input: it keeps
    nothing unless it requires grad (the pre-MLP norm's input does)."""
    from regather.megatron.dense.eligibility import checkpointed_by_config
    from regather.tools.estimate import expert_fc1_source

    producer, why = expert_fc1_source(shares_expert_lora(setup), setup.redispatch_expert_inputs,
                                      router_input_needs_grad)
    if why == REDISPATCH_OPT_IN:
        return None, why
    if checkpointed_by_config(setup, "linear_fc1", expert=True):
        return None, IN_CHECKPOINT
    static = moe_static_reason(setup)
    if static:
        return None, static
    return producer, why


def moe_static_reason(setup: Setup) -> str | None:
    """:func:`regather.megatron.moe.inputs.static_reason` for this setup: why no expert fc1 input of a MoE
    layer can come from the router's input, from the configuration alone (or None). It runs on a
    stand-in layer — the setup's config attributes, and an instance of megatron's dispatcher class
    for ``setup.dispatcher`` made without ``__init__`` (only its class is read)."""
    import warnings

    from regather.megatron.moe.inputs import static_reason

    if setup.dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher {setup.dispatcher!r}: expected one of {DISPATCHERS}")
    with warnings.catch_warnings():  # megatron warns about missing TE / Apex on import
        warnings.simplefilter("ignore")
        from megatron.core.transformer.moe import token_dispatcher as td
    kind = {"alltoall": td.MoEAlltoAllTokenDispatcher, "allgather": td.MoEAllGatherTokenDispatcher,
            "flex": getattr(td, "MoEFlexTokenDispatcher", None)}[setup.dispatcher]
    dispatcher = object.__new__(kind) if kind is not None else type("MoEFlexTokenDispatcher", (), {})()
    config = SimpleNamespace(**vars(config_namespace(setup)), moe_token_dispatcher_type=setup.dispatcher)
    return static_reason(SimpleNamespace(config=config, experts=SimpleNamespace(), token_dispatcher=dispatcher))
