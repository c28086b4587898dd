"""LoRA on Transformer Engine's real grouped expert linears against the CPU tests' stand-ins.

The CPU tests run megatron's ``TEGroupedMLP`` on :mod:`regather.tools.cpu.fake_te_grouped`
(TE cannot run on CPU). This script checks, where TE imports (a CUDA machine with
``transformer_engine`` and megatron-core), that regather adapts the real
``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear`` exactly as the stand-ins:
one megatron ``MoELayer`` (router, alltoall dispatcher, ``TEGroupedMLP``) built twice from
megatron's own specs — the TE spec's MoE module, and the local spec's with the stand-ins — with
the same weights, LoRA on ``linear_fc1`` / ``linear_fc2`` (``share_expert_adapters`` True and
False), one rank (TP = EP = 1), then:

- the same adapters: class, ``dim``, parameter names and shapes, state-dict keys;
- the same decisions (the expert reason);
- outputs, input gradient and every LoRA gradient: the TE run's error against an fp64 run of
  the stand-ins is at most ``2 x`` the stand-ins' own error in the same dtype (+ a floor of
  ``1e-6`` relative), the flash-attention way of bounding a kernel by the framework's rounding.

    python benchmarks/gpu/te_grouped.py --out /tmp/te            # CUDA + TE + megatron-core
    .venv/bin/python benchmarks/gpu/te_grouped.py --cpu-dry-run  # CPU: stand-ins on both sides

Without TE (the lent H200 has none, and its wheel does not fit the device carry) it writes
``{"skipped": reason}`` and exits 0. The dry run builds the stand-ins in place of the TE
classes: it runs every line but proves nothing about TE.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

E, H, FFN, S, B, R = 4, 256, 512, 64, 2, 8


def te_reason():
    """None when TE's grouped linears can run here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.extensions.transformer_engine import TEColumnParallelGroupedLinear  # noqa: F401
    except Exception as exc:
        return f"transformer_engine / megatron's TE extensions not importable: {type(exc).__name__}: {exc}"
    return None


def config(dtype):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=FFN, num_moe_experts=E,
        moe_ffn_hidden_size=FFN, moe_router_topk=2, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True,
        moe_router_load_balancing_type="none", add_bias_linear=False, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, gradient_accumulation_fusion=False)


