"""``regather bench``: every strategy on a real megatron-core GPT, counted and timed.

Example (the committed CPU runs: the commands are in benchmarks/results/*/bench.md)::

    regather bench --hidden 512 --layers 2 --heads 8 --ffn 2048 --vocab 1024 --seq 1024 --out DIR

Strategies: every one this build implements, and the variants of
``regather.tools.cpu.train.VARIANTS`` (``regather-plain``, ``regather-recompute``,
``lowrank-recompute``, ``gather-recompute``).

``--moe`` measures a tiny MoE GPT on megatron's own MoE layers instead (:mod:`regather.tools.bench.moe`),
with the ``<strategy>-recompute-redispatch`` variants too::

    regather bench --moe --tp 2 --ep 2 --experts sequential --out DIR

``--torchtitan`` measures regather's torchtitan front end on torchtitan 0.3.0's llama3 (its sharding
config, TP + SP) against torchtitan's own ``LoRAConverter`` (:mod:`regather.tools.bench.titan`)::

    regather bench --torchtitan --hidden 256 --heads 16 --ffn 768 --vocab 2048 --seq 128 --out DIR
"""

from __future__ import annotations

from regather.megatron.canonical import CANONICAL_TARGETS
from regather.megatron.reasons import ALL_TARGETS
from regather.tools.bench.moe import DEFAULT_VARIANTS, DISPATCHERS, MoEBenchSpec
from regather.tools.bench.runner import DEFAULT_TARGETS, BenchSpec
from regather.tools.bench.titan import TITAN_TARGETS, TitanBenchSpec
from regather.tools.cmdline import HelpFormatter, names, non_negative, positive
from regather.tools.shapes import EXPERT_KINDS


def _strategies(value: str) -> tuple:
    from regather.tools.bench.runner import available_strategies
    from regather.tools.cpu.moe_train import moe_variants
    from regather.torchtitan.options import VARIANTS

    # --moe has -recompute-redispatch, --torchtitan torchtitan (its own LoRA)
    return names(value, tuple(dict.fromkeys(available_strategies() + moe_variants() + list(VARIANTS))), "strategies")


def _targets(value: str) -> tuple:
    # every model's names; the spec's problems() then checks them against the model asked for
    return names(value, tuple(dict.fromkeys(ALL_TARGETS + CANONICAL_TARGETS + TITAN_TARGETS)), "targets")


