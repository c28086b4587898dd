"""``regather estimate --front-end torchtitan``: what torchtitan's LoRA and regather's torchtitan variants
keep and send, on torchtitan's llama3 / qwen3 (dense) blocks under its own sharding config.

**Adapter-input bytes** per layer and micro-batch (``e`` activation bytes, ``N = s*b`` tokens, ``t``
TP, SP on; targets by torchtitan's names, :data:`regather.torchtitan.reasons.TARGETS`):

============== ========================== ==================== ==========================================
adapter        torchtitan's LoRA / gather regather / lowrank   ``-recompute``
============== ========================== ==================== ==========================================
``wqkv``       ``N*h*e`` (gathered input) ``N*h/t*e`` (shard)  0: ``attention_norm``'s input (gather: kept)
``w1``, ``w3`` ``N*h*e``, one storage     ``N*h/t*e``, one     0: ``ffn_norm``'s input (gather: kept)
``w2``         ``N*ffn/t*e``              the same             0: the SwiGLU operands, every variant
``wo``         0: the attention output, which the attention keeps for its backward (SDPA, FlexAttention)
============== ========================== ==================== ==========================================

``w1`` and ``w3`` read one gathered input (one shard): it counts once, under ``w1`` (under ``w3``
when only ``w3`` is adapted), as ``regather bench --torchtitan`` counts it. Besides LoRA-A's inputs,
LoRA-B keeps its rank-r input, ``N*r*e`` per adapter on every variant: *LoRA over the frozen model*
is both. Without SP, or at TP 1, every column adapter runs torchtitan's path (``N*h*e``, the
reason :data:`~regather.torchtitan.reasons.GATHER_KEEPS` under recompute); ``w2`` still recomputes.

Which inputs can be rebuilt follows the Megatron rule
(:func:`~regather.tools.estimate.config.producer_inputs_need_grad`, with ``wqkv`` / ``wo`` / ``w1``
or ``w3`` / ``w2`` for qkv / proj / fc1 / fc2): a producer keeps a tensor only when its input
requires grad. torchtitan's LoRA freezes the embeddings, so with frozen embeddings layer 0's
``attention_norm`` keeps nothing and layer 0's ``wqkv`` keeps its shard; ``--input-requires-grad``
(a later pipeline stage, or an embedding output that requires grad, as ``regather bench --torchtitan``
makes it) rebuilds it too. ``wo``'s input is new bytes only where the attention's inputs need no
gradient (no ``wqkv`` adapter and a layer input that needs none).

The norm's input is what ``wqkv``/``w1``/``w3`` are rebuilt from, so it must be a tensor the norm's
autograd node keeps. In fp32 it is (measured). In bf16 torch's composite ``rms_norm`` — the one CPU
runs — upcasts and keeps the fp32 copy instead, so there those adapters keep their shard (measured
with ``regather bench --torchtitan --dtype bfloat16``; ``norm_upcasts`` / ``--norm-upcasts``). On
CUDA torch runs ``rms_norm`` as its fused kernel (``_fused_rms_norm``, which DTensor shards), whose
backward reads the input: the default here, not run on a GPU.

**Communication** per micro-batch against torchtitan's LoRA (``f = (t-1)/t``):

================= ===============================================================================
variant           added
================= ===============================================================================
regather          per layer one all-gather ``N*h*e*f`` of the shard in backward per gathering module:
                  ``attention`` (``wqkv``), ``feed_forward`` (``w1`` and ``w3`` together)
regather-plain    (``early_regather=False``) one per column adapter: ``w1`` and ``w3`` each
lowrank           per column adapter a rank-r all-gather ``N*r*e*f`` (forward) and reduce-scatter
                  ``N*r*e*f`` (backward); nothing removed (the base needs the gathered input anyway),
                  and LoRA-A's partial gradient is reduced where torchtitan reduces its own
================= ===============================================================================

Recomputing sends nothing. Agrees byte for byte with ``regather bench --torchtitan``
(``tests/distributed/tools/test_bench_titan.py``).
"""