def moe_layer(cfg, real_te: bool):
    """megatron's MoELayer from the TE spec (``real_te``) or the local spec on the stand-ins."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.spec_utils import build_module

    from regather.tools.cpu.fake_te_grouped import grouped_moe_spec

    if real_te:
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=True).layer_specs[0]
    else:
        spec = grouped_moe_spec(get_gpt_decoder_block_spec(cfg, use_transformer_engine=False).layer_specs[0], E)
    mlp = spec.submodules.mlp  # a ModuleSpec (0.16) or a partial of MoELayer (0.19)
    layer = torch.nn.Module()
    layer.mlp = (mlp(config=cfg, layer_number=1) if isinstance(mlp, functools.partial)
                 else build_module(mlp, config=cfg, layer_number=1))
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([layer])
    return holder


def wrap(model, share: bool):
    from regather import LoRA

    torch.manual_seed(7)
    return LoRA(target_modules=["linear_fc1", "linear_fc2"], dim=R, alpha=2 * R, lora_B_init_method="xavier",
                sequence_parallel_input_regather=True, share_expert_adapters=share)(model, training=True)


def run(model, x, g):
    x = x.clone().requires_grad_(True)
    out, _ = model.layers[0].mlp(x)
    (out.float() * g).sum().backward()
    grads = {n: p.grad.detach().double().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach().double().cpu(), x.grad.detach().double().cpu(), grads


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(share: bool, dtype, device, real_te: bool) -> dict:
    from regather.megatron.dense.model import adapters, decisions

    cfg = config(dtype)
    te = wrap(moe_layer(cfg, real_te), share).to(device)
    same_cfg = moe_layer(config(dtype), False)
    ref = wrap(same_cfg, share).to(device)
    ref.load_state_dict(te.state_dict(), strict=True)  # the same weights (and the same keys)
    ref64 = wrap(moe_layer(config(torch.float64), False), share).to(device)
    ref64.load_state_dict({k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
                           for k, v in te.state_dict().items()}, strict=True)
    ta, ra = adapters(te), adapters(ref)
    facts = {
        "adapters_same": {p: type(a).__name__ for p, a in ta.items()} == {p: type(a).__name__ for p, a in ra.items()},
        "dims_same": {p: a.dim for p, a in ta.items()} == {p: a.dim for p, a in ra.items()},
        "params_same": {n: tuple(p.shape) for n, p in te.named_parameters() if p.requires_grad}
        == {n: tuple(p.shape) for n, p in ref.named_parameters() if p.requires_grad},
        "state_keys_same": sorted(te.state_dict()) == sorted(ref.state_dict()),
    }
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(S, B, H, generator=gen).to(device)
    g = torch.randn(S, B, H, generator=gen).to(device)
    got, want, exact = run(te, x.to(dtype), g), run(ref, x.to(dtype), g), run(ref64, x.double(), g.double())
    facts["decisions_same"] = {p: str(d) for p, d in decisions(te).items()} == \
        {p: str(d) for p, d in decisions(ref).items()}
    errors = {}
    for what, i in (("output", 0), ("input_grad", 1)):
        errors[what] = (rel(got[i], exact[i]), rel(want[i], exact[i]))
    for n in exact[2]:
        if ".adapter." in n:
            errors[n] = (rel(got[2][n], exact[2][n]), rel(want[2][n], exact[2][n]))
    bound_ok = {k: te_err <= 2 * sa_err + 1e-6 for k, (te_err, sa_err) in errors.items()}
    return {"share_expert_adapters": share, "dtype": str(dtype), "facts": facts,
            "errors (te, stand-in) vs fp64": errors, "within_bound": all(bound_ok.values()),
            "decisions": {p: str(d) for p, d in decisions(te).items()},
            "ok": all(facts.values()) and all(bound_ok.values())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out/te_grouped"))
    p.add_argument("--cpu-dry-run", action="store_true", help="stand-ins on both sides, on CPU")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reason = None if args.cpu_dry_run else te_reason()
    if reason:
        (out / "te_grouped.json").write_text(json.dumps({"skipped": reason}, indent=1))
        print(f"te_grouped: skipped: {reason}")
        return 0
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if args.cpu_dry_run:
        from regather.tools.cpu.moe_cpu import enable_moe_cpu

        enable_moe_cpu()
    device = "cpu" if args.cpu_dry_run else "cuda"
    if not dist.is_initialized():
        init = Path(tempfile.mkdtemp()) / "rendezvous"
        dist.init_process_group("gloo" if args.cpu_dry_run else "nccl", init_method=f"file://{init}",
                                rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    dtypes = (torch.float32,) if args.cpu_dry_run else (torch.float32, torch.bfloat16)
    results = []
    for share in (True, False):
        for dtype in dtypes:
            try:
                results.append(check(share, dtype, device, real_te=not args.cpu_dry_run))
            except Exception as exc:
                import traceback

                results.append({"share_expert_adapters": share, "dtype": str(dtype), "ok": False, "facts": {},
                                "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
    report = {"real_te": not args.cpu_dry_run, "device": device, "results": results,
              "ok": all(r["ok"] for r in results)}
    (out / "te_grouped.json").write_text(json.dumps(report, indent=1, default=str))
    for r in results:
        print(f"share_expert_adapters={r['share_expert_adapters']} {r['dtype']}: ok={r['ok']} facts={r['facts']}"
              + (f" error={r['error']}" if "error" in r else ""))
    parallel_state.destroy_model_parallel()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
