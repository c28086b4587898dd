"""Transformer Engine's returned *gathered* LayerNorm output: does its gradient reach the input?

Megatron Bridge's default LoRA under sequence parallelism (and regather's gather path on TE until
issue 38) asks ``TELayerNormColumnParallelLinear`` for its
all-gathered LayerNorm output (``return_layernorm_output_gathered=True``) and feeds it to LoRA-A.
Whatever LoRA-A sends back into that output must then be added to the input gradient by TE.
TE v2.17.1's ``_LayerNormLinear.backward`` (``transformer_engine/pytorch/module/layernorm_linear.py``)
adds it only when the output was *not* returned gathered::

    if ctx.return_layernorm_output and not ctx.return_layernorm_output_gathered:
        dgrad = dgrad + grad_outputs[1].view_as(dgrad)

and nowhere else. (v1.5 to v2.3 also added it inside the sequence-parallel branch, before the dgrad
reduce-scatter, so at TP > 1 only; commit ce0b46c4d, "MXFP8 support in Userbuffers (#1711)", first in
v2.4, removed that.) At TP = 1 TE turns sequence parallelism off (``self.sequence_parallel =
(self.tp_size > 1) and sequence_parallel``), so a one-GPU run takes the residual branch only: it
shows what v2.4+ does at any TP, and for TE < 2.4 it says nothing about TP > 1.

The check: ``transformer_engine.pytorch.LayerNormLinear`` (fp32, ``sequence_parallel=True``, a real
one-rank NCCL process group as ``tp_group``, ``parallel_mode="column"``, frozen weights, random
LayerNorm affine), ``loss = out.sum() + (ln_out * g).sum()``; its input gradient against the same
maths in plain torch with the ``ln_out`` term's gradient flowing ("added") or stopped ("dropped"),
both in fp64 (:func:`classify`). Verdicts: ``gradient into the gathered ln_out dropped`` /
``... added`` / ``not available: <why>`` / ``inconclusive: <numbers>`` / ``error: <exception>``.

    python benchmarks/gpu/te_norm_grad.py --out DIR                 # CUDA + transformer_engine
    python benchmarks/gpu/te_norm_grad.py --out DIR --cpu-dry-run   # CPU: a plain-torch stand-in too

Writes ``te_norm_grad.json`` and ``te_norm_grad.md`` (``--out``, default ``$OUT``); device_run.sh folds
them into ``kernels.json`` (key ``te_norm_grad``) and ``kernels.md``, so the device still returns at
most 8 files, and puts ``te_norm_grad: <verdict>`` into ``summary.txt``. Without CUDA or TE the
verdict is ``not available`` and the exit status 0; 1 only when the check itself raised.
The dry run also runs the whole comparison on a plain-torch stand-in that follows TE v2.17.1's rule
(``stand_in`` in the JSON): it exercises every line except TE's and proves nothing about TE.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

# the rounding rule is the tests' (tests/harness, not in the wheel): the repository root on the path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu.te_check import cuda_matmul_tf32, one_rank_group, run_check, te_on_gpu
from tests.harness.numerics import max_rel_err, rounding_bound

S, B, H, OUT = 32, 2, 256, 128  # tokens, micro-batch, hidden, output features (one rank)
EPS = 1e-5
DROPPED, ADDED = "dropped", "added"
VERDICTS = {DROPPED: "gradient into the gathered ln_out dropped", ADDED: "gradient into the gathered ln_out added"}
#: below this relative distance between the two references the check cannot tell them apart
MIN_SEPARATION = 0.1
#: outside the rounding bound, the nearer reference still decides when the error is below this
#: fraction of the separation (the verdict then says "outside the rounding bound")
CLEAR_FRACTION = 0.1
TE_SOURCE_NOTE = (
    "At TP=1 TE turns sequence parallelism off, so only the residual branch "
    "(`return_layernorm_output and not return_layernorm_output_gathered`) is tested. By TE's source, "
    "v2.4+ (commit ce0b46c4d) adds the gathered output's gradient nowhere, at any TP; v1.5-v2.3 added it "
    "before the dgrad reduce-scatter at TP>1 only. A 2-GPU run (TP=2) would confirm the TP>1 case.")


def availability() -> str | None:
    """None when TE's LayerNormLinear can run here, else every reason why not."""
    reasons = []
    if not torch.cuda.is_available():
        reasons.append("no CUDA device")
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # TE fails to import in many ways (missing .so, no CUDA)
        reasons.append(f"transformer_engine.pytorch does not import ({type(exc).__name__}: {exc})")
    return "; ".join(reasons) or None


