"""``regather estimate``'s output: the text report, the JSON document, and the reference's measurements."""

from __future__ import annotations

from regather.megatron.reasons import EXPERT_TARGETS
from regather.tools.estimate.config import (
    ATTENTION_OUTPUT,
    BRIDGE_VERSION,
    RECIPES,
    Model,
    Run,
    eligible_per_layer,
    expert_lora,
    layers_here,
    recompute_modules,
)
from regather.tools.estimate.experts import expert_layout
from regather.tools.estimate.memory import TOTAL_HOW
from regather.tools.estimate.peak import PEAK_HOW
from regather.tools.estimate.spec import HOW_OBTAINED, LOCAL, spec_lines, te_release_reason, te_version
from regather.tools.estimate.summary import adapter_input_bytes, saved_vs_gather

# The reference's measured peak-memory drops with sequence_parallel_input_regather=True
# (/work/shared/reference: Qwen3-8B TP2 seq 8192; the MoE rows state TP and EP, not their
# sequence length: 8192 here, as the issue asks), in bytes.
REFERENCE = {
    "qwen3-8b": {"tp": 2, "ep": 1, "seq": 8192, "seq_stated": True, "saved": 4_731_000_000,
                 "note": "TP2, seq 8192"},
    "qwen3-30b-a3b": {"tp": 4, "ep": 4, "seq": 8192, "seq_stated": False, "saved": 1_569_000_000,
                      "note": "TP4/EP4, seq not stated"},
    "gpt-oss-120b": {"tp": 2, "ep": 8, "seq": 8192, "seq_stated": False, "saved": 814_000_000,
                     "note": "TP2/EP8, seq not stated"},
}


#: what "the reference" is, in every report that sets a figure beside it
REFERENCE_IS = ("the reference: Megatron Bridge's own re-gather, LoRA(sequence_parallel_input_regather=True), its "
                "peak-memory drop measured on H100s")


def reference_for(preset: str, model: Model, run: Run) -> dict | None:
    """The reference's measurement for ``preset`` when this run has its layout (TP and EP; the
    sequence length too where the reference states it), else None (and for custom sizes)."""
    ref = REFERENCE.get(preset)
    if ref is None or model.name.endswith("(custom)") or (ref["tp"], ref["ep"], 1) != (run.tp, run.ep, run.cp):
        return None
    if ref["seq_stated"] and ref["seq"] != run.seq:
        return None
    return ref


UNFUSED = "megatron's unfused local attention saves the probabilities and V, not its output"
#: how the local spec's figures are obtained (the TE spec's: spec.HOW_OBTAINED, in spec_lines)
LOCAL_HOW = ("how obtained: modelled from the sizes (regather.tools.estimate's formulas, which match regather bench's "
             "counts on CPU byte for byte: small dense and MoE models, tested); none measured on a GPU yet")


def _names(targets) -> str:
    return ", ".join(targets) or "none"


def recipe_difference(recipe, run: Run) -> str | None:
    """None when ``run`` adapts the recipe's targets at its dim, else what differs, plainly."""
    added = [t for t in run.targets if t not in recipe.targets]
    dropped = [t for t in recipe.targets if t not in run.targets]
    parts = ([f"adds {_names(added)}"] if added else []) + ([f"drops {_names(dropped)}"] if dropped else [])
    if parts:
        return "NOT the recipe's targets: this estimate " + " and ".join(parts)
    if run.lora_rank != recipe.dim:
        return (f"the recipe's targets, not its dim: r={run.lora_rank} here, dim {recipe.dim} in the recipe "
                "(the adapter-input bytes do not depend on it; lowrank's and the expert route's bytes do)")
    return None


