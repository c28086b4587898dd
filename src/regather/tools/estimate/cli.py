"""``regather estimate``: LoRA-A input memory and extra communication, analytically.

The command line: a preset, the tiny GPT or custom sizes and a run layout
(:mod:`regather.tools.estimate.vocabulary`), a text report or ``--json``
(:mod:`regather.tools.estimate.report`). The definitions are in :mod:`regather.tools.estimate`.
"""

from __future__ import annotations

from dataclasses import replace

from regather.megatron.reasons import ALL_TARGETS, CANONICAL_TARGETS, REPLAYED_DISPATCHERS
from regather.tools.cmdline import given, wrapped
from regather.tools.estimate.config import ALL_STRATEGIES, PRESETS, Model, Run
from regather.tools.estimate.options import (
    PRESET_RUN,
    SIZES,
    TINY_RUN,
    apply_layout,
    attention,
    recipe_targets,
    recompute,
    refuse_contradictions,
    refuse_cp,
    refuse_recipe,
    sized,
)
from regather.tools.estimate.vocabulary import TINY, add_command
from regather.torchtitan.options import VARIANTS as TITAN_VARIANTS
from regather.torchtitan.reasons import TARGETS as TITAN_TARGETS

DESCRIPTION = (
    "Analytic LoRA-A input memory and extra communication per strategy, for a preset, the tiny test GPT or custom "
    "sizes, at the layout the command line gives; every figure says how it was obtained (modelled; the rules "
    "measured on CPU: regather bench, the Transformer Engine model on CPU). Exit status 1 for a layout refused after "
    "parsing (heads that do not divide over TP, flags that contradict each other), 2 for what the parser refuses.")
# the options that ask for the same-work lines (the default report stays as it was)
SAME_WORK_OPTIONS = ("targets", "lora_rank", "attention")
TITAN_PRESET = "llama3-8b"  # --front-end torchtitan without --model
#: the tiny test GPT as estimate knows it (doctor's --model tiny; bench's default sizes)
TINY_MODEL = Model(name="tiny GPT", experts="sequential")


def register(subparsers) -> None:
    p = add_command(subparsers, "estimate", help="analytic LoRA-A input memory and extra communication per strategy",
                    description=DESCRIPTION)
    p.set_defaults(func=main)


def base_model(key: str) -> Model:
    return TINY_MODEL if key == TINY else PRESETS[key]


def model_from_args(args, key: str | None = None) -> Model:
    """The model (``key``, else ``--model``) with the sizes given (:func:`~regather.tools.estimate.options.sized`)
    and the expert options."""
    key = key or args.model
    base = base_model(key)
    sizes, name = sized(args, base, base.name, "estimate", tiny=key == TINY)
    model = replace(base, name=name, dispatcher=args.dispatcher, **sizes)
    return replace(model, experts=args.experts) if args.experts else model


def custom(args) -> bool:
    """Sizes on the command line: the model is not the preset."""
    return any(getattr(args, d, None) is not None for d in SIZES)


def run_from_args(args, key: str | None = None) -> Run:
    """The run; with ``--recipe``, the recipe's targets and dim where ``--targets`` / ``--lora-rank`` were not
    given; the sequence, micro-batch and rank the model's (a preset's or the tiny GPT's) where not given."""
    key = key or args.model
    defaults = TINY_RUN if key == TINY else PRESET_RUN
    targets, rank = recipe_targets(args, tuple(args.targets or ALL_TARGETS),
                                   args.lora_rank or defaults["lora_rank"])
    return Run(tp=args.tp, sp=args.sp, seq=args.seq or defaults["seq"],
               micro_batch=args.micro_batch or defaults["micro_batch"], in_flight=args.in_flight, pp=args.pp,
               dtype=args.dtype, grad_dtype=args.grad_dtype, lora_rank=rank, targets=targets,
               first_stage=args.first_stage, input_requires_grad=args.input_requires_grad, ep=args.ep, etp=args.etp,
               share_expert_adapters=args.expert_lora == "shared",
               redispatch_expert_inputs=args.redispatch_expert_inputs,
               attention_keeps_output=attention(args) == "fused", spec=getattr(args, "spec", "local"),
               cp=getattr(args, "cp", 1), te_version=getattr(args, "te_version", None),
               peft=getattr(args, "peft", "lora"), dora_output=getattr(args, "dora_output", "keep"),
               **recompute(args, "estimate"))