def inputs(device, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Seeded operands: input ``x [S, B, H]``, LayerNorm affine, weight ``[OUT, H]``, the ln_out weight ``g``."""
    gen = torch.Generator().manual_seed(34)
    t = {"x": torch.randn(S, B, H, generator=gen), "ln_weight": 1 + 0.5 * torch.randn(H, generator=gen),
         "ln_bias": 0.1 * torch.randn(H, generator=gen), "weight": torch.randn(OUT, H, generator=gen) / H ** 0.5,
         "g": torch.randn(S, B, H, generator=gen)}
    return {k: v.to(device=device, dtype=dtype) for k, v in t.items()}


def plain_grads(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The input gradient of ``out.sum() + (ln_out * g).sum()`` in plain torch, in ``t``'s dtype and
    device, with the ``ln_out`` term's gradient added (as the maths says) and dropped (detached)."""
    grads = {}
    for name in (ADDED, DROPPED):
        x = t["x"].detach().clone().requires_grad_(True)
        ln = F.layer_norm(x, (H,), t["ln_weight"], t["ln_bias"], EPS)
        out = ln @ t["weight"].t()
        side = ln if name == ADDED else ln.detach()
        (out.sum() + (side * t["g"]).sum()).backward()
        grads[name] = x.grad.detach()
    return grads


def classify(got: torch.Tensor, exact: dict[str, torch.Tensor], same: dict[str, torch.Tensor],
             dtype: torch.dtype = torch.float32) -> dict:
    """Which plain-torch gradient ``got`` (TE's input gradient) is.

    ``exact``: both references (:func:`plain_grads`) in fp64; ``same``: both again in ``dtype`` on the
    device TE ran on (with TE's GEMM precision: TE runs fp32 GEMMs as TF32). The tolerance is
    regather's rounding rule (:func:`tests.harness.numerics.rounding_bound`): ``got``'s error
    against an fp64 reference may be 3x that of plain torch's own ``dtype`` computation + 4 ulps.
    A dropped term changes the gradient by O(1) of its size (``separation``), far beyond it.
    """
    for key in (ADDED, DROPPED):
        if key not in exact or key not in same:
            raise ValueError(f"classify: exact and same need keys {ADDED!r} and {DROPPED!r}, "
                             f"got {sorted(exact)} and {sorted(same)}")
        if not got.shape == exact[key].shape == same[key].shape:
            raise ValueError(f"classify: shapes differ: got {tuple(got.shape)}, exact[{key!r}] "
                             f"{tuple(exact[key].shape)}, same[{key!r}] {tuple(same[key].shape)}")
    got, exact = got.detach().cpu(), {k: v.detach().cpu() for k, v in exact.items()}
    separation = max_rel_err(exact[DROPPED], exact[ADDED])
    errors = {k: max_rel_err(got, exact[k]) for k in (ADDED, DROPPED)}
    bounds = {k: rounding_bound(same[k].detach().cpu(), exact[k], dtype) for k in (ADDED, DROPPED)}
    nearer = min(errors, key=errors.get)
    record = {"errors": errors, "bounds": bounds, "separation": separation, "nearer": nearer,
              "within_rounding_bound": errors[nearer] <= bounds[nearer]}
    if not torch.isfinite(got).all():
        verdict = "inconclusive: TE's input gradient is not finite"
    elif separation < MIN_SEPARATION:
        verdict = f"inconclusive: the two references differ by only {separation:.3g} (relative)"
    elif record["within_rounding_bound"]:
        verdict = VERDICTS[nearer]
    elif errors[nearer] <= CLEAR_FRACTION * separation:
        verdict = (f"{VERDICTS[nearer]} (outside the rounding bound: error {errors[nearer]:.3g} > "
                   f"{bounds[nearer]:.3g}, separation {separation:.3g})")
    else:
        verdict = (f"inconclusive: error {errors[ADDED]:.3g} against the added reference, "
                   f"{errors[DROPPED]:.3g} against the dropped one (separation {separation:.3g})")
    return {"verdict": verdict, **record}


class StandInLayerNormLinear(torch.autograd.Function):
    """Plain-torch stand-in for TE's ``_LayerNormLinear`` (column, one rank, gathered output) for the
    CPU dry run: LayerNorm, all-gather over ``group``, GEMM; backward as TE v2.17.1 (the gathered
    output's gradient dropped) or, with ``adds``, as a TE that adds it to the dgrad."""

    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, weight, group, adds):
        import torch.distributed as dist

        if dist.get_world_size(group) != 1:
            raise ValueError(f"the stand-in runs on one rank, got a group of {dist.get_world_size(group)}")
        ln = F.layer_norm(x, (x.shape[-1],), ln_weight, ln_bias, EPS)
        parts = [torch.empty_like(ln)]
        dist.all_gather(parts, ln.contiguous(), group=group)
        ln_total = torch.cat(parts)
        ctx.save_for_backward(x, ln_weight, ln_bias, weight)
        ctx.adds = adds
        return ln_total @ weight.t(), ln_total

    @staticmethod
    def backward(ctx, d_out, d_ln):
        x, ln_weight, ln_bias, weight = ctx.saved_tensors
        d_norm = d_out @ weight  # TE's dgrad GEMM; at one rank its reduce-scatter is the identity
        if ctx.adds:
            d_norm = d_norm + d_ln
        with torch.enable_grad():
            xd = x.detach().requires_grad_(True)
            (dx,) = torch.autograd.grad(F.layer_norm(xd, (x.shape[-1],), ln_weight, ln_bias, EPS), xd, d_norm)
        return dx, None, None, None, None, None


