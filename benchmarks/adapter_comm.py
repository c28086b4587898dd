"""Collective bytes of ONE column-parallel LoRA adapter per strategy, counted (CPU, 2 gloo ranks).

The lowrank target of issue 3 is stated at r=16, h=4096; a whole model at
s=8192 does not fit a 24 GiB CPU machine (attention scores), one adapter does.
Per strategy: bytes received per rank in one forward+backward of the adapter
alone (``regather.core.accounting.CollectiveBytes``: all collectives it issues,
megatron's mappings included), and the difference to the gather path.

    python benchmarks/adapter_comm.py --seq 8192 --hidden 4096 --out-features 12288 --rank 16
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def _rank(rank, t, strategies, s, b, h, o, r, dtype):
    from regather import ParallelLinearAdapter
    from regather.core.accounting import CollectiveBytes
    from regather.tools.cpu.megatron_cpu import enable_megatron_cpu

    enable_megatron_cpu()
    dtype = getattr(torch, dtype)
    out = {}
    for name in strategies:
        torch.manual_seed(0)
        adapter = ParallelLinearAdapter(h, o, r, column_parallel=True, base_name="linear_qkv",
                                        tp_group=dist.group.WORLD, sequence_parallel=True,
                                        strategy=name, params_dtype=dtype, lora_B_init_method="normal")
        g = torch.Generator().manual_seed(1)
        x = torch.randn(s // t, b, h, generator=g).to(dtype).requires_grad_()
        dy = torch.randn(s, b, o // t, generator=g).to(dtype)
        with CollectiveBytes() as counted:
            adapter(x).backward(dy)
        out[name] = counted.snapshot()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--out-features", type=int, default=12288)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", help="write the table (markdown) and JSON here (path prefix)")
    a = p.parse_args(argv)
    from regather.core.strategies import Strategy
    from regather.tools.cpu.dist import run_ranks

    strategies = [s.value for s in Strategy]
    res = run_ranks(_rank, a.tp, strategies, a.seq, a.micro_batch, a.hidden, a.out_features, a.rank,
                    a.dtype, timeout=600)[0]
    base = res["gather"]
    lines = [f"One column-parallel adapter, s={a.seq}, b={a.micro_batch}, h={a.hidden}, "
             f"o={a.out_features}, r={a.rank}, TP={a.tp}, {a.dtype}; bytes received per rank, "
             "forward+backward, counted.", "",
             "| strategy | " + " | ".join(KINDS) + " | total | vs gather |", "|---" * (len(KINDS) + 3) + "|"]
    for name, kinds in res.items():
        total = sum(kinds.values())
        delta = {k: kinds.get(k, 0) - base.get(k, 0) for k in KINDS}
        lines.append(f"| {name} | " + " | ".join(f"{kinds.get(k, 0):,}" for k in KINDS)
                     + f" | {total:,} | " + ", ".join(f"{k} {v:+,}" for k, v in delta.items() if v) + " |")
    extra_regather = res["regather"].get("all_gather", 0) - base.get("all_gather", 0)
    if "lowrank" in res:
        added = sum(max(0, res["lowrank"].get(k, 0) - base.get(k, 0)) for k in KINDS)
        lines += ["", f"regather adds {extra_regather:,} bytes; lowrank adds {added:,} bytes in any "
                  f"collective kind ({100 * added / extra_regather:.2f} % of regather's addition); "
                  f"all of lowrank's adapter traffic is {sum(res['lowrank'].values()):,} bytes "
                  f"({100 * sum(res['lowrank'].values()) / extra_regather:.2f} % of regather's addition)."]
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out + ".md", "w") as f:
            f.write(f"`python benchmarks/adapter_comm.py {' '.join(argv or __import__('sys').argv[1:])}`\n\n{text}\n")
        with open(a.out + ".json", "w") as f:
            json.dump({"args": vars(a), "bytes": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
