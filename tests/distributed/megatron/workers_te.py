"""Rank bodies for the Transformer Engine tests: LoRA on the TE model's ``TELayerNormColumnParallelLinear``
(tests.harness.te_model) on gloo ranks, against float64 computed from the full tensors.

One case = a TE behaviour (TE <= 2.3 / TE 2.8 - 2.20), a strategy, a layout (TP2 + SP, TP2 with SP off,
TP1: each rank on a one-rank group of its own) and recompute off / on. Per case and rank: the output,
the input gradient, LoRA-A / LoRA-B gradients, in fp32, and what the same maths gives in fp32 and in
fp64 from the full tensors (``ref32`` / ``ref64``: every rank computes them from the full weights,
all-gathered); the decision; the allocator's bytes alive after the (second) forward, beside the
frozen base's (:class:`regather.core.allocated.AllocatedBytes` with the collectives settled, the smallest of :data:`REPEATS`).
:func:`run_gpt`: the same bytes on the tiny megatron GPT built on the TE spec.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from regather.core.accounting import CollectiveBytes
from regather.core.allocated import AllocatedBytes
from regather.core.comm import all_gather_dim

S, B, H, OUT, R = 16, 2, 32, 48, 4
STRATEGIES = ("gather", "regather", "lowrank")
LAYOUTS = ("tp2_sp", "tp2", "tp1")
SEED = 5
REPEATS = 4  # bytes: the smallest of this many forwards after the first (regather.core.allocated: the collectives settled)


def groups(rank: int) -> dict:
    """The TP group of each layout (every rank calls ``new_group`` for every one-rank group)."""
    ones = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return {"tp2_sp": dist.group.WORLD, "tp2": dist.group.WORLD, "tp1": ones[rank]}


def inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(11)
    return torch.randn(S, B, H, generator=g).to(dtype), torch.randn(S, B, OUT, generator=g).to(dtype)


def frozen_base(group, sp: bool, behaviour, **kw):
    from tests.harness.te_model import te_linear

    base = te_linear(H, OUT, tp_group=group, sequence_parallel=sp, behaviour=behaviour, **kw)
    for p in base.parameters():
        p.requires_grad_(False)
    return base


def local(full: torch.Tensor, rank: int, t: int, sp: bool) -> torch.Tensor:
    """This rank's sequence shard of ``[s, ...]`` under SP, else the whole."""
    return full.chunk(t, 0)[rank] if sp else full


def reference(base, a_full, b_full, scale, x_full, dy_full, dtype):
    """``y = LN(x) W^T + scale (LN(x) A^T) B^T`` and the gradients of ``(y * dy).sum()`` in ``dtype``,
    from the full tensors (``W`` the full weight: the same seeded master weight on every TP size)."""
    w_full = all_gather_dim(base.weight.detach(), base.tp_group, 0).to(dtype)
    gamma = base.layer_norm_weight.detach().to(dtype)
    beta = base.layer_norm_bias.detach().to(dtype)
    x = x_full.detach().to(dtype).clone().requires_grad_()
    a = a_full.detach().to(dtype).requires_grad_()
    b = b_full.detach().to(dtype).requires_grad_()
    ln = F.layer_norm(x, (H,), gamma, beta, base.eps)
    y = ln @ w_full.t() + scale * ((ln @ a.t()) @ b.t())
    (y * dy_full.to(dtype)).sum().backward()
    return {"out": y.detach(), "dx": x.grad, "dA": a.grad, "dB": b.grad}


