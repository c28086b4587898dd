"""``regather doctor``: what LoRA-A keeps and saves on your model and run, and what in your settings stands in the way.

The model and the run are ``regather estimate``'s: a preset (``--model``, default Qwen3-8B) or custom sizes,
``--recipe`` (a Megatron Bridge PEFT recipe's LoRA, or a shipped layout whole), the layer spec (``--spec te``,
Transformer Engine, what Bridge's recipes run; ``--spec local``, megatron's local spec) and the micro-batch
(default 1). ``--model tiny`` is the tiny test GPT that ``--build`` builds on CPU ranks (and the default with
``--build`` or ``--moe``). The report starts with a summary — what the run saves per adapter kind, and why the
rest saves nothing, beside ``regather estimate``'s figure for the same arguments — then the findings of the
reference's failure-diagnosis table (the reference: Megatron Bridge's own re-gather,
``LoRA(sequence_parallel_input_regather=True)``, measured on H100s), each with its fix; every adapter's own
decision with ``--verbose``; ``--json`` for all of it. Exit status 1 when a finding is an error or a layout
is refused after parsing (heads that do not divide over TP), 2 for what the command line's parser refuses
(an unknown choice, a size that is not a positive integer). The findings are described in :mod:`regather.tools.doctor`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import asdict, replace

from regather.megatron.reasons import ALL_TARGETS, DISPATCHERS
from regather.tools.cmdline import WIDTH, HelpFormatter, names, positive, wrapped
from regather.tools.doctor.setup import MOE_EXPERTS, Setup
from regather.tools.estimate.config import LAYOUTS, PRESETS, SPECS
from regather.tools.estimate.options import Given, apply_layout, attention, recipe_help, recipe_targets
from regather.tools.shapes import DTYPE_BYTES, DTYPE_NAMES, EXPERT_KINDS

DESCRIPTION = (
    "What LoRA-A keeps and saves on your model and run, and what in your settings stands in the way. The model and "
    "run are regather estimate's (a preset or sizes, --recipe, --spec te|local, micro-batch 1 by default); the "
    "report starts with what the run saves per adapter kind and why the rest saves nothing, beside estimate's figure "
    "for the same arguments, then the findings of the reference's failure-diagnosis table (the reference: Megatron "
    "Bridge's own LoRA(sequence_parallel_input_regather=True), measured on H100s), each with its fix. Exit status 1 "
    "when a finding is an error or a layout is refused after parsing (heads that do not divide over TP), 2 for what "
    "the command line's parser refuses (an unknown choice, a size that is not a positive integer).")
TINY = "tiny"  # --model tiny: the test GPT (Setup's defaults), what --build builds
DEFAULT_MODEL = "qwen3-8b"
STRATEGIES = ("gather", "regather", "lowrank")
#: megatron-core's TransformerConfig.recompute_modules choices
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
# --flag -> ModelShape field: the custom sizes (over the preset's, or the tiny GPT's)
_SIZES = {"hidden": "hidden", "layers": "layers", "heads": "heads", "kv_heads": "kv_heads", "head_dim": "head_dim",
          "ffn": "ffn", "num_experts": "num_experts", "moe_ffn": "moe_ffn", "topk": "topk"}
# a preset's run, where the command line says nothing (estimate's defaults)
_PRESET_RUN = {"seq": 8192, "micro_batch": 1, "lora_rank": 16}


def _targets(value: str) -> tuple:
    return names(value, ALL_TARGETS, "targets")


def _recompute_modules(value: str) -> tuple:
    return names(value, RECOMPUTE_MODULES, "recompute modules")


def _te_version(value: str) -> str:
    """``--te-version``: a version TE could have (``2.18``, ``2.18.0``, ``2.4.0.dev0+abc``)."""
    from regather.megatron.dense.te_release import version_tuple

    if version_tuple(value) is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not a Transformer Engine version such as 2.18 or 2.18.0")
    return value


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor", help="what LoRA-A keeps and saves on your model and run, every adapter's strategy, and the "
                       "allocator / NCCL / offload settings that stand in the way",
        description=DESCRIPTION,
        formatter_class=HelpFormatter)
    m = p.add_argument_group("model (regather estimate's presets; sizes override)")
    m.add_argument("--model", choices=sorted(PRESETS) + [TINY], default=None, action=Given,
                   help=f"preset (default {DEFAULT_MODEL}; {TINY}, the test GPT --build builds, with --build or --moe)")
    for flag in ("hidden", "layers", "heads", "kv-heads", "head-dim", "ffn"):
        m.add_argument(f"--{flag}", type=positive, default=None)
    m.add_argument("--activation", choices=["gelu", "swiglu"], default=None,
                   help="the MLP's activation (default: swiglu for a preset, gelu for the tiny GPT)")
    m.add_argument("--no-bias", dest="add_bias_linear", action="store_false", default=None,
                   help="add_bias_linear=False (a preset has none; the tiny GPT has biases)")
    m.add_argument("--spec", choices=SPECS, default=None,
                   help="what the base linears keep: te = Transformer Engine (what Bridge's PEFT recipes run; the "
                        "default), local = megatron's local spec (what --build builds)")
    m.add_argument("--attention", choices=["unfused", "fused"], default=None, action=Given,
                   help="fused: the attention keeps its output (TE's fused attention, flash-attention). Default: "
                        "fused on --spec te, unfused on --spec local")
    e = p.add_argument_group("mixture of experts (a MoE preset, or --moe on the tiny GPT)")
    e.add_argument("--moe", action="store_true", help="the tiny GPT's MLPs are experts (fc1/fc2 never re-gather)")
    e.add_argument("--num-experts", type=positive, default=None, help=f"with --moe (default {MOE_EXPERTS})")
    e.add_argument("--moe-ffn", type=positive, default=None)
    e.add_argument("--topk", type=positive, default=None)
    e.add_argument("--ep", type=positive, default=1, help="expert parallel size")
    e.add_argument("--etp", type=positive, default=1, help="expert tensor parallel size")
    e.add_argument("--experts", choices=EXPERT_KINDS, default=None,
                   help="SequentialMLP or TEGroupedMLP experts (moe_grouped_gemm; a preset's default)")
    e.add_argument("--dispatcher", choices=DISPATCHERS, default="alltoall", help="moe_token_dispatcher_type")
    e.add_argument("--no-share-expert-adapters", dest="share_expert_adapters", action="store_false",
                   help="grouped experts: one LoRA pair per expert (share_expert_adapters=False)")
    e.add_argument("--redispatch-expert-inputs", action="store_true",
                   help="LoRA(redispatch_expert_inputs=True): per-expert fc1 inputs dispatched again in backward")
    r = p.add_argument_group("run")
    r.add_argument("--tp", type=positive, default=2, action=Given, help="tensor parallel size")
    r.add_argument("--no-sp", dest="sp", action=Given, nargs=0, const=False, default=True,
                   help="sequence parallelism off")
    r.add_argument("--seq", type=positive, default=None, action=Given,
                   help="sequence length (default: 8192 for a preset, 32 for the tiny GPT)")
    r.add_argument("--micro-batch", type=positive, default=None, action=Given,
                   help="micro-batch size (default: 1 for a preset, as estimate; 2 for the tiny GPT)")
    r.add_argument("--pp", type=positive, default=1, help="pipeline stages (layers per GPU = layers/pp)")
    r.add_argument("--in-flight", type=positive, default=1, help="micro-batches alive at once")
    r.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES), help="as regather estimate's")
    r.add_argument("--recipe", nargs="?", const=True, default=False, choices=sorted(LAYOUTS), metavar="LAYOUT",
                   help=recipe_help(""))
    lora = p.add_argument_group("LoRA")
    lora.add_argument("--strategy", default="regather", choices=STRATEGIES,
                      help="what LoRA asks for: gather (Bridge's default), regather "
                           "(sequence_parallel_input_regather=True), lowrank")
    lora.add_argument("--targets", type=_targets, default=None, action=Given,
                      help=f"comma list (default: all of {','.join(ALL_TARGETS)}, or the recipe's)")
    lora.add_argument("--lora-rank", type=positive, default=None, action=Given,
                      help="LoRA dim (default: 16 for a preset, 8 for the tiny GPT, or the recipe's)")
    lora.add_argument("--peft", choices=("lora", "dora"), default="lora",
                      help="dora: regather.DoRA (with --bridge-lora: Megatron Bridge's own DoRA)")
    lora.add_argument("--recompute-dora-output", action="store_true",
                      help="--peft dora: DoRA(recompute_dora_output=True), the pre-magnitude output rebuilt in backward")
    lora.add_argument("--recompute-adapter-inputs", action="store_true",
                      help="LoRA(recompute_adapter_inputs=True): which adapter inputs are rebuilt in backward, from what")
    lora.add_argument("--input-requires-grad", action="store_true",
                      help="the decoder input requires grad (Bridge's maybe_enable_recompute_inputs_grad, HF's "
                           "enable_input_require_grads): layer 0's producers then keep their input")
    lora.add_argument("--bridge-lora", action="store_true",
                      help="the run uses Megatron Bridge's own LoRA (--strategy regather: with "
                           "sequence_parallel_input_regather=True): checks what it asks Transformer Engine for")
    lora.add_argument("--te-version", default=None, type=_te_version,
                      help="the Transformer Engine version of the run (default: the one installed here, if any)")
    f = p.add_argument_group("features that change eligibility or the allocator")
    f.add_argument("--use-nccl-ub", action="store_true", help="NCCL user-buffer registration (nccl_ub)")
    f.add_argument("--cuda-graphs", action="store_true", help="CUDA graphs (cuda_graph_impl)")
    f.add_argument("--cpu-offloading", action="store_true", help="activation offloading to CPU")
    f.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    f.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    f.add_argument("--recompute-modules", type=_recompute_modules, default=(),
                   help="comma list, some of " + ", ".join(RECOMPUTE_MODULES))
    o = p.add_argument_group("output")
    o.add_argument("--build", action="store_true",
                   help="build the tiny GPT on --tp CPU gloo ranks and ask its adapters (regather.decisions, then "
                        "each adapter's decision in one training step for the recompute checks)")
    o.add_argument("--verbose", action="store_true", help="every adapter's decision, one line each")
    o.add_argument("--json", action="store_true", help="everything as JSON")
    p.set_defaults(func=main)


def _model_key(args) -> str:
    if args.model:
        return args.model
    return TINY if args.build or args.moe else DEFAULT_MODEL


def setup_from_args(args) -> Setup:
    """The :class:`Setup` of the flags: a preset (or the tiny GPT) with the sizes given, estimate's layout
    and recipe options; exits naming the values where the flags contradict each other."""
    apply_layout(args, "doctor")
    key = _model_key(args)
    args.model, tiny = key, key == TINY
    if args.build and not tiny:
        raise SystemExit(f"regather doctor --build: builds the model on CPU ranks, so only --model {TINY} (the test "
                         f"GPT, sizes may be given), not --model {key}; leave --build out for the rules alone")
    spec = args.spec or ("local" if args.build else "te")
    if args.build and spec != "local":
        raise SystemExit("regather doctor --build: builds megatron's local spec on CPU; --spec te is modelled only "
                         "(leave --build out)")
    base = Setup() if tiny else Setup(**_preset_fields(key), activation="swiglu", add_bias_linear=False,
                                      model_name=PRESETS[key].name, **_PRESET_RUN)
    sizes = {field: getattr(args, flag) for flag, field in _SIZES.items() if getattr(args, flag) is not None}
    moe = args.moe or base.moe or bool(args.num_experts)
    if args.moe and not tiny and not base.moe:
        raise SystemExit(f"regather doctor --moe: {PRESETS[key].name} has no experts; MoE presets: "
                         + ", ".join(k for k, m in sorted(PRESETS.items()) if m.moe) + f", or --model {TINY}")
    if moe and not base.moe:
        sizes.setdefault("num_experts", MOE_EXPERTS)
    elif not moe and any(f in sizes for f in ("moe_ffn", "topk")):
        raise SystemExit("regather doctor: --moe-ffn / --topk describe experts: add --moe (or a MoE preset)")
    targets = args.targets or ALL_TARGETS
    targets, rank = recipe_targets(args, targets, args.lora_rank or base.lora_rank)
    if getattr(args, "recipe", False) is True and key not in _recipe_presets():
        raise SystemExit(f"regather doctor --recipe: no Megatron Bridge PEFT recipe is known for {key}; recipes: "
                         + ", ".join(_recipe_presets()))
    setup = replace(
        base, **sizes, experts=args.experts or base.experts, dispatcher=args.dispatcher, ep=args.ep, etp=args.etp,
        share_expert_adapters=args.share_expert_adapters, redispatch_expert_inputs=args.redispatch_expert_inputs,
        tp=args.tp, pp=args.pp, sp=args.sp, seq=args.seq or base.seq, micro_batch=args.micro_batch or base.micro_batch,
        in_flight=args.in_flight, dtype=DTYPE_NAMES.get(args.dtype, args.dtype), strategy=args.strategy, targets=tuple(targets), lora_rank=rank,
        use_nccl_ub=args.use_nccl_ub, cuda_graphs=args.cuda_graphs, cpu_offloading=args.cpu_offloading,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_modules=tuple(args.recompute_modules), recompute_adapter_inputs=args.recompute_adapter_inputs,
        input_requires_grad=args.input_requires_grad, activation=args.activation or base.activation,
        add_bias_linear=base.add_bias_linear if args.add_bias_linear is None else args.add_bias_linear, spec=spec,
        attention_keeps_output=attention(argparse.Namespace(attention=args.attention, spec=spec)) == "fused",
        model_name=base.model_name + (" (custom)" if sizes and not tiny else ""),
        bridge_lora=getattr(args, "bridge_lora", False), te_version=getattr(args, "te_version", None) or _installed_te(),
        peft=getattr(args, "peft", "lora"), recompute_dora_output=getattr(args, "recompute_dora_output", False))
    _check(setup)
    return setup


def _installed_te() -> str | None:
    from regather.megatron.dense.te import installed_version

    return installed_version()


def _preset_fields(key: str) -> dict:
    from regather.tools.shapes import ModelShape, shape_fields

    return shape_fields(ModelShape, PRESETS[key])


def _recipe_presets() -> list[str]:
    from regather.tools.estimate.config import RECIPES

    return sorted(RECIPES)


def _check(setup: Setup) -> None:
    """A layout that cannot exist, named (estimate's checks: sizes that do not divide, experts that do not
    split, ...), before anything is computed."""
    from regather.tools.doctor.savings import expert_estimate
    from regather.tools.estimate import check_run, layers_here

    try:
        model, run = expert_estimate(setup)
        check_run(model, run)
        layers_here(model, run)
    except ValueError as exc:
        raise SystemExit(f"regather doctor: {exc}") from None


def header(setup: Setup, built: bool) -> str:
    kv = f" / {setup.kv_heads} kv" if setup.kv_heads else ""
    experts = (f", {setup.num_experts} experts ({setup.experts}) x {setup.moe_ffn} top-{setup.topk}, "
               f"EP={setup.ep} ETP={setup.etp}") if setup.moe else f", ffn {setup.ffn}"
    rc = " + recompute_adapter_inputs" if setup.recompute_adapter_inputs else ""
    return (f"regather doctor: {setup.model_name} (h={setup.hidden}, {setup.layers} layers, {setup.heads} heads{kv}"
            f"{experts}); TP={setup.tp} SP={'on' if setup.sp else 'off'} PP={setup.pp}, seq {setup.seq}, micro-batch "
            f"{setup.micro_batch}, {setup.dtype}, spec {setup.spec}; LoRA r{setup.lora_rank} on "
            f"{', '.join(setup.targets)}, strategy {setup.strategy}{rc} "
            f"({'built model' if built else 'eligibility rules'})")


def main(args, env: Mapping[str, str] | None = None) -> int:
    import json
    import textwrap

    from regather.tools.doctor.built import built_decisions
    from regather.tools.doctor.findings import diagnose
    from regather.tools.doctor.rules import analytic_decisions
    from regather.tools.doctor.summary import lines, summary

    setup = setup_from_args(args)
    env = os.environ if env is None else env
    decisions = built_decisions(setup) if args.build else analytic_decisions(setup)
    findings = diagnose(env, setup, decisions)
    summ = summary(setup, decisions)
    if args.json:
        print(json.dumps({"setup": {"moe": setup.moe, **asdict(setup)}, "summary": summ,
                          "findings": [asdict(f) for f in findings]}, indent=1))
    else:
        shown = [f for f in findings if args.verbose or f.code not in ("adapter", "saving")]
        out = wrapped([header(setup, args.build)])
        out += lines(setup, summ)
        if shown:
            out += ["", "findings:"]
            for f in shown:
                out += [part for line in str(f).splitlines() for part in textwrap.wrap(
                    line, WIDTH, subsequent_indent=" " * 10, break_long_words=False, break_on_hyphens=False)]
        if not args.verbose:
            out += ["", "(every adapter's decision: --verbose; all of it as JSON: --json)"]
        print("\n".join(out))
    return 1 if any(f.level == "error" for f in findings) else 0