def te_module(group, t: dict[str, torch.Tensor]):
    """TE's LayerNormLinear as Megatron's TELayerNormColumnParallelLinear builds it, frozen, with ``t``'s weights."""
    import transformer_engine.pytorch as te

    mod = te.LayerNormLinear(H, OUT, eps=EPS, sequence_parallel=True, tp_group=group, bias=False,
                             normalization="LayerNorm", params_dtype=torch.float32, parallel_mode="column",
                             return_layernorm_output=True, return_layernorm_output_gathered=True, device="cuda")
    with torch.no_grad():
        mod.weight.copy_(t["weight"])
        mod.layer_norm_weight.copy_(t["ln_weight"])
        mod.layer_norm_bias.copy_(t["ln_bias"])
    for p in mod.parameters():
        p.requires_grad_(False)
    return mod


def run_case(forward, t: dict[str, torch.Tensor], same_precision_tf32: bool) -> dict:
    """``forward(x) -> (out, ln_out)``; its input gradient classified against plain torch."""
    x = t["x"].detach().clone().requires_grad_(True)
    out, ln_out = forward(x)
    if tuple(ln_out.shape) != (S, B, H):
        raise ValueError(f"ln_out has shape {tuple(ln_out.shape)}, expected the gathered {(S, B, H)} at one rank")
    (out.sum() + (ln_out * t["g"]).sum()).backward()
    exact = plain_grads({k: v.detach().cpu().double() for k, v in t.items()})
    with cuda_matmul_tf32(same_precision_tf32):  # TE's fp32 GEMMs are TF32 (cublaslt_gemm.cu, v2.17.1)
        same = plain_grads(t)
    result = classify(x.grad, exact, same)
    ln_ref = F.layer_norm(t["x"].cpu().double(), (H,), t["ln_weight"].cpu().double(), t["ln_bias"].cpu().double(), EPS)
    result["forward_errors"] = {"ln_out": max_rel_err(ln_out.detach().cpu(), ln_ref),
                                "out": max_rel_err(out.detach().cpu(), ln_ref @ t["weight"].cpu().double().t())}
    result["ln_out_requires_grad"] = bool(ln_out.requires_grad)
    return result


def check(cpu_dry_run: bool, rendezvous: Path) -> dict:
    report = {"check": "TE LayerNormLinear, return_layernorm_output_gathered=True, sequence_parallel=True, "
                       "one-rank tp_group, frozen weight, fp32: input gradient of out.sum() + (ln_out * g).sum()",
              "shape": {"s": S, "b": B, "h": H, "o": OUT}, "torch": torch.__version__, "note": TE_SOURCE_NOTE}
    reason = availability()
    if reason is None:
        group = te_on_gpu(report, rendezvous)
        t = inputs("cuda")
        mod = te_module(group, t)
        report.update(run_case(mod, t, same_precision_tf32=True))
    else:
        report["verdict"] = f"not available: {reason}"
    if cpu_dry_run:
        group = one_rank_group("gloo", rendezvous)
        t = inputs("cpu")
        report["stand_in"] = {
            rule: run_case(lambda x, adds=(rule == ADDED): StandInLayerNormLinear.apply(
                x, t["ln_weight"], t["ln_bias"], t["weight"], group, adds), t, same_precision_tf32=False)
            for rule in (DROPPED, ADDED)}
    return report


def markdown(report: dict) -> str:
    lines = ["## Transformer Engine: gradient into the gathered LayerNorm output (issue 34)", "",
             f"**Verdict: {report['verdict']}**", "", report["check"] + ".", ""]
    if "te_version" in report:
        lines += [f"TE {report['te_version']}, torch {report['torch']}, {report.get('device', '')}.", ""]
    rows = [("TE", report)] if "errors" in report else []
    rows += [(f"stand-in ({rule}, dry run)", r) for rule, r in report.get("stand_in", {}).items()]
    if rows:
        lines += ["| run | err vs added | bound | err vs dropped | bound | separation | verdict |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        lines += [f"| {name} | {r['errors'][ADDED]:.3g} | {r['bounds'][ADDED]:.3g} | {r['errors'][DROPPED]:.3g} | "
                  f"{r['bounds'][DROPPED]:.3g} | {r['separation']:.3g} | {r['verdict']} |" for name, r in rows]
        lines.append("")
    lines += [report["note"], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    report = run_check("te_norm_grad", __doc__.split("\n")[0], "also run the comparison on a plain-torch stand-in",
                       check, markdown, {"check": "TE LayerNormLinear gathered ln_out", "note": TE_SOURCE_NOTE}, argv)
    for rule, r in (report or {}).get("stand_in", {}).items():
        print(f"te_norm_grad: stand-in that {'adds' if rule == ADDED else 'drops'} it (dry run): {r['verdict']}")
    return 1 if report is None else 0


if __name__ == "__main__":
    sys.exit(main())