def same_work(preset: str | None, model: Model, run: Run, reference: dict | None = None) -> dict:
    """What ``--recipe`` / ``--targets`` / ``--lora-rank`` / ``--attention`` add to the report: the
    targets this estimate adapts beside Bridge's PEFT recipe for the preset and the reference (which
    does not state its targets), whether linear_proj's input is new bytes, and the most any
    re-gather can free on these targets (the gathered input of every eligible adapter)."""
    recipe = RECIPES.get(preset)  # the preset's, also where --model names it and sizes change it (its LoRA
    # does not depend on them); None for a model no preset names
    eligible = eligible_per_layer(model, run)
    gathered = adapter_input_bytes(model, run, "gather")
    out = {
        "targets": list(run.targets), "lora_rank": run.lora_rank, "reference_targets": "not stated",
        "recipe": None if recipe is None else {
            "bridge": BRIDGE_VERSION, "function": recipe.function, "layout": recipe.layout,
            "targets": list(recipe.targets), "dim": recipe.dim, "alpha": recipe.alpha},
        "targets_match_recipe": None if recipe is None else set(run.targets) == set(recipe.targets),
        "differs_from_recipe": None if recipe is None else recipe_difference(recipe, run),
        "attention": "fused" if run.attention_keeps_output else "unfused",
        "linear_proj_input": ("not adapted" if "linear_proj" not in run.targets else
                              f"0 new bytes on every strategy: {ATTENTION_OUTPUT}" if run.attention_keeps_output
                              else f"new bytes on every strategy: {UNFUSED}"),
        "regather_bound": sum(gathered.get(name, 0) for name in eligible),
    }
    if preset is None:  # custom sizes with no --model: no recipe is this model's
        out["custom"] = True
    if run.spec != LOCAL:  # only where it is not the local spec: the local document is unchanged
        out["spec"] = run.spec
    out["reference_exceeds_bound"] = bool(reference and reference["seq_stated"]
                                          and reference["saved"] > out["regather_bound"])
    return out


def _same_work_lines(sw: dict, reference: dict | None) -> list[str]:
    recipe = sw["recipe"]
    lines = []
    if recipe is None:
        lines.append("  Bridge PEFT recipe: none, custom sizes are no recipe's model" if sw.get("custom") else
                     "  Bridge PEFT recipe: none known for this preset")
    else:
        verdict = sw["differs_from_recipe"] or "the recipe's targets and dim"
        lines.append(f"  Bridge {recipe['bridge']} PEFT recipe {recipe['function']} (its layout {recipe['layout']}): "
                     f"LoRA on {_names(recipe['targets'])}, dim {recipe['dim']}, alpha {recipe['alpha']} -> {verdict}")
    what = "x_full of every eligible adapter" if sw.get("spec", LOCAL) == LOCAL else \
        "x_full and TE's ln_out shard of every eligible adapter"
    lines.append(f"  the most any re-gather frees on these targets ({what}): {gb(sw['regather_bound'])}")
    if sw["reference_exceeds_bound"]:
        lines.append(f"  the reference's {reference['saved'] / 1e9:.3f} GB is more than that: its run most likely "
                     "had more re-gather-eligible adapters than these targets give")
    lines.append(f"  linear_proj's LoRA-A input ({sw['attention']} attention): {sw['linear_proj_input']}")
    return lines


def model_json(model: Model) -> dict:
    """The ``"model"`` entry of ``--json`` (its keys are the output format: ``experts`` is the count)."""
    return {"name": model.name, "hidden": model.hidden, "layers": model.layers, "heads": model.heads,
            "kv_heads": model.kv_heads or model.heads, "head_dim": model.head_dim or model.hidden // model.heads,
            "ffn": model.ffn, "experts": model.num_experts,
            "moe_ffn": model.moe_ffn, "topk": model.topk, "vocab": model.vocab}


def run_json(model: Model, run: Run) -> dict:
    """The ``"run"`` entry of ``--json`` (the dispatcher is the model's; the expert LoRA follows from both)."""
    return {"tp": run.tp, "sp": run.sp, "seq": run.seq, "micro_batch": run.micro_batch, "in_flight": run.in_flight,
            "pp": run.pp, "dtype": run.dtype, "grad_dtype": run.grad_dtype, "lora_rank": run.lora_rank,
            "targets": list(run.targets), "first_stage": run.first_stage,
            "input_requires_grad": run.input_requires_grad, "ep": run.ep, "etp": run.etp,
            "expert_lora": expert_lora(model, run), "redispatch": run.redispatch_expert_inputs,
            "dispatcher": model.dispatcher, "cp": run.cp, "local_seq": run.local_seq,
            "recompute": {"granularity": run.recompute_granularity, "method": run.recompute_method,
                          "num_layers": run.recompute_num_layers, "modules": list(recompute_modules(run))}}


