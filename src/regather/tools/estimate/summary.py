"""``regather estimate``'s totals: per strategy, the bytes this GPU keeps and sends beyond the gather path.

**Adapter-input bytes** — what the LoRA-A weights keep for their gradient, per GPU, summed over
the adapters of the layers this GPU holds and over the micro-batches in flight: the dense terms
(:mod:`regather.tools.estimate.dense`) and the expert terms (:mod:`regather.tools.estimate.experts`).

**Communication** — bytes each rank *receives* per micro-batch (forward + backward) under ring
algorithms (``regather.core.accounting``): an all-gather of an output of ``n`` bytes costs
``n*(t-1)/t``, a reduce-scatter of an input of ``n`` bytes ``n*(t-1)/t``, an all-reduce
``2n*(t-1)/t``, an all-to-all over ``p`` ranks ``n_out*(p-1)/p`` (``n_out`` its output bytes).
Everything megatron-core itself sends is the same for every strategy and not part of the "extra".
"""

from __future__ import annotations

from dataclasses import replace

from regather.megatron.reasons import ALL_TARGETS, EXPERT_TARGETS
from regather.tools.estimate.config import ALL_STRATEGIES, Model, Run, check_run, split_strategy
from regather.tools.estimate.dense import adapter_inputs, dense_comm_changes
from regather.tools.estimate.dora import dora_output_bytes
from regather.tools.estimate.experts import expert_comm_changes, expert_inputs


def adapter_input_bytes(model: Model, run: Run, strategy: str) -> dict:
    """Per GPU, by target (all micro-batches in flight): the dense targets' and, in MoE layers,
    ``"experts.linear_fc1"`` / ``"experts.linear_fc2"`` (the EP x ETP group's mean)."""
    per_target: dict[str, int] = {}
    for row in adapter_inputs(model, run, strategy) + expert_inputs(model, run, strategy):
        for a in row:
            per_target[a.target] = per_target.get(a.target, 0) + a.kept_bytes
    return {k: v * run.in_flight for k, v in per_target.items()}


def lora_kept_bytes(model: Model, run: Run, strategy: str) -> dict:
    """What LoRA keeps after the forward per GPU, by target (all micro-batches in flight): the LoRA-A inputs and
    LoRA-B's rank-``r`` ``mid`` (:mod:`regather.tools.estimate.peak`); 0 inside an activation checkpoint."""
    per_target: dict[str, int] = {}
    for row in adapter_inputs(model, run, strategy) + expert_inputs(model, run, strategy):
        for a in row:
            per_target[a.target] = per_target.get(a.target, 0) + a.kept_bytes + a.mid_bytes
    return {k: v * run.in_flight for k, v in per_target.items()}


def recompute_summary(model: Model, run: Run, strategy: str) -> dict:
    """How many adapters recompute their input, by target, and why the others keep it (an
    expert row counts each of the layer's LoRA pairs it stands for)."""
    recomputed: dict[str, int] = {}
    kept: dict[str, int] = {}
    for row in adapter_inputs(model, run, strategy) + expert_inputs(model, run, strategy):
        for a in row:
            if a.recomputed_from:
                recomputed[a.target] = recomputed.get(a.target, 0) + a.adapters
            elif a.kept_because:
                key = f"{a.target}: {a.kept_because}"
                kept[key] = kept.get(key, 0) + a.adapters
    order = ALL_TARGETS + EXPERT_TARGETS
    return {"recomputed_by_target": {t: recomputed[t] for t in order if t in recomputed},
            "kept_by_reason": kept}


def shared_summary(model: Model, run: Run, strategy: str) -> dict:
    """How many adapters, by target, read a tensor their producer keeps anyway for its own backward
    (0 new bytes without any recompute: ``linear_proj`` under an attention that keeps its output)."""
    shared: dict[str, int] = {}
    for row in adapter_inputs(model, run, strategy):
        for a in row:
            if a.shared_with:
                shared[a.target] = shared.get(a.target, 0) + a.adapters
    return shared


