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

from regather.megatron.reasons import ALL_TARGETS
from regather.tools.cmdline import WIDTH, wrapped
from regather.tools.doctor.setup import Setup
from regather.tools.estimate.config import PRESETS
from regather.tools.estimate.options import (
    PRESET_RUN,
    TINY_MOE,
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
from regather.tools.shapes import DTYPE_NAMES

DESCRIPTION = (
    "What LoRA-A keeps and saves on your model and run, and what in your settings stands in the way. The model and "
    "run are regather estimate's (a preset, the tiny test GPT or sizes, --recipe, --spec te|local, micro-batch 1 by "
    "default); the report starts with what the run saves per adapter kind and why the rest saves nothing, beside "
    "estimate's figure for the same arguments (modelled: no GPU measured it), then the findings of the reference's "
    "failure-diagnosis table (the reference: Megatron Bridge's own LoRA(sequence_parallel_input_regather=True), "
    "measured on H100s), each with its fix. Exit status 1 when a finding is an error or a layout is refused after "
    "parsing (heads that do not divide over TP, flags that contradict each other), 2 for what the command line's "
    "parser refuses (an unknown choice, a size that is not a positive integer).")
DEFAULT_MODEL = "qwen3-8b"
STRATEGIES = ("gather", "regather", "lowrank")


def register(subparsers) -> None:
    p = add_command(subparsers, "doctor", help="what LoRA-A keeps and saves on your model and run, every adapter's "
                    "strategy, and the allocator / NCCL / offload settings that stand in the way",
                    description=DESCRIPTION, titles={"model": "model (regather estimate's presets; sizes override)",
                                                     "experts": "mixture of experts (a MoE preset, or --moe on "
                                                                f"{TINY})"})
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
    if args.moe and not tiny and not PRESETS[key].moe:
        raise SystemExit(f"regather doctor --moe: {PRESETS[key].name} has no experts; MoE presets: "
                         + ", ".join(k for k, m in sorted(PRESETS.items()) if m.moe) + f", or --model {TINY}")
    base = (replace(Setup(), **TINY_MOE) if args.moe else Setup()) if tiny else Setup(
        **_preset_fields(key), activation="swiglu", add_bias_linear=False, model_name=PRESETS[key].name,
        qk_norm=PRESETS[key].qk_norm, **PRESET_RUN)
    refuse_recipe(args, key, "doctor")
    sizes, name = sized(args, base, base.model_name, "doctor", tiny=tiny)
    moe = sizes.get("num_experts", base.num_experts) > 0
    refuse_contradictions(args, moe, name, "doctor")
    if args.build and args.cp > 1:
        raise SystemExit(f"regather doctor --build: --cp {args.cp}: the CPU model is megatron's local spec, which runs "
                         "no context parallelism (leave --build out for the rules alone)")
    refuse_cp(argparse.Namespace(cp=args.cp, spec=spec, attention=args.attention), spec, "doctor")
    if args.redispatch_expert_inputs and not args.recompute_adapter_inputs:
        raise SystemExit("regather doctor: --redispatch-expert-inputs rebuilds expert inputs in backward: it needs "
                         "--recompute-adapter-inputs (LoRA refuses redispatch_expert_inputs without "
                         "recompute_adapter_inputs)")
    bad = [t for t in args.targets or () if t not in ALL_TARGETS]
    if bad:
        raise SystemExit(f"regather doctor: targets {bad}: doctor reasons about megatron's fused linears, "
                         f"{', '.join(ALL_TARGETS)}")
    targets, rank = recipe_targets(args, tuple(args.targets or ALL_TARGETS), args.lora_rank or base.lora_rank)
    setup = replace(
        base, **sizes, experts=args.experts or base.experts, dispatcher=args.dispatcher, ep=args.ep, etp=args.etp,
        share_expert_adapters=args.expert_lora == "shared", redispatch_expert_inputs=args.redispatch_expert_inputs,
        tp=args.tp, pp=args.pp, sp=args.sp, seq=args.seq or base.seq, micro_batch=args.micro_batch or base.micro_batch,
        in_flight=args.in_flight, dtype=DTYPE_NAMES.get(args.dtype, args.dtype), strategy=args.strategy,
        targets=targets, lora_rank=rank,
        use_nccl_ub=args.use_nccl_ub, cuda_graphs=args.cuda_graphs, cpu_offloading=args.cpu_offloading,
        **recompute(args, "doctor"), cp=args.cp, gpu_memory=args.gpu_memory,
        recompute_adapter_inputs=args.recompute_adapter_inputs,
        input_requires_grad=args.input_requires_grad, activation=args.activation or base.activation,
        add_bias_linear=base.add_bias_linear if args.add_bias_linear is None else args.add_bias_linear, spec=spec,
        attention_keeps_output=attention(argparse.Namespace(attention=args.attention, spec=spec)) == "fused",
        model_name=name, bridge_lora=args.bridge_lora, te_version=args.te_version or _installed_te(),
        peft=args.peft, recompute_dora_output=args.recompute_dora_output)
    _check(setup)
    return setup


def _installed_te() -> str | None:
    from regather.megatron.dense.te import installed_version

    return installed_version()


def _preset_fields(key: str) -> dict:
    from regather.tools.shapes import ModelShape, shape_fields

    return shape_fields(ModelShape, PRESETS[key])


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
            f"{experts}); TP={setup.tp} SP={'on' if setup.sp else 'off'} PP={setup.pp}"
            f"{f' CP={setup.cp}' if setup.cp > 1 else ''}, seq {setup.seq}, micro-batch "
            f"{setup.micro_batch}, {setup.dtype}, spec {setup.spec}; LoRA r{setup.lora_rank} on "
            f"{', '.join(setup.targets)}, strategy {setup.strategy}{rc} "
            f"({'built model' if built else 'eligibility rules'})")


def how_obtained(setup: Setup, built: bool) -> str:
    """How the report's decisions and bytes were obtained (none of it measured on a GPU)."""
    decisions = (f"decisions asked of the {setup.model_name} built on {setup.tp} CPU gloo ranks (megatron's local "
                 "spec, one training step)" if built else
                 "decisions from regather's eligibility rules (no model built: --build asks a tiny GPT on CPU ranks)")
    spec = ("spec te: the qkv / fc1 / fc2 rules measured on the Transformer Engine model on CPU, linear_proj's and "
            "the experts' read in TE's source" if setup.spec == "te" else
            "the local spec: they match regather bench's counts on CPU byte for byte")
    return f"how obtained: {decisions}; bytes modelled, regather estimate's formulas ({spec}); none measured on a GPU"


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
        out = wrapped([header(setup, args.build), how_obtained(setup, args.build)])
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