from __future__ import annotations

from dataclasses import replace

from regather.core.recompute.reasons import NOTHING_KEPT, SOURCE_NOT_KEPT
from regather.tools.estimate.config import AdapterInput, Model, Run, layers_here, producer_inputs_need_grad, ring
from regather.tools.estimate.report import gb, model_json
from regather.torchtitan import reasons
from regather.torchtitan.options import BASELINE, VARIANTS, variant_fields

ATTENTION_KEEPS = "the attention output, which the attention keeps for its backward (SDPA, FlexAttention)"
# torchtitan's names for the linears Megatron's rule is written in
_MEGATRON = {"wqkv": "linear_qkv", "wo": "linear_proj", "w1": "linear_fc1", "w3": "linear_fc1", "w2": "linear_fc2"}


def check_titan(model: Model, run: Run) -> None:
    """A ``ValueError`` naming the values for a layout torchtitan cannot run or this estimate does not model."""
    bad = [t for t in run.targets if t not in reasons.TARGETS]
    if bad or not run.targets:
        raise ValueError(f"targets {list(run.targets)}: torchtitan's block linears are {', '.join(reasons.TARGETS)}")
    if model.moe:
        raise ValueError(f"{model.name} has experts: torchtitan's LoRA adapts Linear configs, not GroupedExperts "
                         "(docs/torchtitan.md)")
    if (run.ep, run.etp) != (1, 1):
        raise ValueError(f"EP {run.ep} / expert TP {run.etp}: a dense torchtitan model has no experts")
    for what, size in (("sequence", run.seq if run.sp else 0), ("heads", model.heads),
                       ("kv heads", model.kv_heads or model.heads), ("ffn", model.ffn)):
        if size % run.tp:
            raise ValueError(f"{what} {size} is not divisible by TP {run.tp}")


def sharded(run: Run) -> bool:
    """Whether the column adapters' input is gathered over the sequence (SP on, TP > 1)."""
    return run.sp and run.tp > 1


def _ffn_reader(targets) -> str | None:
    """The adapter ``w1`` / ``w3``'s one input is counted under (``w1`` runs first)."""
    return next((t for t in ("w1", "w3") if t in targets), None)


def norm_keeps_input(run: Run, norm_upcasts: bool) -> bool:
    """Whether a norm's autograd keeps its input, what ``wqkv``/``w1``/``w3`` are rebuilt from: in
    fp32 always; in bf16 / fp16 not where the norm upcasts (``norm_upcasts``: torch's composite
    ``rms_norm``, as on CPU, keeps its fp32 copy instead)."""
    return run.e >= 4 or not norm_upcasts