def comm_changes(model: Model, run: Run, strategy: str) -> list[tuple[str, int, str]]:
    """Collectives a strategy adds (+) or removes (-) against the gather path, per micro-batch:
    ``[(kind, signed bytes received per rank, what), ...]`` summed over the eligible adapters
    (:func:`~regather.tools.estimate.dense.dense_comm_changes`) and, for a ``…-recompute`` variant,
    over the MoE layers whose expert fc1 input comes from the router's input
    (:func:`~regather.tools.estimate.experts.expert_comm_changes`)."""
    base, recompute = split_strategy(strategy)
    check_run(model, run)
    return dense_comm_changes(model, run, base) + (expert_comm_changes(model, run, strategy) if recompute else [])


def extra_comm_bytes(model: Model, run: Run, strategy: str) -> dict:
    """Net bytes received per rank per micro-batch beyond the gather path, by collective kind."""
    out: dict[str, int] = {}
    for kind, n, _ in comm_changes(model, run, strategy):
        out[kind] = out.get(kind, 0) + n
    return out


def saved_vs_gather(model: Model, run: Run, strategy: str) -> int:
    """Adapter-input bytes ``strategy`` keeps fewer than the gather path (per GPU)."""
    return sum(adapter_input_bytes(model, run, "gather").values()) - sum(
        adapter_input_bytes(model, run, strategy).values())


def estimate(model: Model, run: Run, strategies=ALL_STRATEGIES, gpu_gib: float | None = None) -> dict:
    """Per strategy: adapter-input bytes (dense and expert adapters), saved vs gather, extra comm
    (net by kind, and the bytes of the collectives it adds), and which adapters read a tensor kept
    anyway (``shared_by_target``, only when there is one). ``…-recompute`` rows also give
    the saving for both states of the decoder input (frozen embeddings: layer 0's qkv keeps
    its shard; an input that requires grad: it recomputes too) and what recomputes. Every row also has what LoRA
    keeps (``lora_kept_bytes``: its LoRA-A inputs and rank-``r`` tensors), LoRA's peak over the frozen model
    (``peak``, :func:`regather.tools.estimate.peak.peak`, and ``peak_other_output_path``: the classic output path's
    for a lean strategy, the lean one's for the gather path) and the per-GPU total, against ``gpu_gib`` GiB where
    given (``gpu``, :func:`regather.tools.estimate.memory.gpu_total`)."""
    from regather.tools.estimate.config import lean_output
    from regather.tools.estimate.memory import gpu_total
    from regather.tools.estimate.peak import peak

    out = {}
    for name in strategies:
        parts = adapter_input_bytes(model, run, name)
        changes = comm_changes(model, run, name)
        comm = extra_comm_bytes(model, run, name)
        row = {
            "adapter_input_bytes": sum(parts.values()),
            "adapter_input_by_target": parts,
            "saved_vs_gather": saved_vs_gather(model, run, name),
            "extra_comm_bytes": comm,
            "extra_comm_total": sum(comm.values()),
            "added_comm_bytes": sum(n for _, n, _ in changes if n > 0),
        }
        kept = lora_kept_bytes(model, run, name)
        row["lora_kept_bytes"] = sum(kept.values())
        row["lora_kept_by_target"] = kept
        row["peak"] = peak(model, run, name)
        row["peak_other_output_path"] = peak(model, run, name, lean=not lean_output(name))
        row["gpu"] = gpu_total(model, run, name, gpu_gib)
        if run.peft == "dora":  # only where asked (--peft dora): the default document is unchanged
            dora = dora_output_bytes(model, run)
            row["dora_output_bytes"], row["dora_output_by_target"] = sum(dora.values()), dora
        shared = shared_summary(model, run, name)
        if shared:  # only where asked (--attention fused): the default document is unchanged
            row["shared_by_target"] = shared
        if split_strategy(name)[1]:
            row["saved_vs_gather_frozen_input"] = saved_vs_gather(model, replace(run, input_requires_grad=False), name)
            row["saved_vs_gather_input_requires_grad"] = saved_vs_gather(
                model, replace(run, input_requires_grad=True), name)
            row.update(recompute_summary(model, run, name))
        out[name] = row
    return out
