"""The long-context table of docs/benchmarks.md: what LoRA keeps, its peak over the frozen model and the per-GPU total,
per strategy, for Qwen3-8B and Llama 3 70B at 32k and 128k tokens (``regather estimate``'s model; every figure
**modelled**, none measured on a GPU).

    .venv/bin/python benchmarks/long_context.py          # prints the markdown docs/benchmarks.md carries

The layouts are chosen by a rule, not by hand:

- **TP**: Megatron Bridge 0.6.2's long-context recipes' for the model — Qwen3-8B TP4
  (``qwen3_8b_sft_8gpu_h100_bf16_32k_config``: TP4 x CP2, SP), Llama 3 70B TP8 (its PEFT recipe
  ``llama3_70b_peft_8gpu_h100_bf16_config`` and its long-context pretraining recipes, 16k: TP8 x CP2, 64k:
  TP8 x CP8); SP on, as in those recipes; no pipeline parallelism (the frozen weights fit: 17.6 GB for Llama 3 70B
  at TP8), no activation recompute (those recipes set none);
- **CP**: for each length, the fewest context-parallel ranks (a power of two) at which the gather path — Bridge
  0.6.2's LoRA today — fits an 80 GiB H100 with at least 10 % of it free (the total is a floor: CUDA and NCCL
  workspaces, fragmentation and the frozen model's own backward transients are not in it); and, where fewer
  ranks suffice for some regather strategy, that layout too.

LoRA on ``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2`` (rank 16: ``regather estimate``'s default;
Bridge's Llama 3 70B recipe's targets), bf16, micro-batch 1, the TE spec (what Bridge runs), frozen embeddings. The
second table sets full activation recompute (uniform, one layer per checkpoint: Bridge's Qwen3-32B recipes' setting)
at the smaller layouts: nothing inside a checkpointed layer is kept, LoRA's inputs included; the peak is one
recomputed layer's LoRA bytes and the largest transient. ``tests/unit/tools/test_long_context_table.py`` checks that
docs/benchmarks.md carries exactly what this prints.
"""

from __future__ import annotations

GPU_GIB = 80
FREE = 0.10  # the share of the GPU a layout must leave free to count as fitting
STRATEGIES = ("gather", "regather", "regather-recompute", "lowrank-recompute")
#: (preset, TP, where the TP comes from)
MODELS = (("qwen3-8b", 4, "Bridge 0.6.2 qwen3_8b_sft_8gpu_h100_bf16_32k_config: TP4 x CP2"),
          ("llama3-70b", 8, "Bridge 0.6.2 llama3_70b_peft_8gpu_h100_bf16_config, llama3_70b 16k / 64k: TP8"))
LENGTHS = (32768, 131072)
CP_CHOICES = (1, 2, 4, 8, 16, 32)
FULL = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def _run(tp: int, cp: int, seq: int, **kw):
    from regather.tools.estimate import Run

    return Run(tp=tp, cp=cp, seq=seq, micro_batch=1, dtype="bfloat16", lora_rank=16, spec="te",
               attention_keeps_output=True, **kw)


def _fits(total: int) -> bool:
    return total <= (1 - FREE) * GPU_GIB * 2**30


def _rows(key: str, tp: int, cp: int, seq: int, strategies=STRATEGIES, **kw) -> dict:
    from regather.tools.estimate import PRESETS, estimate

    return estimate(PRESETS[key], _run(tp, cp, seq, **kw), strategies, gpu_gib=GPU_GIB)


def layouts() -> list[tuple[str, int, int, int, str]]:
    """``(preset, seq, tp, cp, why)`` by the module doc's rule."""
    out = []
    for key, tp, _ in MODELS:
        for seq in LENGTHS:
            gather = next(cp for cp in CP_CHOICES if _fits(_rows(key, tp, cp, seq, ("gather",))["gather"]["gpu"]["total"]))
            fewest = next(cp for cp in CP_CHOICES if any(_fits(r["gpu"]["total"]) for r in _rows(key, tp, cp, seq).values()))
            out.append((key, seq, tp, gather, "the gather path fits"))
            if fewest < gather:
                out.append((key, seq, tp, fewest, "fewest GPUs: the gather path does not fit"))
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f}"


def _name(strategy: str) -> str:
    return "gather (Bridge 0.6.2, classic)" if strategy == "gather" else strategy


def table() -> str:
    """Both tables as docs/benchmarks.md carries them."""
    from regather.tools.estimate import PRESETS

    head = ["model", "tokens", "TP x CP (GPUs)", "layout", "strategy", "LoRA kept GiB", "LoRA peak over frozen GiB",
            "per-GPU total GiB", f"free of {GPU_GIB} GiB"]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---|---|---|---:|---:|---:|---:|"]
    small = {}
    for key, seq, tp, cp, why in layouts():
        rows = _rows(key, tp, cp, seq)
        for i, (name, r) in enumerate(rows.items()):
            total = r["gpu"]["total"]
            lead = [PRESETS[key].name, f"{seq // 1024}k", f"{tp} x {cp} ({tp * cp})", why] if i == 0 else [""] * 4
            lines.append("| " + " | ".join(lead + [
                _name(name), _gib(r["lora_kept_bytes"]), _gib(r["peak"]["peak_over_frozen"]), _gib(total),
                _gib(GPU_GIB * 2**30 - total)]) + " |")
        small[(key, seq)] = (tp, cp)
    lines += ["", "With full activation recompute (uniform, one layer per checkpoint), at the layouts with the fewest "
              "GPUs:", ""]
    head = ["model", "tokens", "TP x CP (GPUs)", "strategy", "LoRA kept GiB", "LoRA in a checkpointed layer GiB",
            "LoRA peak over frozen GiB", "per-GPU total GiB"]
    lines += ["| " + " | ".join(head) + " |", "|---|---:|---|---|---:|---:|---:|---:|"]
    for (key, seq), (tp, cp) in small.items():
        rows = _rows(key, tp, cp, seq, ("gather", "regather"), **FULL)
        for i, (name, r) in enumerate(rows.items()):
            lead = [PRESETS[key].name, f"{seq // 1024}k", f"{tp} x {cp} ({tp * cp})"] if i == 0 else [""] * 3
            lines.append("| " + " | ".join(lead + [
                _name(name), _gib(r["lora_kept_bytes"]), _gib(r["peak"]["checkpoint_alive"]),
                _gib(r["peak"]["peak_over_frozen"]), _gib(r["gpu"]["total"])]) + " |")
    return "\n".join(lines)


def main() -> int:
    print(table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