def register(subparsers) -> None:
    d = BenchSpec()
    p = subparsers.add_parser(
        "bench", help="measure retained bytes, communication, step time and parity per strategy",
        description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    g = p.add_argument_group("model (default: tiny)")
    g.add_argument("--hidden", type=positive, default=d.hidden)
    g.add_argument("--layers", type=positive, default=d.layers)
    g.add_argument("--heads", type=positive, default=d.heads)
    g.add_argument("--kv-heads", type=positive, default=None, help="query groups (GQA); default = heads")
    g.add_argument("--ffn", type=positive, default=d.ffn)
    g.add_argument("--vocab", type=positive, default=d.vocab)
    g = p.add_argument_group("run")
    g.add_argument("--tp", type=positive, default=d.tp, help="tensor-parallel size = ranks spawned")
    g.add_argument("--seq", type=positive, default=d.seq)
    g.add_argument("--micro-batch", type=positive, default=d.micro_batch)
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default=d.dtype)
    g.add_argument("--lora-rank", type=positive, default=d.lora_rank)
    g.add_argument("--lora-alpha", type=positive, default=d.lora_alpha)
    g.add_argument("--targets", type=_targets, default=None,
                   help=f"comma list (default: {','.join(DEFAULT_TARGETS)}; with --canonical: "
                        f"{','.join(CANONICAL_TARGETS)}; with --torchtitan: {','.join(TITAN_TARGETS)})")
    g.add_argument("--canonical", action="store_true",
                   help="regather.CanonicalLoRA (one adapter per q, k, v, gate, up) on a gated SwiGLU GPT; reports "
                        "the q/k/v and gate/up adapter inputs beside Megatron Bridge's CanonicalLoRA (5 x_full a layer)")
    g.add_argument("--peft", choices=("lora", "dora"), default=d.peft,
                   help="dora: regather.DoRA on the same GPT; its kept pre-magnitude output is reported apart")
    g.add_argument("--recompute-dora-output", action="store_true",
                   help="--peft dora: DoRA(recompute_dora_output=True), the pre-magnitude output rebuilt in backward")
    g.add_argument("--steps", type=positive, default=d.steps, help="steps per strategy (interleaved)")
    g.add_argument("--warmup", type=non_negative, default=d.warmup, help="first steps left out of the time median")
    g.add_argument("--strategies", type=_strategies, default=None,
                   help="comma list (default: all this build implements); gather is always included")
    g.add_argument("--input-requires-grad", action="store_true",
                   help="make the decoder input require grad (Megatron Bridge's maybe_enable_recompute_inputs_grad): "
                        "layer 0's linear_qkv recomputes its input too under the -recompute variants")
    g.add_argument("--timeout", type=float, default=d.timeout, help="expected seconds; ranks still computing are stopped after 3x this "
                   "(REGATHER_TEST_TIMEOUT_SCALE), ranks making no progress after 60 s (REGATHER_STALL_TIMEOUT)")
    g.add_argument("--out", metavar="DIR", help="write bench.json, bench.md and bench.png here")
    g.add_argument("--quiet", action="store_true", help="no progress line")
    g.add_argument("--render", metavar="JSON", help="run nothing: print and re-write (with --out) the reports "
                   "of an earlier bench.json")
    m, dm = p.add_argument_group("mixture of experts (--moe; ranks = max(tp, ep x etp))"), MoEBenchSpec()
    m.add_argument("--moe", action="store_true",
                   help="a tiny MoE GPT on megatron's MoE layers (router, token dispatcher, experts); variants "
                        "also <strategy>-recompute-redispatch (default: " + ",".join(DEFAULT_VARIANTS) + ")")
    m.add_argument("--experts", choices=EXPERT_KINDS, default=dm.experts,
                   help="SequentialMLP (an adapter per expert) or TEGroupedMLP on the TE stand-ins")
    m.add_argument("--per-expert", action="store_true",
                   help="grouped experts: one LoRA pair per local expert (share_expert_adapters=False)")
    m.add_argument("--ep", type=positive, default=dm.ep, help="expert-parallel size")
    m.add_argument("--etp", type=positive, default=dm.etp, help="expert tensor-parallel size")
    m.add_argument("--dispatcher", choices=DISPATCHERS, default=dm.dispatcher)
    m.add_argument("--num-experts", type=positive, default=dm.num_experts)
    m.add_argument("--topk", type=positive, default=dm.topk)
    m.add_argument("--moe-ffn", type=positive, default=dm.moe_ffn, help="each expert's ffn hidden size")
    m.add_argument("--shared-expert-ffn", type=non_negative, default=dm.shared_expert_ffn, help="0: no shared expert")
    m.add_argument("--moe-layer-freq", type=positive, default=dm.moe_layer_freq,
                   help="every n-th layer is MoE, the others dense (--ffn)")
    t = p.add_argument_group("torchtitan (--torchtitan; ranks = tp)")
    t.add_argument("--torchtitan", action="store_true",
                   help="torchtitan 0.3.0's llama3 under its own sharding config (TP + SP, partial_dtensor): torchtitan's "
                        "LoRAConverter (variant torchtitan) against regather's (default: all of gather, regather, "
                        "regather-plain, lowrank and their -recompute variants); bytes per adapter kind")
    t.add_argument("--ac", choices=("none", "selective", "full"), default="none",
                   help="torchtitan's activation checkpointing on every block: SelectiveAC or FullAC (default configs)")
    t.add_argument("--compile", action="store_true",
                   help="torchtitan's apply_compile (each block, fullgraph=True, inductor); bytes: the allocator's")
    p.set_defaults(func=main)


def spec_from_args(args) -> BenchSpec:
    from regather.tools.bench.runner import available_strategies

    if getattr(args, "torchtitan", False):
        return titan_spec_from_args(args)
    titan_only = [f for f, on in (("--ac", getattr(args, "ac", "none") != "none"),
                                  ("--compile", getattr(args, "compile", False))) if on]
    if titan_only:
        raise SystemExit(f"regather bench: {', '.join(titan_only)}: torchtitan models only (--torchtitan)")
    if getattr(args, "moe", False):
        return moe_spec_from_args(args)
    dm = MoEBenchSpec()
    only_moe = [s for s in args.strategies or () if s not in available_strategies()]
    only_moe += [f"--{n.replace('_', '-')}" for n in _MOE_OPTIONS if getattr(args, n, None) != getattr(dm, n, False)]
    if only_moe:
        raise SystemExit(f"regather bench: {', '.join(only_moe)}: MoE models only (--moe)")
    targets = args.targets
    if targets is None:
        targets = CANONICAL_TARGETS if args.canonical else DEFAULT_TARGETS
    elif isinstance(targets, str):
        targets = _targets(targets)
    spec = BenchSpec(hidden=args.hidden, layers=args.layers, heads=args.heads, ffn=args.ffn, vocab=args.vocab,
                     kv_heads=args.kv_heads, tp=args.tp, seq=args.seq, micro_batch=args.micro_batch,
                     dtype=args.dtype, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                     targets=tuple(targets), canonical=args.canonical, peft=args.peft,
                     recompute_dora_output=args.recompute_dora_output,
                     steps=args.steps, warmup=args.warmup, strategies=tuple(args.strategies or ()),
                     timeout=args.timeout, quiet=args.quiet, input_requires_grad=args.input_requires_grad)
    problems = spec.problems()
    if problems:
        raise SystemExit("regather bench: " + "; ".join(problems))
    return spec


