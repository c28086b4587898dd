"""``regather bench``: every strategy on a real megatron-core GPT, counted and timed.

Example (the committed CPU runs: the commands are in benchmarks/results/*/bench.md)::

    regather bench --hidden 512 --layers 2 --heads 8 --ffn 2048 --vocab 1024 --seq 1024 --out DIR

Strategies: every one this build implements, and the variants of
``regather.tools.cpu.train.VARIANTS`` (``regather-plain``, ``regather-recompute``,
``lowrank-recompute``, ``gather-recompute``).

``--moe`` measures a tiny MoE GPT on megatron's own MoE layers instead (:mod:`regather.tools.bench.moe`),
with the ``<strategy>-recompute-redispatch`` variants too::

    regather bench --moe --tp 2 --ep 2 --experts sequential --out DIR

``--front-end torchtitan`` (``--torchtitan``) measures regather's torchtitan front end on torchtitan
0.3.0's llama3 (its sharding config, TP + SP) against torchtitan's own ``LoRAConverter``
(:mod:`regather.tools.bench.titan`)::

    regather bench --torchtitan --hidden 256 --heads 16 --ffn 768 --vocab 2048 --seq 128 --out DIR

The flags are :mod:`regather.tools.estimate.vocabulary`'s; what the command refuses is refused before any
rank starts, ``--out`` included (created and written to first).
"""

from __future__ import annotations

from dataclasses import fields

from regather.megatron.reasons import CANONICAL_TARGETS
from regather.tools.bench.moe import DEFAULT_VARIANTS, MoEBenchSpec
from regather.tools.bench.runner import DEFAULT_TARGETS, BenchSpec
from regather.tools.bench.titan import TITAN_TARGETS, TitanBenchSpec
from regather.tools.cmdline import given, writable_folder
from regather.tools.estimate.vocabulary import add_command
from regather.tools.shapes import DTYPE_NAMES

DESCRIPTION = (
    "Every strategy on a real megatron-core GPT (--moe: megatron's MoE layers; --front-end torchtitan: torchtitan's "
    "llama3) trained side by side on CPU gloo ranks: the bytes LoRA-A keeps and the collectives' bytes counted, step "
    "times as medians and ratios against gather in the same run (CPU times show relative cost only), parity. The "
    "report opens with what ran, on what, and what each column means; --out writes bench.json, bench.md (and "
    "bench.png) too. Example: regather bench --hidden 512 --layers 2 --heads 8 --ffn 2048 --vocab 1024 --seq 1024 "
    "--out DIR")
#: the --moe options, in the order the refusal names them
_MOE_OPTIONS = ("ep", "etp", "experts", "expert_lora", "dispatcher", "num_experts", "topk", "moe_ffn",
                "shared_expert_ffn", "moe_layer_freq")
#: what --render takes beside it (everything else describes a run, and --render runs nothing)
_RENDER_OPTIONS = {"render", "out", "quiet"}
#: the dtypes the CPU bench runs
_DTYPES = ("float32", "bfloat16")


def _defaults() -> dict:
    """The command's defaults: the dense spec's, and the MoE spec's for the --moe options."""
    dense, moe = BenchSpec(), MoEBenchSpec()
    out = {f.name: getattr(dense, f.name) for f in fields(BenchSpec)}
    out.update({n: getattr(moe, n) for n in _MOE_OPTIONS if n != "expert_lora"})
    out.update(targets=None, strategies=None, kv_heads=None)
    return out


def register(subparsers) -> None:
    p = add_command(subparsers, "bench", help="measure retained bytes, communication, step time and parity per "
                    "strategy", description=DESCRIPTION, defaults=_defaults(),
                    titles={"model": "model (default: the tiny test GPT)",
                            "experts": "mixture of experts (--moe; default variants: " + ",".join(DEFAULT_VARIANTS)
                                       + ")"})
    p.set_defaults(func=main)


def _moe_given(args) -> list[str]:
    """The --moe options the command line sets to something other than their default."""
    d = _defaults()
    return [f"--{n.replace('_', '-')}" for n in _MOE_OPTIONS
            if getattr(args, n) != ("shared" if n == "expert_lora" else d[n])]


def _dtype(args, mode: str) -> str:
    dtype = DTYPE_NAMES.get(args.dtype, args.dtype)
    if dtype not in _DTYPES:
        raise SystemExit(f"regather bench{mode}: --dtype {args.dtype}: the CPU bench runs {' or '.join(_DTYPES)}")
    return dtype


