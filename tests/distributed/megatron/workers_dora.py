"""Rank bodies for test_dora.py: one DoRA linear against a float64 DoRA computed from the full tensors.

A frozen base — megatron-core's own ``ColumnParallelLinear`` / ``RowParallelLinear`` (local spec) or the TE
model's ``TELayerNormColumnParallelLinear`` / ``TERowParallelLinear`` under each TE behaviour — wrapped by
``regather.DoRA`` with one strategy variant (:data:`VARIANTS`), with and without ``recompute_adapter_inputs``;
one forward + backward on seeded data. Every rank returns its output, input gradient and the adapter's
gradients (LoRA-A, LoRA-B, the magnitude), each beside the same slice of the reference computed from the full
tensors (all-gathered from the ranks' shards) in float32 and in float64:
``y = m / ||W0 + (s·B) A||_row ⊙ (u W0ᵀ + s (u Aᵀ) Bᵀ)`` (``u`` = LayerNorm(x) for the fused TE base), the
norm over the whole row, detached.

Layouts: TP2 with SP off and on (``init_model_parallel(2)``), then TP1 (``init_model_parallel(1)``: each rank
alone) in the same spawn.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

S, B, H, R = 16, 2, 16, 4
WIDE = 3 * H  # a column base's output, a row base's input
ALPHA = 2 * R
#: variant -> (strategy, lean_transients, recompute_dora_output)
VARIANTS = {
    "classic": ("gather", None, False),        # Megatron Bridge's expression
    "gather-lean": ("gather", True, False),    # z kept, LoRA added in place
    "gather-rebuild": ("gather", None, True),  # z rebuilt in backward
    "regather": ("regather", None, False),
    "regather-rebuild": ("regather", None, True),
    "lowrank": ("lowrank", None, False),
    "lowrank-rebuild": ("lowrank", None, True),
}
#: a row-parallel base takes the row path whatever the strategy
ROW_VARIANTS = ("classic", "gather-lean", "gather-rebuild")
SPECS = ("local", "te<=2.3", "te2.8-2.20")
LAYOUTS = ("tp2", "tp2sp", "tp1")
GRADS = ("y", "dx", "dA", "dB", "dm")


def _base(spec: str, kind: str, group, sp: bool):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from tests.harness.te_model import TERowParallelLinear, te_config, te_linear

    t = dist.get_world_size(group)
    init = lambda w: nn.init.normal_(w, std=0.3)
    torch.manual_seed(3)
    if spec == "local":
        config = te_config(H, t, sp)
        if kind == "column":
            base = ColumnParallelLinear(H, WIDE, config=config, init_method=init, bias=False, gather_output=False,
                                        skip_bias_add=True)
        else:
            base = RowParallelLinear(WIDE, H, config=config, init_method=init, bias=False, input_is_parallel=True,
                                     skip_bias_add=True)
    elif kind == "column":
        base = te_linear(H, WIDE, tp_group=group, sequence_parallel=sp, seed=3)
    else:
        base = TERowParallelLinear(WIDE, H, config=te_config(H, t, sp), init_method=init, bias=False,
                                   input_is_parallel=True, skip_bias_add=True, is_expert=False,
                                   tp_comm_buffer_name="fc2", tp_group=group)
    for p in base.parameters():
        p.requires_grad_(False)
    return base


def _data(kind: str, rank: int, t: int, sp: bool):
    g = torch.Generator().manual_seed(11)
    hin, hout = (H, WIDE) if kind == "column" else (WIDE, H)
    x, dy = torch.randn(S, B, hin, generator=g, dtype=torch.float64), torch.randn(S, B, hout, generator=g,
                                                                                  dtype=torch.float64)
    if kind == "column":
        x_l, dy_l = (x.chunk(t, 0)[rank] if sp else x), dy.chunk(t, 2)[rank]
    else:
        x_l, dy_l = x.chunk(t, 2)[rank], (dy.chunk(t, 0)[rank] if sp else dy)
    return x, dy, x_l.float().contiguous().requires_grad_(), dy_l.float().contiguous()


def reference(dtype, x, dy, w0, a, b, m, scale, ln=None) -> dict:
    """The DoRA of the full tensors in ``dtype`` (module doc); its output and gradients."""
    x = x.to(dtype).requires_grad_()
    a, b, m = (t.to(dtype).requires_grad_() for t in (a, b, m))
    w0 = w0.to(dtype)
    u = x if ln is None else F.layer_norm(x, (x.shape[-1],), ln[0].to(dtype), ln[1].to(dtype), ln[2])
    n = torch.linalg.norm(w0 + (scale * b.detach()) @ a.detach(), dim=1).detach()
    y = (m / n) * (u @ w0.t() + scale * (u @ a.t()) @ b.t())
    y.backward(dy.to(dtype))
    return {"y": y.detach(), "dx": x.grad, "dA": a.grad, "dB": b.grad, "dm": m.grad}


def _full(adapter, base, group, kind):
    """The full tensors, all-gathered from the shards (Bridge's checkpoint layout)."""
    from regather.core import comm

    column = kind == "column"
    sd = adapter.state_dict()
    w0 = comm.all_gather_dim(base.weight.detach(), group, 0 if column else 1)
    a = comm.all_gather_dim(sd["linear_in.weight"], group, 0 if column else 1)
    b = comm.all_gather_dim(sd["linear_out.weight"], group, 0)
    m = adapter.weight_magnitude.detach()
    m = comm.all_gather_dim(m, group, 0) if column else m
    return w0.double(), a.double(), b.double(), m.double()


def _slices(kind: str, rank: int, t: int, sp: bool, adapter) -> dict:
    """Where this rank's tensors lie in the full ones."""
    column = kind == "column"
    seq = lambda v: v.chunk(t, 0)[rank] if sp else v
    return {
        "y": (lambda v: v.chunk(t, 2)[rank]) if column else seq,
        "dx": seq if column else (lambda v: v.chunk(t, 2)[rank]),
        "dA": (lambda v: v if adapter.replicated_a else v.chunk(t, 0)[rank]) if column else (lambda v: v.chunk(t, 1)[rank]),
        "dB": lambda v: v.chunk(t, 0)[rank],
        "dm": (lambda v: v.chunk(t, 0)[rank]) if column else (lambda v: v),
    }


def one_case(spec: str, kind: str, variant: str, recompute: bool, group, sp: bool, rank: int) -> dict:
    from regather import DoRA

    t = dist.get_world_size(group)
    strategy, lean, rebuild = VARIANTS[variant]
    name = "linear_fc1" if kind == "column" else "linear_fc2"
    holder = nn.Module()
    base = _base(spec, kind, group, sp)
    setattr(holder, name, base)
    torch.manual_seed(5)
    DoRA(target_modules=[name], dim=R, alpha=ALPHA, lora_B_init_method="normal", sequence_parallel_input_strategy=strategy,
         lean_transients=lean, recompute_dora_output=rebuild, recompute_adapter_inputs=recompute)(holder)
    wrapper = getattr(holder, name)
    adapter = wrapper.adapter
    with torch.no_grad():  # a magnitude away from the norms it starts at
        full = adapter.weight_magnitude.shape[0] * (t if kind == "column" else 1)
        u = torch.rand(full, generator=torch.Generator().manual_seed(7))
        adapter.weight_magnitude.mul_((0.5 + u).chunk(t)[rank] if kind == "column" else 0.5 + u)
    x, dy, x_l, dy_l = _data(kind, rank, t, sp)
    y, _ = wrapper(x_l)
    y.backward(dy_l)
    w = adapter.linear_in.weight.grad
    got = {"y": y.detach(), "dx": x_l.grad, "dA": w, "dB": adapter.linear_out.weight.grad,
           "dm": adapter.weight_magnitude.grad}
    w0, a, b, m = _full(adapter, base, group, kind)
    ln = None
    if spec != "local" and kind == "column":
        ln = (base.layer_norm_weight.detach().double(), base.layer_norm_bias.detach().double(), base.eps)
    refs = {dtype: reference(dtype, x, dy, w0, a, b, m, adapter.scale, ln) for dtype in (torch.float32, torch.float64)}
    where = _slices(kind, rank, t, sp, adapter)
    return {"decision": str(adapter.last_decision),
            **{k: (got[k], where[k](refs[torch.float32][k]), where[k](refs[torch.float64][k])) for k in GRADS}}


def run(rank: int, world: int) -> dict:
    """``(layout, spec, kind, variant, recompute) -> {tensor: (got, fp32 reference, fp64 reference)}``."""
    from megatron.core import parallel_state
    from tests.harness.te_model import te_behaviour

    from regather.tools.cpu.models import init_model_parallel

    out = {}
    for layout in LAYOUTS:
        tp, sp = (1, False) if layout == "tp1" else (2, layout == "tp2sp")
        init_model_parallel(tp)
        group = parallel_state.get_tensor_model_parallel_group()
        tp_rank = dist.get_rank(group)
        for spec in SPECS:
            behaviour = "te2.8-2.20" if spec == "local" else spec
            with te_behaviour(behaviour):
                for kind in ("column", "row"):
                    for variant in (VARIANTS if kind == "column" else ROW_VARIANTS):
                        for recompute in ((False, True) if spec != "local" and kind == "column" else (False,)):
                            out[(layout, spec, kind, variant, recompute)] = one_case(spec, kind, variant, recompute,
                                                                                    group, sp, tp_rank)
    return out