def titan_inputs(model: Model, run: Run, variant: str, norm_upcasts: bool = False) -> list[list[AdapterInput]]:
    """Per layer of this GPU, each targeted adapter's LoRA-A input, per micro-batch (the module
    doc's table; ``w1``/``w3``'s shared input once, under :func:`_ffn_reader`); the reasons are the
    ones the adapters give (``regather.torchtitan.decisions``)."""
    check_titan(model, run)
    norm_keeps = norm_keeps_input(run, norm_upcasts)
    fields = variant_fields(variant) or {}
    recompute = fields.get("recompute_adapter_inputs", False)
    shard = sharded(run) and fields.get("sequence_parallel_input_strategy", "gather") != "gather"
    s, b, t, e = run.seq, run.micro_batch, run.tp, run.e
    targets = [t_ for t_ in reasons.TARGETS if t_ in run.targets]
    megatron = tuple(_MEGATRON[t_] for t_ in targets)
    decoder_grad = run.input_requires_grad or not run.first_stage
    ffn_reader = _ffn_reader(targets)
    layers = []
    for need in producer_inputs_need_grad(megatron, layers_here(model, run), decoder_grad):
        row = []
        for name in targets:
            if name in reasons.COLUMN_TARGETS:
                kept = 0 if name not in ("wqkv", ffn_reader) else s * b * model.hidden * e // (t if shard else 1)
                if not recompute:
                    row.append(AdapterInput(name, kept))
                elif not shard:
                    row.append(AdapterInput(name, kept, kept_because=reasons.GATHER_KEEPS))
                elif not need[_MEGATRON[name]]:
                    row.append(AdapterInput(name, kept, kept_because=f"{reasons.NORM_OF[name]}: {NOTHING_KEPT}"))
                elif not norm_keeps:
                    row.append(AdapterInput(name, kept, kept_because=f"{reasons.NORM_OF[name]}: {SOURCE_NOT_KEPT}"))
                else:
                    row.append(AdapterInput(name, 0, recomputed_from=reasons.NORM_OF[name]))
            elif name == "wo":
                if "wqkv" in targets or need["linear_qkv"]:
                    row.append(AdapterInput(name, 0, shared_with=ATTENTION_KEEPS))
                else:
                    row.append(AdapterInput(name, s * b * model.attn_width // t * e,
                                            kept_because=reasons.NOT_KEPT if recompute else None))
            else:  # w2: the SwiGLU product [b, s, ffn/t]
                kept = s * b * model.ffn // t * e
                if not recompute:
                    row.append(AdapterInput(name, kept))
                elif not need["linear_fc2"]:  # the product needs no gradient: no multiply node to read
                    row.append(AdapterInput(name, kept, kept_because=reasons.NOT_SWIGLU))
                else:
                    row.append(AdapterInput(name, 0, recomputed_from=reasons.SWIGLU_PRODUCT))
        layers.append(row)
    return layers


def rank_r_bytes(model: Model, run: Run) -> int:
    """LoRA-B's rank-r inputs per GPU, the same on every variant: ``N*r*e`` per adapter."""
    per_layer = len([t for t in reasons.TARGETS if t in run.targets]) * run.seq * run.micro_batch * run.lora_rank * run.e
    return per_layer * layers_here(model, run) * run.in_flight


def titan_comm_changes(model: Model, run: Run, variant: str) -> list[tuple[str, int, str]]:
    """Collectives a variant adds against torchtitan's LoRA, per micro-batch (the module doc's table)."""
    check_titan(model, run)
    fields = variant_fields(variant) or {}
    strategy = fields.get("sequence_parallel_input_strategy", "gather")
    if strategy == "gather" or not sharded(run):
        return []
    n = layers_here(model, run)
    s, b, h, r, t, e = run.seq, run.micro_batch, model.hidden, run.lora_rank, run.tp, run.e
    column = [c for c in reasons.COLUMN_TARGETS if c in run.targets]
    if strategy == "regather":
        early = fields.get("early_regather", True)
        gathers = len(column) if not early else ("wqkv" in column) + (_ffn_reader(column) is not None)
        return [("all_gather", n * gathers * ring(s * b * h * e, t), "backward re-gather of the shard")]
    mid = ring(s * b * r * e, t)
    return [("all_gather", n * len(column) * mid, "forward gather of LoRA-A's rank-r output"),
            ("reduce_scatter", n * len(column) * mid, "backward reduce-scatter of its gradient")]


def _by_target(model: Model, run: Run, variant: str, norm_upcasts: bool = False) -> dict:
    out: dict[str, int] = {}
    for row in titan_inputs(model, run, variant, norm_upcasts):
        for a in row:
            out[a.target] = out.get(a.target, 0) + a.kept_bytes * run.in_flight
    return out