def run_case(rank, behaviour, strategy, layout, recompute, group) -> dict:
    from tests.harness.te_model import Holder

    from regather import LoRA

    t, sp = dist.get_world_size(group), layout == "tp2_sp"
    x64, dy64 = inputs()
    base = frozen_base(group, sp, behaviour)
    model = Holder(base)
    torch.manual_seed(SEED)
    LoRA(target_modules=["linear_qkv"], dim=R, alpha=2 * R, lora_B_init_method="normal",
         sequence_parallel_input_strategy=strategy, recompute_adapter_inputs=recompute)(model)
    ad = model.linear_qkv.adapter
    x = local(x64, rank, t, sp).float().clone().requires_grad_()
    dy = dy64.float().chunk(t, 2)[base.tp_rank].clone()
    alive = []
    for step in range(1 + REPEATS):  # the first forward may allocate persistent scratch: not measured
        x.grad = None
        for p in ad.parameters():
            p.grad = None
        with CollectiveBytes() as comm, AllocatedBytes(settle_collectives=True, hold_collective_tensors=True) as alloc:
            y, _ = model(x)
        y.backward(dy)
        alive += [alloc.alive] if step else []
    a, b = ad.linear_in.weight, ad.linear_out.weight
    a_full = a.detach() if ad.replicated_a else all_gather_dim(a.detach(), group, 0)
    b_full = all_gather_dim(b.detach(), group, 0)
    refs = {name: reference(base, a_full, b_full, ad.scale, x64, dy64, dtype)
            for name, dtype in (("ref64", torch.float64), ("ref32", torch.float32))}
    rows = ad.lora_a_rows() if ad.replicated_a else slice(None)
    return {
        "decision": str(ad.last_decision), "alive": min(alive), "comm": comm.snapshot(),
        "flags_after": (base.return_layernorm_output, base.return_layernorm_output_gathered),
        "got": {"out": y.detach(), "dx": x.grad.clone(), "dA": a.grad.clone(), "dB": b.grad.clone()},
        "a_rows": (rows.start, rows.stop) if ad.replicated_a else None,
        "refs": {k: {n: shard(n, v, base.tp_rank, t, sp, ad) for n, v in r.items()} for k, r in refs.items()},
    }


def shard(name, full, rank, t, sp, adapter):
    """The part of a full reference tensor this rank holds."""
    if name == "out":  # [s, b, o/t]: the whole sequence, this rank's output columns
        return full.chunk(t, 2)[rank]
    if name == "dx":
        return local(full, rank, t, sp)
    if name == "dA":  # LoRA-A: rows r/t (replicated under lowrank: all of it, summed over TP)
        return full if adapter.replicated_a else full.chunk(t, 0)[rank]
    return full.chunk(t, 0)[rank]  # LoRA-B [o/t, r]


def frozen_alive(rank, behaviour, layout, group) -> int:
    """Allocator bytes alive after the frozen base's (second) forward, for the same input."""
    t, sp = dist.get_world_size(group), layout == "tp2_sp"
    x64, _ = inputs()
    base = frozen_base(group, sp, behaviour)
    x = local(x64, rank, t, sp).float().clone().requires_grad_()
    alive = []
    for step in range(1 + REPEATS):
        with AllocatedBytes(settle_collectives=True, hold_collective_tensors=True) as alloc:
            y, _ = base(x)
        y.sum().backward()
        alive += [alloc.alive] if step else []
    return min(alive)


def gathered_control(rank, behaviour, group) -> dict:
    """What the TE model does with a *gathered* returned ln_out under SP (Bridge's default LoRA
    asks for it): each rank's loss ``out.sum() + (ln_out_gathered * g).sum()``; the input gradient
    against fp64 with the ln_out term's gradient added (the sum of the ranks' losses counts that
    term ``t`` times). TE <= 2.3 adds it, TE >= 2.4 drops it."""
    t = dist.get_world_size(group)
    x64, _ = inputs()
    g = torch.Generator().manual_seed(12)
    side = torch.randn(S, B, H, generator=g, dtype=torch.float64)
    base = frozen_base(group, True, behaviour)
    base.return_layernorm_output = base.return_layernorm_output_gathered = True
    x = local(x64, rank, t, True).float().clone().requires_grad_()
    (out, ln_gathered), _ = base(x)
    (out.sum() + (ln_gathered * side.float()).sum()).backward()
    w_full = all_gather_dim(base.weight.detach(), group, 0).double()
    xr = x64.clone().requires_grad_()
    ln = F.layer_norm(xr, (H,), base.layer_norm_weight.double(), base.layer_norm_bias.double(), base.eps)
    ((ln @ w_full.t()).sum() + t * (ln * side).sum()).backward()
    return {"shape": tuple(ln_gathered.shape), "dx": x.grad, "dx_ref": local(xr.grad, rank, t, True)}


def run_matrix(rank, world, items) -> dict:
    """The cases of ``items`` (``(behaviour, layout)`` pairs: every strategy, recompute off / on),
    their frozen bases' bytes, and with TP2 + SP the behaviour's gathered control."""
    from tests.harness.te_model import BEHAVIOURS, te_behaviour

    from regather.tools.cpu.megatron_cpu import enable_megatron_cpu

    enable_megatron_cpu()
    by_layout = groups(rank)
    out = {"cases": {}, "frozen": {}, "control": {}}
    for name, layout in items:
        behaviour, group = BEHAVIOURS[name], by_layout[layout]
        with te_behaviour(behaviour):
            out["frozen"][(name, layout)] = frozen_alive(rank, behaviour, layout, group)
            for strategy in STRATEGIES:
                for recompute in (False, True):
                    out["cases"][(name, strategy, layout, recompute)] = run_case(
                        rank, behaviour, strategy, layout, recompute, group)
            if layout == "tp2_sp":
                out["control"][name] = gathered_control(rank, behaviour, group)
    return out