def titan_from_args(args) -> tuple[Model, Run, tuple]:
    """``--front-end torchtitan``: the model (``llama3-8b`` unless ``--model``), the run (torchtitan's
    targets and rank unless given) and the variants; exits naming the Megatron-only options given."""
    from regather.torchtitan.options import variant_fields

    on_line = given(args)
    megatron_only = ("spec", "attention", "recipe", "experts", "expert_lora", "redispatch_expert_inputs",
                     "dispatcher", "ep", "etp", "grad_dtype", "num_experts", "moe_ffn", "topk", "cp",
                     "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
                     "te_version", "gpu_memory")
    other = [f"--{n.replace('_', '-')}" for n in megatron_only if n in on_line]
    if other:
        raise SystemExit(f"regather estimate --front-end torchtitan: {', '.join(other)}: Megatron's options "
                         "(torchtitan's LoRA adapts dense Linear configs; its attention keeps its output; context "
                         "parallelism, activation recompute and the per-GPU total are modelled for megatron only)")
    key = args.model if "model" in on_line else TITAN_PRESET
    model = model_from_args(args, key)
    refuse_contradictions(args, model.moe, model.name, "estimate --front-end torchtitan")
    targets = tuple(args.targets) if "targets" in on_line else TITAN_TARGETS
    bad = [t for t in targets if t not in TITAN_TARGETS]
    if bad:
        raise SystemExit(f"regather estimate --front-end torchtitan: targets {bad}: torchtitan's block linears are "
                         f"{', '.join(TITAN_TARGETS)}")
    run = replace(run_from_args(args, key), targets=targets, lora_rank=args.lora_rank or 8)
    variants = tuple(args.strategies) if "strategies" in on_line else TITAN_VARIANTS
    for name in variants:
        try:
            variant_fields(name)
        except ValueError as exc:
            raise SystemExit(f"regather estimate --front-end torchtitan: {exc}") from None
    return model, run, variants


def titan_main(args) -> int:
    import json

    from regather.tools.estimate.titan import format_titan_report, titan_as_json, titan_estimate

    model, run, variants = titan_from_args(args)
    upcasts = args.norm_upcasts
    try:
        result = titan_estimate(model, run, variants, upcasts)
    except ValueError as exc:  # sizes that do not divide: say which
        raise SystemExit(f"regather estimate --front-end torchtitan: {exc}") from None
    print(json.dumps(titan_as_json(model, run, result, upcasts), indent=1) if args.json
          else "\n".join(wrapped(format_titan_report(model, run, result, upcasts).splitlines())))
    return 0


def megatron_from_args(args) -> tuple[Model, Run, tuple]:
    """The Megatron model, run and strategies of the command line; exits naming the values where they
    contradict each other or name what only another front end has (before anything is computed)."""
    if args.norm_upcasts:
        raise SystemExit("regather estimate: --norm-upcasts is --front-end torchtitan's")
    apply_layout(args)
    key = args.model
    refuse_recipe(args, key, "estimate")
    model = model_from_args(args, key)
    refuse_contradictions(args, model.moe, model.name, "estimate")
    refuse_cp(args, getattr(args, "spec", "local"), "estimate")
    if model.dispatcher not in REPLAYED_DISPATCHERS:
        raise SystemExit(f"regather estimate: --dispatcher {model.dispatcher}: estimate models "
                         f"{' and '.join(REPLAYED_DISPATCHERS)}, whose route regather replays (doctor reasons about "
                         "flex too)")
    run = run_from_args(args, key)
    titan = [t for t in run.targets if t in TITAN_TARGETS]
    if titan:
        raise SystemExit(f"regather estimate: targets {titan} are torchtitan's names: add --front-end torchtitan")
    canonical = [t for t in run.targets if t in CANONICAL_TARGETS and t not in ALL_TARGETS]
    if canonical:
        raise SystemExit(f"regather estimate: targets {canonical} are CanonicalLoRA's (one adapter per projection; "
                         "regather bench --canonical measures it); estimate's are the fused linears "
                         + ", ".join(ALL_TARGETS))
    strategies = tuple(args.strategies or ALL_STRATEGIES)
    unknown = [s for s in strategies if s not in ALL_STRATEGIES]
    if unknown:
        raise SystemExit(f"regather estimate: strategies {unknown} are not megatron's (regather-plain: a timing "
                         "variant, the same bytes as regather; torchtitan's: --front-end torchtitan; -redispatch: "
                         f"--redispatch-expert-inputs); megatron's are {', '.join(ALL_STRATEGIES)}")
    return model, run, strategies


def main(args) -> int:
    import json

    from regather.tools.estimate.report import as_json, format_report, reference_for, same_work
    from regather.tools.estimate.summary import estimate

    if args.front_end == "torchtitan":
        return titan_main(args)
    model, run, strategies = megatron_from_args(args)
    try:
        result = estimate(model, run, strategies, gpu_gib=args.gpu_memory)
    except ValueError as exc:  # sizes that do not divide: say which
        raise SystemExit(f"regather estimate: {exc}") from None
    # the TE report says, per strategy, what the local spec keeps and frees (with its own attention
    # unless --attention was given; not under context parallelism, which the local attention cannot run)
    local_fused = (args.attention or "unfused") == "fused"
    local = None if run.spec == "local" or (run.cp > 1 and not local_fused) else estimate(
        model, replace(run, spec="local", attention_keeps_output=local_fused), strategies)
    # the reference and Bridge's recipe belong to the preset: custom sizes have no reference, and a
    # recipe only where --model names the preset they change
    key = args.model
    ref = None if custom(args) else reference_for(key, model, run)
    recipe_of = key if not custom(args) or "model" in given(args) else None
    asked = bool(args.recipe) or bool(given(args) & set(SAME_WORK_OPTIONS))
    same = same_work(recipe_of, model, run, ref) if asked else None
    if args.json:
        print(json.dumps(as_json(model, run, result, ref, same, local), indent=1))
    else:
        print("\n".join(wrapped(format_report(model, run, result, ref, same, local).splitlines())))
    return 0
