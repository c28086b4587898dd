"""How much of the backward x re-gather does early re-gather hide? (CPU, gloo, 2 ranks)

Runs a megatron-core GPT with LoRA (regather on linear_qkv/linear_fc1) twice in one
process per rank — plain regather (gather issued in LoRA-A's backward, waited after its
dgrad) and early re-gather (issued when the adapter's output gradient arrives, dA after
the base dgrad) — alternating steps, and reports per step the seconds backward spent
blocked in ``wait()`` on the gather (``regather.tools.bench.clocks.regather_waits``), the
gathers' own duration measured alone, and step times. Medians over the measured steps.

    .venv/bin/python benchmarks/early_regather_wait.py --hidden 512 --ffn 2048 --seq 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _rank(rank, t, args):
    import torch.distributed as dist

    from regather import LoRA
    from regather.core.comm import all_gather_seq
    from regather.tools.bench.clocks import regather_waits
    from regather.tools.cpu.models import TinyGPT, build_gpt, gpt_batch, gpt_loss

    shape = TinyGPT(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                    ffn_hidden_size=args.ffn, vocab_size=args.vocab, seq_length=args.seq)
    models = {}
    for name, strategy, early in (("gather", "gather", False), ("plain", "regather", False),
                                  ("early", "regather", True)):
        m = build_gpt(shape, tp=t)
        LoRA(dim=args.rank, alpha=2 * args.rank, target_modules=["linear_qkv", "linear_fc1"],
             sequence_parallel_input_strategy=strategy, early_regather=early)(m)
        models[name] = m
    batch = gpt_batch(shape, args.micro_batch)
    stats = {n: {"wait": [], "step": []} for n in models}
    n_waits = 0
    with regather_waits() as clock:
        for step in range(args.warmup + args.steps):
            order = list(models.items())
            for name, m in (order if step % 2 else order[::-1]):  # alternate who goes first
                dist.barrier()
                clock.reset()
                t0 = time.perf_counter()
                gpt_loss(m, batch).backward()
                dt = time.perf_counter() - t0
                if step >= args.warmup:
                    stats[name]["wait"].append(clock.seconds)
                    stats[name]["step"].append(dt)
                if name == "early":
                    n_waits = clock.calls
    # the gathers alone: same count and size, nothing to overlap with
    x = torch.randn(args.seq // t, args.micro_batch, args.hidden)
    alone = []
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n_waits):
            all_gather_seq(x, None)
        alone.append(time.perf_counter() - t0)
    med = statistics.median
    return {"gathers_per_step": n_waits, "gather_alone_s": med(alone),
            **{f"{n}_{k}_s": med(v) for n, s in stats.items() for k, v in s.items()}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    from regather.tools.cpu.dist import run_ranks

    res = run_ranks(_rank, 2, args, timeout=600)
    for r, row in enumerate(res):
        hidden = 1 - row["early_wait_s"] / row["plain_wait_s"] if row["plain_wait_s"] else float("nan")
        row["wait_reduction"] = hidden
        row["plain_step_ratio"] = row["plain_step_s"] / row["gather_step_s"]
        row["early_step_ratio"] = row["early_step_s"] / row["gather_step_s"]
        print(f"rank {r}: " + json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()
