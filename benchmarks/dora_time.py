"""DoRA's step time and bytes per variant, on one linear (CPU, gloo, 2 ranks, TP2 + SP; docs/design.md §3.9).

One frozen base — megatron-core's ``ColumnParallelLinear`` (``o = 8h``, as fc1) or ``RowParallelLinear``
(``h_in = 8h``, as fc2) — with DoRA, one forward + backward per step, every variant in the same processes,
steps interleaved with the order rotated; the time of a step is the slowest rank's, the ratio the median of
per-step ratios against Megatron Bridge's expression (``classic``: regather's gather path, Bridge's DoRA bit
for bit on a column base) measured in the same run. With ``--bridge`` Megatron Bridge 0.6.2's own DoRA too
(needs it on the path: ``PYTHONPATH=src:.:.venv-compat/bridge:.venv-compat/mcore019``). With ``--bytes`` the
allocator's bytes over the frozen linear (kept after forward, the step's peak; ``W`` = the base's output
``[s, b, o/t]``, a row base's input gradient), as tests/distributed/megatron/test_peak_dora.py counts them.

    PYTHONPATH=src:. .venv/bin/python benchmarks/dora_time.py --kind column
    PYTHONPATH=src:.:.venv-compat/bridge:.venv-compat/mcore019 .venv/bin/python benchmarks/dora_time.py --bridge --bytes
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

#: variant -> (strategy, DoRA fields); "bridge": Megatron Bridge's own DoRA, "lora": regather's LoRA (no DoRA)
VARIANTS = {
    "classic": ("gather", {}),
    "lean": ("regather", {}),
    "rebuild": ("regather", {"recompute_dora_output": True}),
    "lowrank-rebuild": ("lowrank", {"recompute_dora_output": True}),
    "lora": ("regather", None),
}


def _base(kind, h, wide, group):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from tests.harness.te_model import te_config
    from torch import nn

    config = te_config(h, torch.distributed.get_world_size(group), True)
    init = lambda w: nn.init.normal_(w, std=0.05)
    torch.manual_seed(3)
    if kind == "column":
        base = ColumnParallelLinear(h, wide, config=config, init_method=init, bias=False, gather_output=False,
                                    skip_bias_add=True)
    else:
        base = RowParallelLinear(wide, h, config=config, init_method=init, bias=False, input_is_parallel=True,
                                 skip_bias_add=True)
    for p in base.parameters():
        p.requires_grad_(False)
    return base


def _wrapped(variant, kind, args, group):
    from torch import nn

    from regather import DoRA, LoRA

    name = "linear_fc1" if kind == "column" else "linear_fc2"
    holder = nn.Module()
    setattr(holder, name, _base(kind, args.hidden, 8 * args.hidden, group))
    torch.manual_seed(5)
    kw = dict(target_modules=[name], dim=args.rank, alpha=2 * args.rank, lora_B_init_method="normal")
    if variant == "bridge":
        from tests.harness.bridge_env import import_bridge_peft

        import_bridge_peft()
        from megatron.bridge.peft.dora import DoRA as BridgeDoRA

        BridgeDoRA(**kw)(holder, training=True)
    elif variant == "frozen":
        pass
    else:
        strategy, fields = VARIANTS[variant]
        cls = LoRA if fields is None else DoRA
        cls(**kw, sequence_parallel_input_strategy=strategy, **(fields or {}))(holder)
    return getattr(holder, name)


def _data(kind, args, rank, t):
    g = torch.Generator().manual_seed(1)
    s, b, h = args.seq, args.micro_batch, args.hidden
    if kind == "column":
        x, dy = torch.randn(s // t, b, h, generator=g), torch.randn(s, b, 8 * h // t, generator=g)
    else:
        x, dy = torch.randn(s, b, 8 * h // t, generator=g), torch.randn(s // t, b, h, generator=g)
    return x.requires_grad_(), dy


def _step(module, x, dy):
    x.grad = None
    y, _ = module(x)
    (y * dy).sum().backward()  # dy arrives fresh, as from a next op (the magnitude may scale it in place)


def _bytes(module, x, dy):
    from regather.core.allocated import AllocatedBytes

    counts = []
    for step in range(4):
        x.grad = None
        with AllocatedBytes(settle_each_collective=True) as a:
            y, _ = module(x)
            a.mark("forward")
            (y * dy).sum().backward()
            del y
        if step:
            counts.append((a.alive_at("forward"), a.peak))
    return min(c[0] for c in counts), min(c[1] for c in counts)


def _rank(rank, t, args):
    import torch.distributed as dist

    from regather.tools.cpu.models import init_model_parallel

    init_model_parallel(t)
    torch.set_num_threads(args.threads)
    group = dist.group.WORLD
    names = list(VARIANTS) + (["bridge"] if args.bridge else [])
    out = {}
    for kind in args.kind:
        x, dy = _data(kind, args, rank, t)
        modules = {n: _wrapped(n, kind, args, group) for n in names}
        if args.bytes:
            frozen = _bytes(_wrapped("frozen", kind, args, group), x, dy)
            out[f"{kind}:bytes"] = {n: _bytes(m, x, dy) for n, m in modules.items()} | {"frozen": frozen}
        times, cpu = {n: [] for n in names}, {n: [] for n in names}
        for step in range(args.warmup + args.steps):
            k = step % len(names)
            for n in names[k:] + names[:k]:
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                _step(modules[n], x, dy)
                if step >= args.warmup:
                    times[n].append(time.perf_counter() - t0)
                    cpu[n].append(time.process_time() - c0)
        out[f"{kind}:times"], out[f"{kind}:cpu"] = times, cpu
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=("column", "row"), action="append", help="default: both")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads a rank (1: CPU time is the work done)")
    p.add_argument("--bridge", action="store_true", help="Megatron Bridge 0.6.2's own DoRA too")
    p.add_argument("--bytes", action="store_true", help="the allocator's kept and peak bytes over the frozen linear")
    p.add_argument("--chunks", type=int, default=8,
                   help="REGATHER_MIN_CHUNK_BYTES = W / this (8: eight chunks, as at long context; 0: the default "
                        "16 MiB rule, which makes a W under 32 MiB in one piece)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    args.kind = args.kind or ["column", "row"]
    import os

    from regather.tools.cpu.dist import run_ranks

    if args.chunks:  # the ranks inherit it
        os.environ["REGATHER_MIN_CHUNK_BYTES"] = str(args.seq * args.micro_batch * 8 * args.hidden // 2 * 4 // args.chunks)

    ranks = run_ranks(_rank, 2, args, timeout=1800)
    t, e = 2, 4
    report = {"args": vars(args)}
    for kind in args.kind:
        times = {n: [max(r[f"{kind}:times"][n][i] for r in ranks) for i in range(args.steps)]
                 for n in ranks[0][f"{kind}:times"]}
        cpu = {n: [sum(r[f"{kind}:cpu"][n][i] for r in ranks) for i in range(args.steps)]
               for n in ranks[0][f"{kind}:cpu"]}
        ref, cref = times["classic"], cpu["classic"]
        rows = {n: {"median_s": statistics.median(v), "x_classic": statistics.median(a / b for a, b in zip(v, ref)),
                    "cpu_median_s": statistics.median(cpu[n]),
                    "cpu_x_classic": statistics.median(a / b for a, b in zip(cpu[n], cref))} for n, v in times.items()}
        print(f"{kind} (h={args.hidden}, {'o' if kind == 'column' else 'h_in'}={8 * args.hidden}, s={args.seq}, "
              f"TP2 + SP, fp32, {args.threads} thread(s) a rank): median step (slowest rank's wall time; CPU time "
              "of both ranks), paired ratios vs Bridge's expression (classic)")
        for n, row in rows.items():
            print(f"  {n:16s} wall {row['median_s'] * 1e3:8.1f} ms  x{row['x_classic']:.3f}   "
                  f"CPU {row['cpu_median_s'] * 1e3:8.1f} ms  x{row['cpu_x_classic']:.3f}")
        if args.bytes:
            w = args.seq * args.micro_batch * 8 * args.hidden // t * e
            by = ranks[0][f"{kind}:bytes"]
            fk, fp = by["frozen"]
            print(f"  bytes over the frozen linear, rank 0 (W = {w / 2**20:.1f} MiB): kept / peak")
            for n, (k, pk) in by.items():
                if n != "frozen":
                    rows[n]["kept_over_W"], rows[n]["peak_over_W"] = (k - fk) / w, (pk - fp) / w
                    print(f"  {n:16s} +{(k - fk) / w:.3f} W / +{(pk - fp) / w:.3f} W")
        report[kind] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