def as_json(model: Model, run: Run, result: dict, reference: dict | None = None, same: dict | None = None,
            local: dict | None = None) -> dict:
    """The ``--json`` document. On the TE spec also ``"spec"``, ``"te_release"`` (the TE version the release is
    decided for, whether it was assumed, and the rule's refusal or None) and, with ``local`` (:func:`estimate` of
    the same run on the local spec), each strategy's ``"local_spec"`` bytes and saving; the local
    spec's document is as it was before ``--spec`` existed."""
    out = {"model": model_json(model), "run": run_json(model, run), "experts": expert_layout(model, run),
           "strategies": result, "reference_saved": reference,
           "how_obtained_peak": {"lora_kept_bytes": KEPT_HOW, "peak": PEAK_HOW, "gpu": TOTAL_HOW}}
    if run.spec != LOCAL:
        out["spec"] = run.spec
        out["te_release"] = {"version": te_version(run), "assumed": run.te_version is None,
                             "refused": te_release_reason(run)}
        out["spec_notes"] = spec_lines(run)
        out["how_obtained"] = dict(HOW_OBTAINED)
        if reference:
            out["reference_on_spec"] = reference_on_te(model, run)
        out["strategies"] = {name: {**row, **({"local_spec": {k: local[name][k] for k in (
            "adapter_input_bytes", "saved_vs_gather")}} if local and name in local else {})}
            for name, row in result.items()}
    if same is not None:  # only where asked: the default document is unchanged
        out["same_work"] = same
    return out


KEPT_HOW = ("modelled: each adapter's LoRA-A input (the bytes regather bench counts, byte for byte on CPU) and "
            "LoRA-B's rank-r mid; nothing inside an activation checkpoint")


def run_extras(model_run: Run) -> list[str]:
    """The run line's context parallelism and activation recompute, where set."""
    run = model_run
    out = []
    if run.cp > 1:
        out.append(f"context parallel: CP={run.cp}, each CP rank's linears see {run.local_seq} tokens per sample "
                   f"(seq/cp); LoRA's TP collectives run on them unchanged (docs/design.md 3.8)")
    if run.recompute_granularity == "full":
        what = (f"uniform, groups of {run.recompute_num_layers} layer(s)" if run.recompute_method == "uniform" else
                f"block, the first {run.recompute_num_layers} layer(s)")
        out.append(f"activation recompute: full ({what}): nothing inside a checkpointed layer is kept after the "
                   "forward, LoRA's inputs included; its adapters take the gather path in the recomputed forward "
                   "(regather.megatron.dense.eligibility), whose bytes are alive until that layer's backward is done")
    elif run.recompute_granularity == "selective":
        out.append(f"activation recompute: selective, {', '.join(recompute_modules(run))}"
                   + (" (the dense MLP's adapters keep nothing after the forward)" if "mlp" in recompute_modules(run)
                      else "") + (" (the expert adapters keep nothing after the forward)"
                                  if "moe" in recompute_modules(run) else ""))
    return out


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def peak_lines(row: dict) -> list[str]:
    """A strategy's kept, peak and per-GPU total lines (modelled)."""
    p, other, g = row["peak"], row["peak_other_output_path"], row["gpu"]
    path, other_path = ("lean", "classic") if p["lean"] else ("classic", "lean")
    t = p["transient"]
    lines = [f"  LoRA kept after forward     : {gb(row['lora_kept_bytes'])} (LoRA-A inputs + rank-r mid)",
             f"  LoRA peak over frozen       : {gb(p['peak_over_frozen'])} ({path} output path; its largest "
             f"transient {gb(t['bytes'])}, {t['target']}, {t['what']}; the {other_path} output path: "
             f"{gb(other['peak_over_frozen'])})"]
    if p["checkpoint_alive"]:
        lines.append(f"    in a checkpointed layer's backward LoRA keeps {gb(p['checkpoint_alive'])} (recomputed)")
    parts = ", ".join(f"{k} {gib(v)}" for k, v in g["parts"].items())
    fit = "" if "fits" not in g else (f" of {gib(g['gpu_bytes'])}: " + (
        f"fits, {gib(g['headroom'])} free" if g["fits"] else f"does NOT fit, {gib(-g['headroom'])} over"))
    lines.append(f"  per-GPU total               : {gib(g['total'])}{fit} ({parts})")
    return lines


