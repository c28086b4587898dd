"""``regather demo``: a short LoRA fine-tune, gather path vs regather, side by side.

A real megatron-core ``GPTModel`` (local spec) with LoRA on linear_qkv,
linear_proj, linear_fc1 and linear_fc2 learns the byte-level text shipped in
``regather/data/tiny_corpus.txt`` with TP=2 and sequence parallelism on two CPU
ranks (gloo). Both strategies train from the same weights on the same batches
in one process group, alternating step by step, so their step times compare
fairly. The demo prints every loss for both (they must be identical), every
adapter's decision, the retained activation bytes and collective bytes of one
step, and the step-time ratio. It exits non-zero if the losses differ.
"""

from __future__ import annotations

import argparse
from importlib import resources

import torch

STRATEGIES = ("gather", "regather")


def load_corpus() -> torch.Tensor:
    data = resources.files("regather").joinpath("data/tiny_corpus.txt").read_bytes()
    return torch.tensor(list(data), dtype=torch.uint8)


def _rank_main(rank, world_size, cfg, tokens):
    from regather.testing.train import compare_strategies

    def progress(name, step, seconds):
        if rank == 0 and name == STRATEGIES[-1] and (step + 1) % 10 == 0:
            print(f"  step {step + 1:3d}/{cfg.steps} done", flush=True)

    return compare_strategies(rank, world_size, cfg, STRATEGIES, tokens=tokens, progress=progress)


def _eligible(result: dict) -> int:
    """Saved LoRA-A input bytes of the adapters on linear_qkv and linear_fc1."""
    labels = result["saved_bytes_by_label"]
    return sum(labels.get(f"adapter_input:{name}", 0) for name in ("linear_qkv", "linear_fc1"))


def _fmt_bytes(n: int) -> str:
    return f"{n:,}"


def run(args) -> int:
    from regather.testing.dist import run_ranks
    from regather.testing.models import TinyGPT
    from regather.testing.train import RunConfig

    shape = TinyGPT(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                    ffn_hidden_size=4 * args.hidden, vocab_size=256, seq_length=args.seq)
    cfg = RunConfig(tp=args.tp, shape=shape, micro_batch=args.micro_batch, steps=args.steps,
                    lr=args.lr, lora_dim=args.lora_rank, lora_alpha=2 * args.lora_rank, warmup=3)
    tokens = load_corpus()
    print(f"regather demo: LoRA (rank {args.lora_rank}) fine-tune of a megatron-core GPTModel "
          f"({args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, "
          f"micro-batch {args.micro_batch}, fp32)")
    print(f"TP={args.tp} + sequence parallel on {args.tp} CPU ranks (gloo); text: tiny_corpus.txt "
          f"({len(tokens):,} bytes, byte-level tokens); {args.steps} steps per strategy, interleaved\n")
    results = run_ranks(_rank_main, args.tp, cfg, tokens, timeout=args.timeout)
    r0 = results[0]
    g, rg = r0["gather"], r0["regather"]

    print(f"{'step':>4}  {'loss (gather)':>14}  {'loss (regather)':>15}  same")
    identical = True
    for i, (a, b) in enumerate(zip(g["loss"], rg["loss"])):
        same = a == b
        identical &= same
        print(f"{i + 1:>4}  {a:>14.6f}  {b:>15.6f}  {'yes' if same else 'NO'}")
    for rank_result in results[1:]:  # every rank must agree, not just rank 0
        identical &= rank_result["gather"]["loss"] == rank_result["regather"]["loss"]

    print("\nAdapter decisions (regather run, rank 0):")
    width = max(len(p) for p in rg["decisions"])
    for path, decision in sorted(rg["decisions"].items()):
        print(f"  {path:<{width}}  {decision}")

    print("\nOne step, per rank (bytes counted: saved-tensor hooks at the end of forward;"
          " collectives wrapped, bytes received):")
    rows = [
        ("retained activations, total", g["saved_bytes"], rg["saved_bytes"]),
        ("  of which LoRA-A inputs", g["saved_adapter_input_bytes"], rg["saved_adapter_input_bytes"]),
        ("    qkv + fc1 (eligible)", _eligible(g), _eligible(rg)),
        ("    proj + fc2 (row-parallel)", g["saved_adapter_input_bytes"] - _eligible(g),
         rg["saved_adapter_input_bytes"] - _eligible(rg)),
    ]
    for kind in sorted(set(g["comm_bytes"]) | set(rg["comm_bytes"])):
        rows.append((f"{kind} bytes", g["comm_bytes"].get(kind, 0), rg["comm_bytes"].get(kind, 0)))
    print(f"  {'':<30} {'gather':>12} {'regather':>12} {'regather/gather':>16}")
    for label, a, b in rows:
        ratio = f"{b / a:.3f}" if a else "-"
        print(f"  {label:<30} {_fmt_bytes(a):>12} {_fmt_bytes(b):>12} {ratio:>16}")
    tg, tr = g["median_step_time"], rg["median_step_time"]
    print(f"  {'median step time (ms)':<30} {tg * 1e3:>12.2f} {tr * 1e3:>12.2f} {tr / tg:>16.3f}")
    print(f"\nLoRA-A inputs of the eligible adapters (qkv, fc1): {_fmt_bytes(_eligible(rg))} bytes "
          f"instead of {_fmt_bytes(_eligible(g))}, cut by a factor {_eligible(g) / _eligible(rg):g} "
          f"(TP={args.tp}); the row-parallel adapters keep their TP-split input on both paths.")
    print(f"Step-time ratio regather/gather: {tr / tg:.3f} (median of steps 4-{args.steps}, "
          "CPU, same run; absolute times mean little on CPU).")
    print(f"Losses identical on every rank: {'yes' if identical else 'NO'}")
    return 0 if identical else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="short LoRA fine-tune on 2 CPU ranks: gather vs regather")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--timeout", type=float, default=170.0, help="expected seconds; ranks still computing are stopped after 3x this "
                   "(REGATHER_TEST_TIMEOUT_SCALE), ranks making no progress after 60 s (REGATHER_STALL_TIMEOUT)")
    p.set_defaults(func=run)
