"""``regather estimate``: LoRA-A input memory and extra communication, analytically.

The command line: a preset (or custom sizes) and a run layout, a text report or ``--json``
(:mod:`regather.tools.estimate.report`). The definitions are in :mod:`regather.tools.estimate`.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from regather.megatron.reasons import ALL_TARGETS, REPLAYED_DISPATCHERS
from regather.tools.cmdline import HelpFormatter, names, non_negative, positive, wrapped
from regather.tools.estimate.config import ALL_STRATEGIES, ATTENTION, EXPERT_LORA, LAYOUTS, PRESETS, SPECS, Model, Run
from regather.tools.estimate.dora import DORA_OUTPUTS, PEFTS
from regather.tools.estimate.options import (
    Given,
    apply_layout,
    attention,
    given,
    recipe_help,
    recipe_targets,
)
from regather.tools.shapes import DTYPE_BYTES
from regather.torchtitan.options import VARIANTS as TITAN_VARIANTS
from regather.torchtitan.reasons import TARGETS as TITAN_TARGETS

# --flag -> ModelShape field, for the custom sizes (--experts is the count here)
_SIZES = {"hidden": "hidden", "ffn": "ffn", "layers": "layers", "heads": "heads", "kv_heads": "kv_heads",
          "head_dim": "head_dim", "experts": "num_experts", "moe_ffn": "moe_ffn", "topk": "topk"}


def _targets(value: str) -> tuple:
    return names(value, ALL_TARGETS + TITAN_TARGETS, "targets")


def _titan_variant(name: str) -> bool:
    from regather.torchtitan.options import variant_fields

    try:
        variant_fields(name)
    except ValueError:
        return False
    return True


def _strategies(value: str) -> tuple:
    # torchtitan's variants too (<strategy>[-plain][-recompute]): --front-end picks, after parsing
    listed = tuple(dict.fromkeys(ALL_STRATEGIES + tuple(TITAN_VARIANTS)))
    grammar = tuple(n.strip() for n in value.split(",") if _titan_variant(n.strip()))
    return names(value, listed + tuple(n for n in grammar if n not in listed), "strategies")


# the options that ask for the same-work lines (the default report stays as it was)
SAME_WORK_OPTIONS = ("targets", "lora_rank", "attention")
FRONT_ENDS = ("megatron", "torchtitan")
TITAN_PRESET = "llama3-8b"  # --front-end torchtitan without --model


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "estimate", help="analytic LoRA-A input memory and extra communication per strategy",
        description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default="qwen3-8b", action=Given,
                   help="preset (custom sizes override; --front-end torchtitan: default llama3-8b)")
    for flag in ("hidden", "ffn", "layers", "heads", "kv-heads", "head-dim", "experts", "moe-ffn", "topk"):
        p.add_argument(f"--{flag}", type=non_negative if flag in ("experts", "ffn") else positive, default=None)
    p.add_argument("--spec", choices=SPECS, default="te", action=Given,
                   help="what the base linears keep: te = Transformer Engine (transformer_impl=\"transformer_engine\", "
                        "what Bridge's PEFT recipes run: LayerNormLinear keeps its ln_out for LoRA-A, fused attention "
                        "its output; the qkv / fc1 / fc2 rules measured on the TE model on CPU, the rest modelled); "
                        "local = megatron's local spec "
                        "(what regather bench runs)")
    p.add_argument("--tp", type=positive, default=2, action=Given)
    p.add_argument("--no-sp", dest="sp", action=Given, nargs=0, const=False, default=True,
                   help="sequence parallelism off")
    p.add_argument("--seq", type=positive, default=8192, action=Given)
    p.add_argument("--micro-batch", type=positive, default=1, action=Given)
    p.add_argument("--in-flight", type=positive, default=1, help="micro-batches alive at once")
    p.add_argument("--pp", type=positive, default=1, help="pipeline stages (layers per GPU = layers/pp)")
    p.add_argument("--ep", type=positive, default=1, help="expert parallel size (MoE)")
    p.add_argument("--etp", type=positive, default=1, help="expert tensor parallel size (MoE)")
    p.add_argument("--expert-lora", choices=EXPERT_LORA, default="shared",
                   help="shared: one LoRA pair for a layer's local experts (grouped experts, share_expert_adapters="
                        "True, Bridge's default); per-expert: one per expert (SequentialMLP, or "
                        "share_expert_adapters=False)")
    p.add_argument("--redispatch-expert-inputs", dest="redispatch", action="store_true",
                   help="LoRA(redispatch_expert_inputs=True): per-expert fc1 inputs are dispatched again in "
                        "backward (with a -recompute strategy)")
    p.add_argument("--dispatcher", choices=REPLAYED_DISPATCHERS, default="alltoall", help="moe_token_dispatcher_type")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16")
    p.add_argument("--grad-dtype", choices=sorted(DTYPE_BYTES), default=None,
                   help="LoRA-A gradient dtype for lowrank's dA all-reduce (default: --dtype; "
                        "float32 with gradient-accumulation fusion)")
    p.add_argument("--lora-rank", type=positive, default=16, action=Given)
    p.add_argument("--targets", type=_targets, default=",".join(ALL_TARGETS), action=Given)
    p.add_argument("--recipe", nargs="?", const=True, default=False, choices=sorted(LAYOUTS), metavar="LAYOUT",
                   help=recipe_help("The report then sets the targets beside the recipe's and the reference's"))
    p.add_argument("--attention", choices=ATTENTION, default=None, action=Given,
                   help="fused: the attention keeps its output for its backward (flash-attention, TE's fused "
                        "attention), so linear_proj's LoRA-A input is 0 new bytes on every strategy; unfused: "
                        "megatron's local attention (saves probs and V). Default: fused on --spec te, unfused on "
                        "--spec local")
    p.add_argument("--strategies", type=_strategies, default=",".join(ALL_STRATEGIES), action=Given,
                   help="some of " + ", ".join(ALL_STRATEGIES) + " (-recompute: recompute_adapter_inputs=True); "
                        "--front-end torchtitan: some of " + ", ".join(TITAN_VARIANTS))
    p.add_argument("--input-requires-grad", action="store_true",
                   help="the decoder input requires grad (Bridge's maybe_enable_recompute_inputs_grad, HF's "
                        "enable_input_require_grads): layer 0's linear_qkv recomputes too")
    p.add_argument("--later-stage", dest="first_stage", action="store_false",
                   help="this GPU is a later pipeline stage (its input comes from p2p and requires grad)")
    p.add_argument("--front-end", choices=FRONT_ENDS, default="megatron",
                   help="torchtitan: torchtitan's dense llama3 / qwen3 blocks under its own sharding config, its own "
                        "LoRAConverter as the baseline, targets " + ",".join(TITAN_TARGETS) + " and rank 8 unless "
                        "--targets / --lora-rank say otherwise (Megatron's MoE, recipe and attention options do not "
                        "apply)")
    p.add_argument("--norm-upcasts", action="store_true",
                   help="--front-end torchtitan, bf16/fp16: the norms keep an fp32 copy of their input (torch's "
                        "composite rms_norm, as on CPU), so wqkv/w1/w3 keep their shard under -recompute (default: "
                        "the norm keeps its input, as CUDA's fused rms_norm)")
    p.add_argument("--peft", choices=PEFTS, default="lora",
                   help="dora: regather.DoRA (Megatron Bridge's other PEFT scheme): also what its magnitude keeps")
    p.add_argument("--dora-output", choices=DORA_OUTPUTS, default="keep",
                   help="--peft dora: keep the pre-magnitude output for the magnitude's gradient (as Bridge), or "
                        "rebuild it in backward (DoRA(recompute_dora_output=True): one more base GEMM per adapter)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=main)


def model_from_args(args) -> Model:
    """The preset with the custom sizes given (its name marked ``(custom)``) and the dispatcher."""
    model = PRESETS[args.model]
    custom = {field: getattr(args, flag) for flag, field in _SIZES.items() if getattr(args, flag) is not None}
    if custom.get("num_experts") and not model.num_experts:
        missing = [f"--{flag}" for flag in ("topk", "moe-ffn") if getattr(args, flag.replace("-", "_")) is None]
        if missing:  # a dense preset made MoE: its routing and expert size are not the preset's to give
            raise SystemExit(f"regather estimate: --experts {custom['num_experts']} on the dense {model.name} needs "
                             f"{' and '.join(missing)} too (a MoE preset: "
                             + ", ".join(k for k, m in sorted(PRESETS.items()) if m.num_experts) + ")")
    return replace(model, name=model.name + (" (custom)" if custom else ""), dispatcher=args.dispatcher, **custom)


def run_from_args(args) -> Run:
    """The run; with ``--recipe``, the recipe's targets and dim where ``--targets`` / ``--lora-rank`` were not given."""
    targets = tuple(args.targets) if not isinstance(args.targets, str) else _targets(args.targets)
    targets, rank = recipe_targets(args, targets, args.lora_rank)
    return Run(tp=args.tp, sp=args.sp, seq=args.seq, micro_batch=args.micro_batch, in_flight=args.in_flight,
               pp=args.pp, dtype=args.dtype, grad_dtype=args.grad_dtype, lora_rank=rank, targets=targets,
               first_stage=args.first_stage, input_requires_grad=args.input_requires_grad, ep=args.ep, etp=args.etp,
               share_expert_adapters=args.expert_lora == "shared", redispatch_expert_inputs=args.redispatch,
               attention_keeps_output=attention(args) == "fused", spec=getattr(args, "spec", "local"),
               peft=getattr(args, "peft", "lora"), dora_output=getattr(args, "dora_output", "keep"))