def titan_estimate(model: Model, run: Run, variants=VARIANTS, norm_upcasts: bool = False) -> dict:
    """Per variant: LoRA-A input bytes (total and by target), LoRA's bytes over the frozen model
    (with the rank-r tensors), the saving against torchtitan's LoRA, the collectives added; a
    ``-recompute`` variant also the saving for both states of the decoder input and what rebuilds.
    ``norm_upcasts``: :func:`norm_keeps_input`."""
    rank_r = rank_r_bytes(model, run)
    ref = sum(_by_target(model, run, BASELINE).values())
    out = {}
    for name in variants:
        parts = _by_target(model, run, name, norm_upcasts)
        changes = titan_comm_changes(model, run, name)
        comm: dict[str, int] = {}
        for kind, n, _ in changes:
            comm[kind] = comm.get(kind, 0) + n
        row = {"adapter_input_bytes": sum(parts.values()), "adapter_input_by_target": parts,
               "rank_r_bytes": rank_r, "lora_bytes_over_frozen": sum(parts.values()) + rank_r,
               "saved_vs_torchtitan": ref - sum(parts.values()), "extra_comm_bytes": comm,
               "extra_comm_total": sum(comm.values()), "added_comm_bytes": sum(n for _, n, _ in changes if n > 0)}
        if (variant_fields(name) or {}).get("recompute_adapter_inputs"):
            for key, grad in (("saved_vs_torchtitan_frozen_input", False),
                              ("saved_vs_torchtitan_input_requires_grad", True)):
                other = replace(run, input_requires_grad=grad)
                row[key] = sum(_by_target(model, other, BASELINE).values()) - \
                    sum(_by_target(model, other, name, norm_upcasts).values())
            row.update(_recompute_summary(model, run, name, norm_upcasts))
        shared = {}
        for layer in titan_inputs(model, run, name, norm_upcasts):
            for a in layer:
                if a.shared_with:
                    shared[a.target] = shared.get(a.target, 0) + 1
        row["shared_by_target"] = shared
        out[name] = row
    return out


def _recompute_summary(model: Model, run: Run, variant: str, norm_upcasts: bool) -> dict:
    recomputed: dict[str, int] = {}
    kept: dict[str, int] = {}
    for row in titan_inputs(model, run, variant, norm_upcasts):
        for a in row:
            if a.recomputed_from:
                recomputed[a.target] = recomputed.get(a.target, 0) + 1
            elif a.kept_because:
                key = f"{a.target}: {a.kept_because}"
                kept[key] = kept.get(key, 0) + 1
    return {"recomputed_by_target": {t: recomputed[t] for t in reasons.TARGETS if t in recomputed},
            "kept_by_reason": kept}


# -- output ----------------------------------------------------------------------------------------


def titan_run_json(run: Run, norm_upcasts: bool = False) -> dict:
    """The ``"run"`` entry of ``--json`` for the torchtitan layout."""
    return {"tp": run.tp, "sp": run.sp, "seq": run.seq, "micro_batch": run.micro_batch, "in_flight": run.in_flight,
            "pp": run.pp, "dtype": run.dtype, "lora_rank": run.lora_rank, "targets": list(run.targets),
            "first_stage": run.first_stage, "input_requires_grad": run.input_requires_grad,
            "norm_keeps_input": norm_keeps_input(run, norm_upcasts)}


def titan_as_json(model: Model, run: Run, result: dict, norm_upcasts: bool = False) -> dict:
    return {"front_end": "torchtitan", "baseline": BASELINE, "model": model_json(model),
            "run": titan_run_json(run, norm_upcasts), "strategies": result}


def _kinds(parts: dict, run: Run) -> str:
    ffn = _ffn_reader(run.targets)
    names = {ffn: "w1/w3" if {"w1", "w3"} <= set(run.targets) else ffn}
    cells = [f"{names.get(k, k)} {parts[k] / 1e9:.3f} GB" for k in ("wqkv", "wo", ffn, "w2")
             if k in parts and (parts[k] or k != "wo")]
    return ", ".join(cells)


#: how the figures are obtained
TITAN_HOW = ("how obtained: modelled from the sizes (regather.tools.estimate.titan's formulas, which match regather "
             "bench --torchtitan's counts on CPU byte for byte: small models, fp32 and bf16, tested); none measured on "
             "a GPU yet")