def spec_from_args(args) -> BenchSpec:
    from regather.tools.bench.runner import available_strategies

    if args.front_end == "torchtitan":
        return titan_spec_from_args(args)
    titan_only = [f for f, on in (("--ac", args.ac != "none"), ("--compile", args.compile)) if on]
    if titan_only:
        raise SystemExit(f"regather bench: {', '.join(titan_only)}: torchtitan models only (--front-end torchtitan)")
    if args.moe:
        return moe_spec_from_args(args)
    from regather.tools.cpu.moe_train import moe_variants

    strategies = tuple(args.strategies or ())
    only_moe = [s for s in strategies if s not in available_strategies() and s in moe_variants()]
    other = [s for s in strategies if s not in available_strategies() and s not in only_moe]
    if other:
        raise SystemExit(f"regather bench: strategies {other}: not run on megatron's dense GPT, which runs "
                         f"{', '.join(available_strategies())}")
    only_moe += _moe_given(args)
    if only_moe:
        raise SystemExit(f"regather bench: {', '.join(only_moe)}: MoE models only (--moe)")
    targets = args.targets or (CANONICAL_TARGETS if args.canonical else DEFAULT_TARGETS)
    spec = BenchSpec(hidden=args.hidden, layers=args.layers, heads=args.heads, ffn=args.ffn, vocab=args.vocab,
                     kv_heads=args.kv_heads, tp=args.tp, seq=args.seq, micro_batch=args.micro_batch,
                     dtype=_dtype(args, ""), lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                     targets=tuple(targets), canonical=args.canonical, peft=args.peft,
                     recompute_dora_output=args.recompute_dora_output,
                     steps=args.steps, warmup=args.warmup, strategies=strategies,
                     timeout=args.timeout, quiet=args.quiet, input_requires_grad=args.input_requires_grad)
    problems = spec.problems()
    if problems:
        raise SystemExit("regather bench: " + "; ".join(problems))
    return spec


def moe_spec_from_args(args) -> MoEBenchSpec:
    """The ``--moe`` spec; exits with every problem of the combination given."""
    names = ("kv_heads", "hidden", "layers", "heads", "ffn", "vocab", "tp", "seq", "micro_batch",
             "lora_rank", "lora_alpha", "canonical", "steps", "warmup", "timeout", "quiet",
             "input_requires_grad") + tuple(n for n in _MOE_OPTIONS if n != "expert_lora")
    targets = args.targets if args.targets is not None else DEFAULT_TARGETS
    spec = MoEBenchSpec(**{n: getattr(args, n) for n in names}, dtype=_dtype(args, " --moe"),
                        share_expert_adapters=args.expert_lora == "shared",
                        targets=tuple(targets), strategies=tuple(args.strategies or ()))
    problems = spec.problems()
    if problems:
        raise SystemExit("regather bench --moe: " + "; ".join(problems))
    return spec


def titan_spec_from_args(args) -> TitanBenchSpec:
    """The ``--front-end torchtitan`` spec; exits with every problem of the combination given."""
    other = ["--moe"] if args.moe else []
    other += _moe_given(args)
    other += ["--canonical"] if args.canonical else []
    other += ["--input-requires-grad (always: the embedding output requires grad)"] if args.input_requires_grad else []
    if other:
        raise SystemExit(f"regather bench --torchtitan: {', '.join(other)}: not with --torchtitan")
    targets = TITAN_TARGETS if args.targets is None else tuple(args.targets)
    spec = TitanBenchSpec(hidden=args.hidden, layers=args.layers, heads=args.heads, ffn=args.ffn, vocab=args.vocab,
                          kv_heads=args.kv_heads, tp=args.tp, seq=args.seq, micro_batch=args.micro_batch,
                          dtype=_dtype(args, " --torchtitan"), lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                          targets=targets, steps=args.steps, warmup=args.warmup,
                          strategies=tuple(args.strategies or ()), timeout=args.timeout, quiet=args.quiet,
                          ac=args.ac, compile=args.compile)
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
        run_options = sorted(f"--{n.replace('_', '-')}" for n in given(args) - _RENDER_OPTIONS)
        if run_options:
            raise SystemExit(f"regather bench --render: {', '.join(run_options)}: --render runs nothing and prints "
                             "an earlier run's report as it ran (its options are in its bench.json); leave them out "
                             "or drop --render")
        summary = _rendered(args.render)
        if args.out:
            writable_folder(args.out, "bench")
        shown = {"moe": moe_report, "torchtitan": titan_report}.get(summary.get("mode"), report)
        print(shown.text_table(summary))
        for path in shown.write(summary, args.out) if args.out else ():
            print(f"wrote {path}")
        return 0
    spec = spec_from_args(args)
    if args.out:
        writable_folder(args.out, "bench")  # before the run, not after it
    shown, bench = ((titan_report, titan) if isinstance(spec, TitanBenchSpec) else
                    (moe_report, moe) if isinstance(spec, MoEBenchSpec) else (report, runner))
    try:
        summary = bench.run(spec)
    except TimeoutError as exc:  # --timeout is the user's limit: one line, as for any other refusal
        raise SystemExit(f"regather bench: {str(exc).splitlines()[0]} (--timeout {args.timeout:g} is the "
                         "seconds the run is expected to take: raise it)") from None
    summary["command"] = shown.command_line(summary["spec"], args.out)
    summary["env"] = report.environment()
    print(shown.text_table(summary))
    if args.out:
        for path in shown.write(summary, args.out):
            print(f"wrote {path}")
    return 0
