"""One megatron-core transformer layer with LoRA, per strategy: memory and time on one device.

TP=2 is emulated as rank 0 of a *fake* process group (``torch.testing._internal.
distributed.fake_pg``): every collective returns at once without moving data,
so the times below contain no communication at all (they show what each
strategy costs in compute and memory traffic; the bytes it would send are in
``regather estimate``). Memory is real: ``torch.cuda.memory_allocated`` after
forward (retained until backward) and ``max_memory_allocated`` during
forward+backward, both relative to the allocation before the step. Times are
CUDA-event medians, strategies interleaved round by round. Every strategy's ``-recompute`` variant
(``LoRA(recompute_adapter_inputs=True)``: qkv/fc1 under regather and lowrank, fc2 under
every strategy rebuild their input from what its producer keeps) is timed against gather
and against the same strategy without recompute, paired per round.

    python benchmarks/gpu/layer_bench.py --device cuda --out DIR      # Qwen3-8B layer, s=8192
    python benchmarks/gpu/layer_bench.py --dry-run --out DIR          # tiny shapes on CPU (CI-able)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

QWEN3_8B = dict(hidden=4096, ffn=12288, heads=32, kv_heads=8, head_dim=128, seq=8192)
MASK = [None]  # the causal mask, built once
TINY = dict(hidden=64, ffn=128, heads=4, kv_heads=2, head_dim=16, seq=64)


def init_fake_group(tp: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)


def prepare_megatron(device: str, seed: int) -> None:
    from regather.tools.cpu import megatron_cpu

    if device == "cpu":
        megatron_cpu.enable_megatron_cpu()
    else:
        megatron_cpu.patch_torch_norm()  # the local spec's torch LayerNorm refuses SP otherwise
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_layer(args, strategy: str, device: str, dtype: torch.dtype):
    """A Qwen3-style layer (GQA, QK-norm, SwiGLU, RMSNorm) from the local spec, with LoRA."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from regather.tools.cpu.train import RunConfig, lora_for

    torch.manual_seed(args.seed)
    config = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_attention_heads=args.heads,
        num_query_groups=args.kv_heads, kv_channels=args.head_dim, tensor_model_parallel_size=args.tp,
        sequence_parallel=True, use_cpu_initialization=True, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, qk_layernorm=True,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
    )
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    layer = build_module(spec, config=config, layer_number=1).to(device=device, dtype=dtype)
    torch.manual_seed(args.seed + 1)
    cfg = RunConfig(strategy=strategy, tp=args.tp, lora_dim=args.lora_rank, lora_alpha=2 * args.lora_rank,
                    lora_B_init_method="normal", targets=tuple(args.targets.split(",")))
    return lora_for(cfg)(layer, training=True)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _allocated(device) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def causal_mask(s: int, device) -> torch.Tensor:
    """``[1, 1, s, s]``, True above the diagonal (masked), as megatron's GPT batch builds it."""
    return torch.ones(s, s, dtype=torch.bool, device=device).triu(1).view(1, 1, s, s)


def step(layer, x, dy, device) -> dict:
    """One forward+backward; bytes retained after forward and the peak, relative to before."""
    from regather.core.accounting import ADAPTER_INPUT, SavedBytes

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = _allocated(device)
    with SavedBytes.for_model(layer) as saved:
        out, _ = layer(x, attention_mask=MASK[0])
    retained = _allocated(device) - before
    out.backward(dy)
    _sync(device)
    peak = (torch.cuda.max_memory_allocated() if device == "cuda" else 0) - before
    return {"retained_after_forward": retained, "peak": peak, "saved_bytes": saved.total,
            "saved_adapter_input_bytes": saved.of(ADAPTER_INPUT)}


