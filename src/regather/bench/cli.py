"""``regather bench``: every strategy on a real megatron-core GPT, counted and timed.

Example (the committed CPU runs: the commands are in benchmarks/results/*/bench.md)::

    regather bench --hidden 512 --layers 2 --heads 8 --ffn 2048 --vocab 1024 --seq 1024 --out DIR

Strategies: every one this build implements, and the variants of
``regather.testing.train.VARIANTS`` (``regather-plain``, ``regather-recompute``,
``lowrank-recompute``, ``gather-recompute``).
"""

from __future__ import annotations

import argparse

from regather.bench.runner import DEFAULT_TARGETS, BenchSpec
from regather.canonical import CANONICAL_TARGETS


def _strategies(value: str) -> tuple:
    from regather.bench.runner import available_strategies

    known = available_strategies()
    names = tuple(v.strip().lower() for v in value.split(",") if v.strip())
    unknown = [n for n in names if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown strategies {unknown}; this build has {', '.join(known)}")
    return names


def _targets(value: str) -> tuple:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def register(subparsers) -> None:
    d = BenchSpec()
    p = subparsers.add_parser(
        "bench", help="measure retained bytes, communication, step time and parity per strategy",
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model (default: tiny)")
    g.add_argument("--hidden", type=int, default=d.hidden)
    g.add_argument("--layers", type=int, default=d.layers)
    g.add_argument("--heads", type=int, default=d.heads)
    g.add_argument("--kv-heads", type=int, default=None, help="query groups (GQA); default = heads")
    g.add_argument("--ffn", type=int, default=d.ffn)
    g.add_argument("--vocab", type=int, default=d.vocab)
    g = p.add_argument_group("run")
    g.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel size = ranks spawned")
    g.add_argument("--seq", type=int, default=d.seq)
    g.add_argument("--micro-batch", type=int, default=d.micro_batch)
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default=d.dtype)
    g.add_argument("--lora-rank", type=int, default=d.lora_rank)
    g.add_argument("--lora-alpha", type=int, default=d.lora_alpha)
    g.add_argument("--targets", type=_targets, default=None,
                   help=f"comma list (default: {','.join(DEFAULT_TARGETS)}; with --canonical: "
                        f"{','.join(CANONICAL_TARGETS)})")
    g.add_argument("--canonical", action="store_true",
                   help="regather.CanonicalLoRA (one adapter per q, k, v, gate, up) on a gated SwiGLU GPT; reports "
                        "the q/k/v and gate/up adapter inputs beside Megatron Bridge's CanonicalLoRA (5 x_full a layer)")
    g.add_argument("--steps", type=int, default=d.steps, help="steps per strategy (interleaved)")
    g.add_argument("--warmup", type=int, default=d.warmup, help="first steps left out of the time median")
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
    p.set_defaults(func=main)


def spec_from_args(args) -> BenchSpec:
    if args.steps <= args.warmup:
        raise SystemExit(f"regather bench: --steps ({args.steps}) must exceed --warmup ({args.warmup})")
    targets = args.targets
    if targets is None:
        targets = CANONICAL_TARGETS if args.canonical else DEFAULT_TARGETS
    elif isinstance(targets, str):
        targets = _targets(targets)
    return BenchSpec(hidden=args.hidden, layers=args.layers, heads=args.heads, ffn=args.ffn, vocab=args.vocab,
                     kv_heads=args.kv_heads, tp=args.tp, seq=args.seq, micro_batch=args.micro_batch,
                     dtype=args.dtype, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                     targets=tuple(targets), canonical=args.canonical,
                     steps=args.steps, warmup=args.warmup, strategies=tuple(args.strategies or ()),
                     timeout=args.timeout, quiet=args.quiet, input_requires_grad=args.input_requires_grad)


def main(args) -> int:
    from regather.bench import report, runner

    if args.render:
        import json

        with open(args.render) as f:
            summary = json.load(f)
        print(report.text_table(summary))
        for path in report.write(summary, args.out) if args.out else ():
            print(f"wrote {path}")
        return 0
    spec = spec_from_args(args)
    summary = runner.run(spec)
    summary["command"] = report.command_line(summary["spec"], args.out)
    summary["env"] = report.environment()
    print(report.text_table(summary))
    if args.out:
        for path in report.write(summary, args.out):
            print(f"wrote {path}")
    return 0
