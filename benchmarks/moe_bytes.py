"""What each LoRA adapter of a MoE model keeps for backward, counted (CPU, gloo).

A tiny megatron-core MoE GPT (megatron's MoELayer, router, token dispatcher, SequentialMLP or
TEGroupedMLP experts on the TE grouped-linear stand-ins) with LoRA on qkv/proj/fc1/fc2; one
forward + backward per strategy and variant under the saved-tensor accounting
(``regather.tools.cpu.train.AdapterSavedBytes``), the bytes of LoRA-A inputs summed per adapter
kind, beside the tokens the router sent to this rank's experts in the same forward (an expert
adapter keeps ``routed tokens x input width x element size``). Printed per rank as markdown.

    .venv/bin/python benchmarks/moe_bytes.py                          # TP2+SP x EP2, SequentialMLP
    .venv/bin/python benchmarks/moe_bytes.py --ep 1 --etp 2 --experts grouped

``regather bench --moe`` measures the same bytes (mean over the ranks and per rank, every variant
starting from the same full weights) with the communication, step times and parity of a few
training steps, and the ``-recompute-redispatch`` variants (regather.tools.bench.moe).
"""

from __future__ import annotations

import argparse

VARIANTS = {
    "gather": ("gather", {}),
    "regather": ("regather", {}),
    "lowrank": ("lowrank", {}),
    "gather-rc": ("gather", {"recompute_adapter_inputs": True}),
    "regather-rc": ("regather", {"recompute_adapter_inputs": True}),
    "lowrank-rc": ("lowrank", {"recompute_adapter_inputs": True}),
    # per-expert LoRA-A inputs dispatched again in backward (a shared grouped LoRA-A needs no opt-in)
    "regather-rc-rd": ("regather", {"recompute_adapter_inputs": True, "redispatch_expert_inputs": True}),
}


def kind(path: str) -> str:
    """``linear_qkv``, ``expert linear_fc1``, ``shared expert linear_fc2``, ... (the table's rows)."""
    from regather.tools.cpu.moe_train import adapter_kind

    return adapter_kind(path).replace("shared_experts.", "shared expert ").replace("experts.", "expert ")


def _rank(rank, world, args):
    import torch
    from megatron.core import parallel_state as ps

    from regather import LoRA
    from regather.core.accounting import ADAPTER_INPUT
    from regather.tools.cpu.models import gpt_batch, gpt_loss
    from regather.tools.cpu.moe_models import TinyMoE, build_moe_gpt
    from regather.tools.cpu.moe_train import record_routed
    from regather.tools.cpu.train import AdapterSavedBytes

    shape = TinyMoE(experts=args.experts, dispatcher=args.dispatcher, topk=args.topk, seq_length=args.seq)
    dtype = getattr(torch, args.dtype)
    rows, routed = {}, {}
    for name, (strategy, extra) in VARIANTS.items():
        model = build_moe_gpt(shape, args.tp, args.ep, args.etp, dtype)
        torch.manual_seed(99)
        LoRA(dim=args.rank, alpha=2 * args.rank, sequence_parallel_input_strategy=strategy, **extra)(model)
        tokens = {}
        handles = record_routed(model, tokens)  # per MoE layer, one list per forward (one here)
        batch = gpt_batch(shape, args.micro_batch, seed=0)
        with AdapterSavedBytes(model) as saved:
            gpt_loss(model, batch).backward()
        for h in handles:
            h.remove()
        by_kind: dict = {}
        for path, n in saved.by_adapter.items():
            by_kind[kind(path)] = by_kind.get(kind(path), 0) + n
        rows[name] = {**by_kind, "all adapter inputs": saved.of(ADAPTER_INPUT), "retained total": saved.total}
        routed = {layer: forwards[0] for layer, forwards in tokens.items()}
    coords = (f"tp {ps.get_tensor_model_parallel_rank()}, ep {ps.get_expert_model_parallel_rank()}, "
              f"etp {ps.get_expert_tensor_parallel_rank()}")
    return {"coords": coords, "rows": rows, "routed": routed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--etp", type=int, default=1)
    p.add_argument("--experts", choices=("sequential", "grouped"), default="sequential")
    p.add_argument("--dispatcher", choices=("alltoall", "allgather"), default="alltoall")
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args()
    from regather.tools.cpu.dist import run_ranks

    world = max(args.tp, args.ep * args.etp)
    res = run_ranks(_rank, world, args, timeout=600)
    variants = list(VARIANTS)
    print(f"tiny MoE GPT (2 MoE layers, h=64, 4 experts, moe_ffn=64, top-{args.topk}, {args.experts}, "
          f"{args.dispatcher}), TP{args.tp}+SP x EP{args.ep} x ETP{args.etp}, s={args.seq}, b={args.micro_batch}, "
          f"r={args.rank}, {args.dtype}; bytes per rank, one micro-batch")
    for r in res:
        print(f"\nrank ({r['coords']}); tokens routed to its local experts: "
              + "; ".join(f"{n.split('.')[2]}: {t}" for n, t in r["routed"].items()))
        kinds = list(next(iter(r["rows"].values())))
        print("| adapter kind | " + " | ".join(variants) + " |")
        print("|---|" + "---:|" * len(variants))
        for k in kinds:
            print(f"| {k} | " + " | ".join(f"{r['rows'][v].get(k, 0):,}" for v in variants) + " |")


if __name__ == "__main__":
    main()