def time_step(layer, x, dy, device) -> float:
    """Seconds of one forward+backward (CUDA events on GPU, perf_counter on CPU)."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out, _ = layer(x, attention_mask=MASK[0])
        out.backward(dy)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    out, _ = layer(x, attention_mask=MASK[0])
    out.backward(dy)
    return time.perf_counter() - t0


def strategies_available() -> list:
    from regather.tools.cpu.train import requestable_strategies

    return requestable_strategies()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, 2 timed rounds")
    for k, v in QWEN3_8B.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--targets", default="linear_qkv,linear_proj,linear_fc1,linear_fc2")
    p.add_argument("--strategies", default=None, help="default: all this build implements")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gpu"))
    args = p.parse_args(argv)
    if args.dry_run:
        args.device = "cpu"
        for k, v in TINY.items():
            setattr(args, k, v)
        args.warmup, args.rounds, args.dtype = 1, min(args.rounds, 2), "float32"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("layer_bench: --device cuda but CUDA is not available (use --dry-run on CPU)")
    device, dtype = args.device, getattr(torch, args.dtype)
    if device == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    from regather.megatron.dense.model import adapters

    init_fake_group(args.tp)
    prepare_megatron(device, args.seed)
    names = args.strategies.split(",") if args.strategies else strategies_available()
    if "gather" not in names:
        names = ["gather"] + names
    s_local = args.seq // args.tp
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(s_local, args.micro_batch, args.hidden, generator=g).to(device=device, dtype=dtype)
    dy = torch.randn(s_local, args.micro_batch, args.hidden, generator=g).to(device=device, dtype=dtype)
    x.requires_grad_(True)  # a middle layer: its input gradient is computed and reduce-scattered

    MASK[0] = causal_mask(args.seq, device)
    layers = {n: build_layer(args, n, device, dtype) for n in names}
    results = {}
    for n, layer in layers.items():  # memory: one measured step each, after a warm-up step
        step(layer, x, dy, device)
        layer.zero_grad(set_to_none=True)
        x.grad = None
        results[n] = step(layer, x, dy, device)
        results[n]["decisions"] = {path: str(a.last_decision) for path, a in adapters(layer).items()}
        layer.zero_grad(set_to_none=True)
        x.grad = None
        print(f"{n:<19} retained {results[n]['retained_after_forward'] / 2**20:10.1f} MiB  "
              f"peak {results[n]['peak'] / 2**20:10.1f} MiB  "
              f"saved adapter-input {results[n]['saved_adapter_input_bytes'] / 2**20:10.3f} MiB", flush=True)
    times = {n: [] for n in names}
    for r in range(args.warmup + args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            dt = time_step(layers[n], x, dy, device)
            layers[n].zero_grad(set_to_none=True)
            x.grad = None
            if r >= args.warmup:
                times[n].append(dt)
    from regather.tools.cpu.train import base_strategy

    base = statistics.median(times["gather"])
    for n in names:
        med = statistics.median(times[n])
        results[n].update(median_seconds=med, ratio_vs_gather=med / base, times=times[n],
                          paired_ratio_vs_gather=_paired(times[n], times["gather"]))
        line = f"{n:<19} median {med * 1e3:9.3f} ms  x gather {med / base:6.3f}"
        b = base_strategy(n)
        if b != n and b in times:  # a variant against the strategy it varies
            results[n].update(base=b, ratio_vs_base=med / statistics.median(times[b]),
                              paired_ratio_vs_base=_paired(times[n], times[b]))
            line += f"  x {b} {results[n]['ratio_vs_base']:6.3f} (paired {results[n]['paired_ratio_vs_base']:6.3f})"
        print(line, flush=True)
    write(args, results)
    return 0


def _paired(times: list, ref: list) -> float:
    """Median of per-round ratios (both ran in the same round, order rotated)."""
    return statistics.median(a / b for a, b in zip(times, ref))


def environment(device: str) -> dict:
    try:
        import megatron.core

        megatron = getattr(megatron.core, "__version__", "unknown")
    except Exception:
        megatron = "not installed"
    return {"device": torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "megatron_core": megatron,
            "python": platform.python_version()}


def write(args, results: dict) -> None:
    os.makedirs(args.out, exist_ok=True)
    env = environment(args.device)
    command = "python benchmarks/gpu/layer_bench.py " + " ".join(sys.argv[1:])
    with open(os.path.join(args.out, "layer_bench.json"), "w") as f:
        json.dump({"args": vars(args), "env": env, "command": command, "results": results}, f, indent=1)
    lines = [
        "# One transformer layer with LoRA, per strategy" + (" (DRY RUN, tiny CPU shapes)" if args.dry_run else ""),
        "",
        f"- command: `{command}`",
        f"- device: {env['device']}; torch {env['torch']} (CUDA {env['cuda']}); megatron-core "
        f"{env['megatron_core']}; Python {env['python']}",
        f"- layer: h={args.hidden}, ffn={args.ffn} (SwiGLU), {args.heads} heads / {args.kv_heads} kv x "
        f"{args.head_dim}, QK-norm, RMSNorm; s={args.seq}, b={args.micro_batch}, {args.dtype}; TP={args.tp} "
        f"emulated as rank 0 of a fake process group (collectives move no data and take no time); "
        f"LoRA r={args.lora_rank} on {args.targets}",
        f"- time: median of {args.rounds} forward+backward after {args.warmup} warm-up rounds, strategies "
        "interleaved",
        "",
        "| strategy | retained after forward MiB | peak fwd+bwd MiB | saved adapter-input MiB | median ms | "
        "x gather (paired) | x same strategy without recompute (paired) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n, r in results.items():
        vs_base = (f"{r['ratio_vs_base']:.3f} ({r['paired_ratio_vs_base']:.3f}) vs {r['base']}"
                   if "base" in r else "-")
        lines.append(f"| {n} | {r['retained_after_forward'] / 2**20:.1f} | {r['peak'] / 2**20:.1f} | "
                     f"{r['saved_adapter_input_bytes'] / 2**20:.1f} | {r['median_seconds'] * 1e3:.3f} | "
                     f"{r['ratio_vs_gather']:.3f} ({r['paired_ratio_vs_gather']:.3f}) | {vs_base} |")
    with open(os.path.join(args.out, "layer_bench.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}/layer_bench.json and layer_bench.md")


if __name__ == "__main__":
    sys.exit(main())
