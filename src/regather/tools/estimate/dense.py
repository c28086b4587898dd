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

from dataclasses import replace

from regather.core.recompute.reasons import NOTHING_KEPT
from regather.megatron.reasons import ALL_TARGETS, kept_as_is, no_recomputable_producer
from regather.tools.estimate.config import (
    ATTENTION_OUTPUT,
    AdapterInput,
    Model,
    Run,
    check_run,
    checkpointed_layers,
    checkpointed_target,
    eligible_per_layer,
    layers_here,
    lean_output,
    needs_grad,
    recompute_modules,
    ring,
    split_strategy,
)
from regather.tools.estimate.spec import norm_producer, replicated, te_release_reason, te_shard_beside

MLP_ACTIVATION = "the MLP activation"  # the producer of a dense fc2 input (its function's name omitted)
ROW_TARGETS = ("linear_proj", "linear_fc2")  # row-parallel bases


def adapter_inputs(model: Model, run: Run, strategy: str) -> list[list[AdapterInput]]:
    """Per layer of this GPU (first layer first), each targeted dense adapter's input, per
    micro-batch. Recompute (``…-recompute``): qkv/fc1 on an eligible regather/lowrank adapter,
    fc2 on every strategy, when the producer keeps a tensor
    (:func:`~regather.tools.estimate.config.producer_inputs_need_grad`); the reasons are the ones
    the adapters give (``regather.decisions``). Experts: :func:`regather.tools.estimate.experts.expert_inputs`."""
    base, recompute = split_strategy(strategy)
    check_run(model, run)
    s, b, t, e = run.local_seq, run.micro_batch, run.tp, run.e
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
        layers.append([replace(a, mid_bytes=mid_bytes(model, run, a.target, lean_output(strategy))) for a in row])
    return checkpointed(model, run, strategy, layers)


def mid_bytes(model: Model, run: Run, target: str, lean: bool) -> int:
    """The rank-``r`` tensor a dense adapter keeps for LoRA-B's weight gradient, per micro-batch: ``mid`` over the
    sequence this GPU's linears see, ``[s, b, r]``; a lean row adapter under SP keeps it on its own sequence shard,
    ``[s/t, b, r]`` (docs/design.md 3.7)."""
    s, b, r, t, e = run.local_seq, run.micro_batch, run.lora_rank, run.tp, run.e
    shard = lean and target in ROW_TARGETS and run.sp and t > 1
    return s * b * r * e // (t if shard else 1)


def checkpointed(model: Model, run: Run, strategy: str, layers: list[list[AdapterInput]]) -> list[list[AdapterInput]]:
    """``layers`` with every adapter inside megatron's activation checkpoint (full recompute's layers, selective
    ``mlp``'s dense MLP) keeping nothing after the forward: its ``checkpointed_bytes`` are what it keeps in the
    recomputed forward until its layer's backward is done. An adapter in a checkpoint takes the gather path
    (``regather.megatron.dense.eligibility``: no re-gather, no recompute of its input), its output path the asked
    strategy's."""
    full = checkpointed_layers(model, run)
    if not any(full) and not recompute_modules(run):
        return layers
    plain = replace(run, recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                    recompute_modules=())
    gather = adapter_inputs(model, plain, "gather")
    lean = lean_output(strategy)
    out = []
    for i, row in enumerate(layers):
        kept = {a.target: a.kept_bytes for a in gather[i]}
        out.append([AdapterInput(a.target, 0, adapters=a.adapters, shared_with=a.shared_with,
                                 checkpointed_bytes=kept[a.target] + mid_bytes(model, run, a.target, lean))
                    if checkpointed_target(model, run, full[i], a.target) else a for a in row])
    return out


def dense_comm_changes(model: Model, run: Run, strategy: str) -> list[tuple[str, int, str]]:
    """The eligible dense adapters' changes for ``strategy`` (gather, regather or lowrank): the
    module doc's strategy table. Recomputing a dense input sends nothing."""
    n = len(eligible_per_layer(model, run)) * layers_here(model, run)
    s, b, h, r, t, e, eg = run.local_seq, run.micro_batch, model.hidden, run.lora_rank, run.tp, run.e, run.eg
    rows = lean_row_comm(model, run) if lean_output(strategy) else []
    if strategy == "gather" or n == 0:
        return rows
    x = ring(s * b * h * e, t)
    if strategy == "regather":
        return [("all_gather", n * x, "backward re-gather of x_local")] + rows
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
    ] + rows


def lean_row_comm(model: Model, run: Run) -> list[tuple[str, int, str]]:
    """What the lean row path (``regather.core.peak.row``: LoRA-B on this rank's rows, its ``[o/t, r]`` weight
    gathered instead of its output) sends beyond the classic one, per micro-batch, summed over the dense row
    adapters (linear_proj, a dense linear_fc2) of this GPU at TP > 1 (``o = h``, ``f = (t-1)/t``):

    - under SP: ``mid`` reduce-scattered over the sequence (``s*b*r*e*f``) and ``dmid`` all-gathered back in
      backward, instead of ``mid`` all-reduced in forward and ``dmid`` in backward (``2 * 2*s*b*r*e*f``); LoRA-B's
      weight all-gathered in forward and again in backward (``2 * o*r*e*f``) and its gradient, summed in fp32 over
      each rank's tokens, reduce-scattered (``o*r*4*f``), instead of LoRA-B's output gathered over its columns
      (``s*b*o*e*f``) and ``dY`` over the sequence in backward (the same);
    - SP off: LoRA-B's weight gathered (``o*r*e*f``) instead of its output (``s*b*o*e*f``); the backward is the
      classic one."""
    t = run.tp
    names = [n for n in ROW_TARGETS if n in run.targets and not (model.moe and n == "linear_fc2")]
    n = len(names) * layers_here(model, run)
    if t == 1 or n == 0:
        return []
    s, b, h, r, e = run.local_seq, run.micro_batch, model.hidden, run.lora_rank, run.e
    mid, out, weight = ring(s * b * r * e, t), ring(s * b * h * e, t), ring(h * r * e, t)
    if not run.sp:
        return [("all_gather", n * (weight - out), "row adapters: LoRA-B [o/t, r] gathered instead of its output")]
    return [
        ("all_reduce", -4 * n * mid, "row adapters: mid and dmid all-reduces (lean: mid reduce-scattered over the "
                                     "sequence)"),
        ("reduce_scatter", n * mid, "row adapters: mid reduce-scattered over the sequence"),
        ("reduce_scatter", n * ring(h * r * 4, t), "row adapters: LoRA-B's weight gradient (fp32) reduce-scattered"),
        ("all_gather", n * mid, "row adapters: dmid gathered over the sequence in backward"),
        ("all_gather", 2 * n * weight, "row adapters: LoRA-B [o/t, r] gathered, in forward and in backward"),
        ("all_gather", -2 * n * out, "row adapters: LoRA-B's output gathered over its columns, dY over the "
                                     "sequence (lean: neither)"),
    ]