def gb(n: int) -> str:
    """Bytes in decimal GB and GiB; between 0 and 10 MB (a small custom model's, the tiny GPT's) as bytes and
    KiB, which GB would round to 0 (as doctor prints them)."""
    if n and abs(n) < 10**7:
        return f"{n:,} bytes ({n / 1024:,.2f} KiB)"
    return f"{n / 1e9:.3f} GB ({n / 2**30:.3f} GiB)"


def _short(reason: str) -> str:
    return reason.split(" (", 1)[0]


def _expert_lines(model: Model, run: Run) -> list[str]:
    layout = expert_layout(model, run)
    if not layout:
        return []
    adapters = ", ".join(f"{k.split('.')[1]} {v}" for k, v in layout["adapters_per_layer"].items()) or "none"
    return [f"experts: EP={run.ep} ETP={run.etp} {model.dispatcher} dispatcher, {layout['local_experts']} local "
            f"experts per layer, LoRA {expert_lora(model, run)} (adapters per layer: {adapters})"
            + (", redispatch_expert_inputs" if run.redispatch_expert_inputs else ""),
            f"routed rows per GPU, layer and micro-batch: R = T*k*etp = {layout['local_tokens']}*{model.topk}*"
            f"{run.etp} = {layout['routed_rows']} (mean over the EP x ETP group; exact for dropless routing)"]


def reference_on_te(model: Model, run: Run) -> dict | None:
    """What a peak-memory drop like the reference's should show on the TE spec: regather's saving
    less one gathered input alive at a time in backward (the re-gather buffer, transient and so not
    in the adapter-input bytes). None without an eligible adapter."""
    if not eligible_per_layer(model, run):
        return None
    frees = saved_vs_gather(model, run, "regather")
    buffer = run.local_seq * run.micro_batch * model.hidden * run.e
    return {"regather_frees": frees, "buffer": buffer, "peak_drop": frees - buffer}