def format_titan_report(model: Model, run: Run, result: dict, norm_upcasts: bool = False) -> str:
    gathered = [c for c in reasons.COLUMN_TARGETS if c in run.targets] if sharded(run) else []
    lines = [
        f"{model.name} on torchtitan (its llama3 / qwen3 dense blocks): h={model.hidden}, {model.layers} layers "
        f"({layers_here(model, run)} on this GPU), {model.heads} heads / {model.kv_heads or model.heads} kv, "
        f"ffn {model.ffn}",
        f"run: torchtitan's sharding config, TP={run.tp} SP={'on' if run.sp else 'off'} seq={run.seq} micro-batch="
        f"{run.micro_batch} in-flight={run.in_flight} PP={run.pp} {run.dtype} LoRA r={run.lora_rank} on "
        f"{', '.join(run.targets)}; baseline: torchtitan's own LoRAConverter",
        f"sequence-gathered adapters per layer: {', '.join(gathered) or 'none'}"
        + (" (w1 and w3 read one gathered input)" if {"w1", "w3"} <= set(gathered) else ""),
        "decoder input: " + ("requires grad" if run.input_requires_grad else
                             "a later pipeline stage's (requires grad)" if not run.first_stage else
                             "frozen embeddings (torchtitan's LoRA freezes them; --input-requires-grad: an embedding "
                             "output that requires grad)"),
        f"LoRA-B's rank-r inputs (every variant): {gb(rank_r_bytes(model, run))}",
        "norms: " + ("keep their input (fp32; or CUDA's fused rms_norm), what wqkv/w1/w3 are rebuilt from"
                     if norm_keeps_input(run, norm_upcasts) else
                     "keep an fp32 copy of their input (torch's composite rms_norm, as on CPU): wqkv/w1/w3 keep "
                     "their shard under -recompute"),
        TITAN_HOW,
        "",
    ]
    for name, row in result.items():
        lines.append(f"[{name}]" + ("  torchtitan's own LoRAConverter" if name == BASELINE else ""))
        lines.append(f"  LoRA-A input bytes per GPU  : {gb(row['adapter_input_bytes'])}")
        lines.append(f"    by adapter                : {_kinds(row['adapter_input_by_target'], run)}")
        lines.append(f"  LoRA over the frozen model  : {gb(row['lora_bytes_over_frozen'])}")
        if name != BASELINE:
            lines.append(f"  saved vs torchtitan's LoRA  : {gb(row['saved_vs_torchtitan'])}")
        if "saved_vs_torchtitan_frozen_input" in row:
            frozen, grad = row["saved_vs_torchtitan_frozen_input"], row["saved_vs_torchtitan_input_requires_grad"]
            if frozen != grad:
                this = row["saved_vs_torchtitan"]
                lines.append(f"    frozen embeddings        : {gb(frozen)}{'  <- this run' if this == frozen else ''}")
                lines.append(f"    input requires grad      : {gb(grad)}{'  <- this run' if this != frozen else ''}")
            done = ", ".join(f"{k} {v}" for k, v in row["recomputed_by_target"].items()) or "none"
            lines.append(f"  inputs recomputed           : {done}")
            for why, n in row["kept_by_reason"].items():
                lines.append(f"    kept: {n} x {why.split(' (', 1)[0]}")
        if row["shared_by_target"]:
            shared = ", ".join(f"{k} {v}" for k, v in row["shared_by_target"].items())
            lines.append(f"  inputs kept anyway, 0 new B : {shared} (the attention output)")
        comm = row["extra_comm_bytes"]
        if comm:
            kinds = ", ".join(f"{k} {v / 2**20:+,.1f} MiB" for k, v in comm.items())
            lines.append(f"  extra comm per micro-batch  : {row['extra_comm_total'] / 2**20:+,.1f} MiB ({kinds})")
        else:
            lines.append("  extra comm per micro-batch  : 0")
    return "\n".join(lines)
