"""The decision sentences and names shared by the adapters, ``regather estimate`` and ``regather doctor``.

An adapter explains each choice with one of these sentences (``regather.decisions(model)``, the
fallback log); ``estimate`` and ``doctor`` predict the same choices without building a model and
must say the same thing, so the sentences live here, once. Sentences that carry a value are
built where the value is known; a reason never embeds a measured number (numbers go into the
decision's ``detail``, so one reason is logged once whatever the numbers).
"""

from __future__ import annotations

from regather.core.decision import expected
from regather.core.recompute.reasons import NOTHING_KEPT

#: megatron's four LoRA targets (Megatron Bridge's default ``target_modules``).
ALL_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
#: CanonicalLoRA's targets (Hugging Face's layout: one adapter per q / k / v and gate / up;
#: :mod:`regather.megatron.canonical`).
CANONICAL_TARGETS = ("linear_q", "linear_k", "linear_v", "linear_proj", "linear_fc1_up", "linear_fc1_gate",
                     "linear_fc2")
#: The column-parallel bases whose input is a sequence shard under SP: they may re-gather.
ELIGIBLE_BASES = ("linear_qkv", "linear_fc1")
#: The norm whose output each eligible base reads (what recompute_adapter_inputs reruns).
NORM_OF = {"linear_qkv": "input_layernorm", "linear_fc1": "pre_mlp_layernorm"}
#: The producer of a Transformer Engine ``linear_qkv`` / ``linear_fc1`` adapter's input: the norm TE fuses into
#: ``TELayerNormColumnParallelLinear`` (``regather.megatron.dense.producers.TELayerNormProducer``).
TE_FUSED_NORM = "the fused LayerNorm of the TE base"

IN_CHECKPOINT = expected("running inside activation checkpointing (its recompute must save what forward saved)")
CPU_OFFLOADING = "CPU activation offloading is on (cpu_offloading=True)"


def kept_as_is(path: str) -> str:
    """Why a column-parallel adapter on the ``path`` path keeps its input: "gather" under SP (the
    replicated path of TP = 1 / SP off rebuilds its input from the norm, as regather does)."""
    return (f"the {path} path keeps its input as it is (recompute of a column-parallel adapter's input needs "
            "regather or lowrank)")


def no_recomputable_producer(base: str) -> str:
    """Why the adapter on ``base`` (linear_proj) has nothing to rebuild its input from."""
    return f"{base} has no recomputable producer (only linear_qkv, linear_fc1 and linear_fc2 do)"


def layernorm_recomputed(modules) -> str:
    """Why a norm keeps nothing to rebuild from: megatron's selective recompute of 'layernorm'."""
    return f"selective recompute covers 'layernorm' (recompute_modules={list(modules)})"


# -- mixture of experts ----------------------------------------------------------------------------

#: Keys of the expert rows in ``estimate`` (MoE layers).
EXPERT_TARGETS = ("experts.linear_fc1", "experts.linear_fc2")
#: megatron's token dispatchers whose route regather replays.
REPLAYED_DISPATCHERS = ("alltoall", "allgather")
#: megatron's token dispatchers (``moe_token_dispatcher_type``).
DISPATCHERS = REPLAYED_DISPATCHERS + ("flex",)

#: An expert's input is the token dispatcher's output (tokens routed to this rank's experts,
#: already gathered over expert TP), never a sequence shard of a LayerNorm output.
EXPERT_REASON = expected("expert linear: its input is the token dispatcher's output, not a sequence shard")
#: An expert linear_fc1's input: the tokens after permutation and all-to-all / all-gather. With
#: frozen experts no op of the MoE layer saves them (permute keeps indices, the frozen expert
#: linear keeps no input), so there is nothing to rebuild them from.
EXPERT_INPUT_KEPT = "expert linear_fc1: its input is the dispatched tokens, which no op of the MoE layer keeps"
PREDISPATCH = "the router's input: LoRA-A runs before the dispatch (one LoRA-A for the local experts)"
REDISPATCH = "the router's input, dispatched again in backward"
REDISPATCH_OPT_IN = ("per-expert LoRA-A: its input comes back only by dispatching the router's input again in "
                     "backward, one more dispatch of the tokens per MoE layer (opt in: "
                     "LoRA(redispatch_expert_inputs=True))")
ROUTER_KEEPS_NOTHING = f"the router: {NOTHING_KEPT}"
MOE_ACT_RECOMPUTED = "selective recompute covers the experts' activation ('moe_act' in recompute_modules)"
ROUTE_NOT_REPRODUCED = "sending the router's input along this forward's route does not reproduce the dispatched tokens"