def titan_from_args(args) -> tuple[Model, Run, tuple]:
    """``--front-end torchtitan``: the model (``llama3-8b`` unless ``--model``), the run (torchtitan's
    targets and rank unless given) and the variants; exits naming the Megatron-only options given."""
    from regather.torchtitan.options import variant_fields

    on_line, d = given(args), {"ep": 1, "etp": 1, "expert_lora": "shared", "redispatch": False, "dispatcher": "alltoall",
                               "grad_dtype": None, "experts": None, "moe_ffn": None, "topk": None, "recipe": False}
    other = [f"--{n.replace('_', '-')}" for n, v in d.items() if getattr(args, n, v) != v]
    other += [f"--{n}" for n in ("attention", "spec") if n in on_line]
    if other:
        raise SystemExit(f"regather estimate --front-end torchtitan: {', '.join(other)}: Megatron's options "
                         "(torchtitan's LoRA adapts dense Linear configs; its attention keeps its output)")
    model = model_from_args(args if "model" in on_line else argparse.Namespace(**{**vars(args), "model": TITAN_PRESET}))
    targets = tuple(args.targets) if "targets" in on_line else TITAN_TARGETS
    bad = [t for t in targets if t not in TITAN_TARGETS]
    if bad:
        raise SystemExit(f"regather estimate --front-end torchtitan: targets {bad}: torchtitan's block linears are "
                         f"{', '.join(TITAN_TARGETS)}")
    run = replace(run_from_args(args), targets=targets, lora_rank=args.lora_rank if "lora_rank" in on_line else 8)
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