def format_report(model: Model, run: Run, result: dict, reference: dict | None = None,
                  same: dict | None = None, local: dict | None = None) -> str:
    """The text report; on the TE spec with ``local`` (:func:`estimate` of the same run on the local
    spec) each strategy also says what it keeps and frees there."""
    eligible = eligible_per_layer(model, run)
    lines = [
        f"{model.name}: h={model.hidden}, {model.layers} layers ({layers_here(model, run)} on this GPU), "
        f"{model.heads} heads / {model.kv_heads or model.heads} kv, "
        + (f"{model.num_experts} experts x {model.moe_ffn} top-{model.topk}" if model.moe else f"ffn {model.ffn}"),
        f"run: TP={run.tp} SP={'on' if run.sp else 'off'} seq={run.seq} micro-batch={run.micro_batch} "
        f"in-flight={run.in_flight} PP={run.pp} {run.dtype} {'DoRA' if run.peft == 'dora' else 'LoRA'} "
        f"r={run.lora_rank} on {', '.join(run.targets)}",
        *run_extras(run),
        *_expert_lines(model, run),
        f"re-gather-eligible adapters per layer: {', '.join(eligible) or 'none'}",
        "decoder input: " + ("requires grad" if run.input_requires_grad else
                             "a later pipeline stage's (requires grad)" if not run.first_stage else
                             "frozen embeddings (needs no grad; --input-requires-grad: as with Bridge's "
                             "maybe_enable_recompute_inputs_grad / HF's enable_input_require_grads)"),
    ]
    lines += spec_lines(run) if run.spec != LOCAL else [LOCAL_HOW]
    lines += [f"LoRA kept, peak and the per-GPU total: {PEAK_HOW}; the total: {TOTAL_HOW}"]
    if reference:
        lines.append(f"reference measured ({REFERENCE_IS}; {reference['note']}): {gb(reference['saved'])}"
                     + (f"; this estimate: LoRA on {_names(run.targets)}, r={run.lora_rank} (the reference does "
                        "not state its targets)" if same else ""))
        te = reference_on_te(model, run) if run.spec != LOCAL else None
        if te:
            lines.append(f"  on the TE spec regather frees every gathered input: {gb(te['regather_frees'])}; less "
                         f"one gathered input alive in backward (its re-gather buffer, {gb(te['buffer'])}): "
                         f"{gb(te['peak_drop'])} against the reference's peak drop")
    if same:
        if not reference:
            lines.append(f"this estimate: LoRA on {_names(run.targets)}, r={run.lora_rank} (no reference measurement "
                         "at this layout)")
        lines += _same_work_lines(same, reference)
    lines.append("")
    for name, row in result.items():
        lines.append(f"[{name}]")
        lines.append(f"  adapter-input bytes per GPU : {gb(row['adapter_input_bytes'])}")
        experts = {k: v for k, v in row["adapter_input_by_target"].items() if k in EXPERT_TARGETS}
        if experts:
            parts = ", ".join(f"{k.split('.')[1]} {v / 1e9:.3f} GB" for k, v in experts.items())
            lines.append(f"    of which expert adapters  : {gb(sum(experts.values()))}: {parts}")
        lines.append(f"  saved vs gather             : {gb(row['saved_vs_gather'])}")
        if "dora_output_bytes" in row:
            lines.append(f"  DoRA's magnitude keeps      : {gb(row['dora_output_bytes'])}"
                         + ("  (its scale and norm; z rebuilt in backward)" if run.dora_output == "rebuild" else
                            "  (z, its scale and norm, as Bridge's DoRA; --dora-output rebuild: z not kept)"))
        if "saved_vs_gather_frozen_input" in row:
            frozen, grad = row["saved_vs_gather_frozen_input"], row["saved_vs_gather_input_requires_grad"]
            if frozen != grad:
                this = "input requires grad" if row["saved_vs_gather"] == grad else "frozen embeddings"
                lines.append(f"    frozen embeddings        : {gb(frozen)}"
                             f"{'  <- this run' if this == 'frozen embeddings' else ''}")
                lines.append(f"    input requires grad      : {gb(grad)}"
                             f"{'  <- this run' if this != 'frozen embeddings' else ''}")
            done = ", ".join(f"{k} {v}" for k, v in row["recomputed_by_target"].items()) or "none"
            lines.append(f"  inputs recomputed           : {done}")
            for why, n in row["kept_by_reason"].items():
                lines.append(f"    kept: {n} x {_short(why)}")
        if local and name in local:
            lines.append(f"  on the local spec           : {gb(local[name]['adapter_input_bytes'])}, saved vs gather "
                         f"{gb(local[name]['saved_vs_gather'])}")
        if row.get("shared_by_target"):
            shared = ", ".join(f"{k} {v}" for k, v in row["shared_by_target"].items())
            lines.append(f"  inputs kept anyway, 0 new B : {shared} (the attention output)")
        lines += peak_lines(row)
        comm = row["extra_comm_bytes"]
        if comm:
            kinds = ", ".join(f"{k} {v / 2**20:+,.1f} MiB" for k, v in comm.items())
            lines.append(f"  extra comm per micro-batch  : {row['extra_comm_total'] / 2**20:+,.1f} MiB net ({kinds});"
                         f" new collectives {row['added_comm_bytes'] / 2**20:,.1f} MiB")
        else:
            lines.append("  extra comm per micro-batch  : 0")
    return "\n".join(lines)