# the --moe options (--per-expert: share_expert_adapters=False), in the order the refusal names them
_MOE_OPTIONS = ("ep", "etp", "experts", "per_expert", "dispatcher", "num_experts", "topk", "moe_ffn",
                "shared_expert_ffn", "moe_layer_freq")


def moe_spec_from_args(args) -> MoEBenchSpec:
    """The ``--moe`` spec; exits with every problem of the combination given."""
    names = ("kv_heads", "hidden", "layers", "heads", "ffn", "vocab", "tp", "seq", "micro_batch", "dtype",
             "lora_rank", "lora_alpha", "canonical", "steps", "warmup", "timeout", "quiet",
             "input_requires_grad") + tuple(n for n in _MOE_OPTIONS if n != "per_expert")
    targets = args.targets if args.targets is not None else DEFAULT_TARGETS
    spec = MoEBenchSpec(**{n: getattr(args, n) for n in names}, share_expert_adapters=not args.per_expert,
                        targets=tuple(targets), strategies=tuple(args.strategies or ()))
    problems = spec.problems()
    if problems:
        raise SystemExit("regather bench --moe: " + "; ".join(problems))
    return spec


def titan_spec_from_args(args) -> TitanBenchSpec:
    """The ``--torchtitan`` spec; exits with every problem of the combination given."""
    dm = MoEBenchSpec()
    other = ["--moe"] if args.moe else []
    other += [f"--{n.replace('_', '-')}" for n in _MOE_OPTIONS if getattr(args, n, None) != getattr(dm, n, False)]
    other += ["--canonical"] if args.canonical else []
    other += ["--input-requires-grad (always: the embedding output requires grad)"] if args.input_requires_grad else []
    if other:
        raise SystemExit(f"regather bench --torchtitan: {', '.join(other)}: not with --torchtitan")
    targets = TITAN_TARGETS if args.targets is None else tuple(args.targets)
    spec = TitanBenchSpec(hidden=args.hidden, layers=args.layers, heads=args.heads, ffn=args.ffn, vocab=args.vocab,
                          kv_heads=args.kv_heads, tp=args.tp, seq=args.seq, micro_batch=args.micro_batch,
                          dtype=args.dtype, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, targets=targets,
                          steps=args.steps, warmup=args.warmup, strategies=tuple(args.strategies or ()),
                          timeout=args.timeout, quiet=args.quiet, ac=args.ac, compile=args.compile)
    problems = spec.problems()
    if problems:
        raise SystemExit("regather bench --torchtitan: " + "; ".join(problems))
    return spec


def _rendered(path: str) -> dict:
    """An earlier bench.json's summary; exits with one line where it cannot be read."""
    import json

    try:
        with open(path) as f:
            summary = json.load(f)
    except OSError as exc:
        raise SystemExit(f"regather bench: --render {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SystemExit(f"regather bench: --render {path}: not a bench.json ({exc})") from None
    if not isinstance(summary, dict) or "spec" not in summary:
        raise SystemExit(f"regather bench: --render {path}: not a bench.json (no \"spec\")")
    return summary


def main(args) -> int:
    from regather.tools.bench import moe, moe_report, report, runner, titan, titan_report

    if args.render:
        summary = _rendered(args.render)
        shown = {"moe": moe_report, "torchtitan": titan_report}.get(summary.get("mode"), report)
        print(shown.text_table(summary))
        for path in shown.write(summary, args.out) if args.out else ():
            print(f"wrote {path}")
        return 0
    spec = spec_from_args(args)
    shown, bench = ((titan_report, titan) if isinstance(spec, TitanBenchSpec) else
                    (moe_report, moe) if isinstance(spec, MoEBenchSpec) else (report, runner))
    summary = bench.run(spec)
    summary["command"] = shown.command_line(summary["spec"], args.out)
    summary["env"] = report.environment()
    print(shown.text_table(summary))
    if args.out:
        for path in shown.write(summary, args.out):
            print(f"wrote {path}")
    return 0
