"""``regather estimate``'s dense terms: what linear_qkv, linear_proj and dense fc1 / fc2 adapters keep and send.

**Adapter-input bytes**, per adapter and micro-batch (``e`` = activation bytes, ``t`` TP size,
SP on):

======================= ===================== =============================
adapter                 gather                regather / lowrank
======================= ===================== =============================
linear_qkv, dense fc1   ``s*b*h*e``           ``s*b*h/t*e`` (eligible)
linear_proj             ``s*b*(heads*d)/t*e`` same (row-parallel, ineligible)
linear_proj, fused attn 0 (its output, kept) 0
dense linear_fc2        ``s*b*ffn/t*e``       same
======================= ===================== =============================

Without SP, or at TP=1, every strategy keeps ``s*b*h*e`` for qkv/fc1. These are the local spec's
terms; the TE spec (``Run.spec="te"``, :mod:`regather.tools.estimate.spec`) adds TE's ``ln_out``
shard beside the gather path's gathered copy under SP. linear_proj's input is
the attention output: new bytes under megatron's unfused local attention (it saves the
probabilities and V), none where the attention kernel keeps its output for its own backward
(flash-attention, Transformer Engine's fused attention: ``--attention fused``,
``Run.attention_keeps_output``), on every strategy.

**Recompute** (``<strategy>-recompute`` = ``LoRA(recompute_adapter_inputs=True)``,
:mod:`regather.megatron.dense.producers`): an adapter that rebuilds its input in backward adds
**0** bytes — it saves the tensor its producer already keeps. Which ones do:

======================= ============================================================
adapter                 recomputes when
======================= ============================================================
linear_qkv, dense fc1   regather or lowrank on an eligible adapter (SP, TP>1), or any
                        strategy on the replicated path (TP=1, or SP off), and the
                        norm's input (``input_layernorm`` / ``pre_mlp_layernorm``;
                        on the TE spec the base's fused norm) requires grad; on the
                        TE spec also where the run's rule releases TE's ``ln_out``
                        (:func:`~regather.tools.estimate.spec.te_release_reason`);
                        on the gather path under SP: kept
dense linear_fc2        every strategy, when fc1's output requires grad
linear_proj             never (no recomputable producer)
======================= ============================================================

**Communication** relative to the gather path, per eligible adapter (``f = (t-1)/t``, ``eg`` =
dA gradient bytes):

========= ============================== ====================================
strategy  added                          removed
========= ============================== ====================================
regather  all-gather ``s*b*h*e*f``       —
lowrank   reduce-scatter ``s*b*r*e*f``,  all-gather ``s*b*h*e*f``,
          all-reduce ``2*r*h*eg*f``      reduce-scatter ``s*b*h*e*f``,
                                         all-reduce ``2*s*b*r*e*f``
========= ============================== ====================================

(Where a qkv/fc1 input needs no gradient — the same rule as above: layer 0's
qkv with frozen embeddings, layer 0's fc1 with no adapter before it — no path
reduce-scatters its ``dX``, so lowrank removes one such reduce-scatter less.
Lowrank's forward all-gather of ``mid`` over the sequence, ``s*b*r``
elements, replaces the gather path's all-gather of ``mid`` over the rank, of
the same size; its ``dA`` all-reduce is per micro-batch when done in
backward, the library default.) Recomputing a dense input sends nothing.
"""

from __future__ import annotations

from regather.core.recompute.graph import NOTHING_KEPT
from regather.megatron.reasons import ALL_TARGETS, kept_as_is, no_recomputable_producer
from regather.tools.estimate.config import (
    ATTENTION_OUTPUT,
    AdapterInput,
    Model,
    Run,
    check_run,
    eligible_per_layer,
    layers_here,
    needs_grad,
    ring,
    split_strategy,
)
from regather.tools.estimate.spec import norm_producer, replicated, te_release_reason, te_shard_beside

MLP_ACTIVATION = "the MLP activation"  # the producer of a dense fc2 input (its function's name omitted)