def main(args) -> int:
    import json

    from regather.tools.estimate.report import as_json, format_report, reference_for, same_work
    from regather.tools.estimate.summary import estimate

    if getattr(args, "front_end", "megatron") == "torchtitan":
        return titan_main(args)
    if getattr(args, "norm_upcasts", False):
        raise SystemExit("regather estimate: --norm-upcasts is --front-end torchtitan's")
    apply_layout(args)
    model, run = model_from_args(args), run_from_args(args)
    titan = [t for t in run.targets if t in TITAN_TARGETS]
    if titan:
        raise SystemExit(f"regather estimate: targets {titan} are torchtitan's names: add --front-end torchtitan")
    strategies = tuple(args.strategies)
    unknown = [s for s in strategies if s not in ALL_STRATEGIES]
    if unknown:
        raise SystemExit(f"regather estimate: strategies {unknown} are --front-end torchtitan's; megatron's are "
                         f"{', '.join(ALL_STRATEGIES)}")
    try:
        result = estimate(model, run, strategies)
    except ValueError as exc:  # sizes that do not divide: say which
        raise SystemExit(f"regather estimate: {exc}") from None
    # the TE report says, per strategy, what the local spec keeps and frees (with its own attention
    # unless --attention was given)
    local = None if run.spec == "local" else estimate(
        model, replace(run, spec="local", attention_keeps_output=(args.attention or "unfused") == "fused"), strategies)
    ref = reference_for(args.model, model, run)
    asked = getattr(args, "recipe", False) or bool(given(args) & set(SAME_WORK_OPTIONS))
    same = same_work(args.model, model, run, ref) if asked else None
    if args.json:
        print(json.dumps(as_json(model, run, result, ref, same, local), indent=1))
    else:
        print("\n".join(wrapped(format_report(model, run, result, ref, same, local).splitlines())))
    return 0