def run_bias_forms(rank, world, strategy) -> dict:
    """megatron's ``(out, bias, ln_out)`` form (skip_bias_add with a bias) unpacked, TP2 + SP."""
    from tests.harness.te_model import Holder

    from regather import LoRA
    from regather.tools.cpu.megatron_cpu import enable_megatron_cpu

    enable_megatron_cpu()
    group = dist.group.WORLD
    x64, _ = inputs()
    outs = {}
    for with_lora in (True, False):
        base = frozen_base(group, True, None, bias=True, skip_bias_add=True)
        model = Holder(base)
        if with_lora:
            LoRA(target_modules=["linear_qkv"], dim=R, sequence_parallel_input_strategy=strategy)(model)
        x = local(x64, rank, 2, True).float()
        outs[with_lora] = model(x)
    return {"bias": outs[True][1], "bias_ref": outs[False][1], "out": outs[True][0], "out_ref": outs[False][0]}


# -- the tiny GPT on megatron's TE spec (the model's linears): LoRA over the frozen model -----------------

GPT_LAYOUTS = {"tp1": (1, False), "tp2": (2, False), "tp2_sp": (2, True)}
GPT_TARGETS = ["linear_qkv", "linear_fc1", "linear_fc2"]
GPT_SEQ, GPT_MICRO_BATCH, GPT_DIM = 16, 2, 8


def gpt_shape():
    from regather.tools.cpu.models import TinyGPT

    return TinyGPT(hidden=32, ffn=64, vocab=128, seq=GPT_SEQ, layers=2)


def gpt_step_bytes(model) -> tuple[int, torch.Tensor]:
    """Allocator bytes alive after the forward (the smallest of :data:`REPEATS` steps after a
    first one) and the loss; the decoder input requires grad (Bridge's
    ``maybe_enable_recompute_inputs_grad``: layer 0's fused norm then keeps its input)."""
    from regather.tools.cpu.models import gpt_batch, gpt_loss

    hook = model.embedding.register_forward_hook(lambda m, a, out: out.detach().requires_grad_(True))
    batch = gpt_batch(gpt_shape(), GPT_MICRO_BATCH, seed=3)
    alive = []
    try:
        for step in range(1 + REPEATS):
            model.zero_grad(set_to_none=True)
            with AllocatedBytes(settle_collectives=True, hold_collective_tensors=True) as region:
                loss = gpt_loss(model, batch)
            loss.backward()
            alive += [region.alive] if step else []
    finally:
        hook.remove()
    return min(alive), loss.detach()


def run_gpt(rank, world, items) -> dict:
    """The tiny GPT on the TE spec, frozen, and with LoRA (qkv, fc1, fc2; recompute on) per strategy, for
    each ``(behaviour, layout)`` of ``items``: bytes alive after the forward, losses, decisions."""
    from tests.harness.te_model import BEHAVIOURS, build_te_gpt, te_behaviour

    from regather import LoRA, decisions
    from regather.tools.cpu.megatron_cpu import enable_megatron_cpu

    enable_megatron_cpu()
    out = {}
    for name, layout in items:
        tp, sp = GPT_LAYOUTS[layout]
        with te_behaviour(BEHAVIOURS[name]):
            for variant in ("frozen",) + STRATEGIES:
                model = build_te_gpt(gpt_shape(), tp, sp)
                for p in model.parameters():
                    p.requires_grad_(False)
                if variant != "frozen":
                    LoRA(target_modules=GPT_TARGETS, dim=GPT_DIM, alpha=2 * GPT_DIM, lora_B_init_method="normal",
                         sequence_parallel_input_strategy=variant, recompute_adapter_inputs=True)(model)
                alive, loss = gpt_step_bytes(model)
                out[(name, layout, variant)] = {
                    "alive": alive, "loss": loss,
                    "decisions": {} if variant == "frozen" else {p: str(d) for p, d in decisions(model).items()}}
    return out