def adapter_inputs(model: Model, run: Run, strategy: str) -> list[list[AdapterInput]]:
    """Per layer of this GPU (first layer first), each targeted dense adapter's input, per
    micro-batch. Recompute (``…-recompute``): qkv/fc1 on an eligible regather/lowrank adapter,
    fc2 on every strategy, when the producer keeps a tensor
    (:func:`~regather.tools.estimate.config.producer_inputs_need_grad`); the reasons are the ones
    the adapters give (``regather.decisions``). Experts: :func:`regather.tools.estimate.experts.expert_inputs`."""
    base, recompute = split_strategy(strategy)
    check_run(model, run)
    s, b, t, e = run.seq, run.micro_batch, run.tp, run.e
    eligible = eligible_per_layer(model, run)
    local = base != "gather"
    refused = te_release_reason(run) if recompute else None  # the TE spec: the run's release rule
    layers = []
    for need_grad in needs_grad(model, run):
        row = []
        for name in ALL_TARGETS:
            if name not in run.targets or (model.moe and name in ("linear_fc1", "linear_fc2")):
                continue
            if name in ("linear_qkv", "linear_fc1"):
                shard = local and name in eligible
                gathered = not shard and not replicated(run)  # the gather path under SP
                kept = s * b * model.hidden * e // (t if shard else 1) + te_shard_beside(model, run, gathered)
                if not recompute:
                    row.append(AdapterInput(name, kept))
                elif gathered:
                    row.append(AdapterInput(name, kept, kept_because=kept_as_is("gather")))
                elif refused:  # TE's ln_out is the input: kept as without recompute
                    row.append(AdapterInput(name, kept, kept_because=refused))
                elif not need_grad[name]:
                    row.append(AdapterInput(name, kept, kept_because=f"{norm_producer(name, run)}: {NOTHING_KEPT}"))
                else:
                    row.append(AdapterInput(name, 0, recomputed_from=norm_producer(name, run)))
            elif name == "linear_proj" and run.attention_keeps_output:
                row.append(AdapterInput(name, 0, shared_with=ATTENTION_OUTPUT))
            elif name == "linear_proj":
                kept = s * b * model.attn_width // t * e
                row.append(AdapterInput(name, kept, kept_because=no_recomputable_producer(name) if recompute else None))
            else:  # dense linear_fc2: the activation output [s, b, ffn/t]
                kept = s * b * model.ffn // t * e
                if not recompute:
                    row.append(AdapterInput(name, kept))
                elif not need_grad[name]:
                    row.append(AdapterInput(name, kept, kept_because=f"{MLP_ACTIVATION}: {NOTHING_KEPT}"))
                else:
                    row.append(AdapterInput(name, 0, recomputed_from=MLP_ACTIVATION))
        layers.append(row)
    return layers


def dense_comm_changes(model: Model, run: Run, strategy: str) -> list[tuple[str, int, str]]:
    """The eligible dense adapters' changes for ``strategy`` (gather, regather or lowrank): the
    module doc's strategy table. Recomputing a dense input sends nothing."""
    n = len(eligible_per_layer(model, run)) * layers_here(model, run)
    s, b, h, r, t, e, eg = run.seq, run.micro_batch, model.hidden, run.lora_rank, run.tp, run.e, run.eg
    if strategy == "gather" or n == 0:
        return []
    x = ring(s * b * h * e, t)
    if strategy == "regather":
        return [("all_gather", n * x, "backward re-gather of x_local")]
    mid = ring(s * b * r * e, t)
    # dX exists (and the gather path reduce-scatters it) only where the norm output needs a
    # gradient: not for layer 0's qkv with frozen embeddings, nor for fc1 before any adapter
    eligible = eligible_per_layer(model, run)
    with_dx = sum(need[name] for need in needs_grad(model, run) for name in eligible)
    return [
        ("all_gather", -n * x, "forward gather of x (not needed)"),
        ("reduce_scatter", -with_dx * x, "backward reduce-scatter of dX (dX is local)"),
        ("all_reduce", -2 * n * mid, "LoRA-B input-grad all-reduce (reduce-scatter sums dmid)"),
        ("reduce_scatter", n * mid, "backward reduce-scatter of dmid over s"),
        ("all_reduce", 2 * n * ring(r * h * eg, t), "dA all-reduce of the replicated LoRA-A"),
    ]
