"""Rank bodies for the adapter-level parity tests (run in spawned gloo ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from regather import ParallelLinearAdapter
from regather.core.accounting import ADAPTER_INPUT, CollectiveBytes, SavedBytes
from regather.tools.cpu.megatron_cpu import enable_megatron_cpu


def make_adapter(strategy, *, h, o, r, dtype, column=True, sp=True, base_name="linear_qkv",
                 fuse=False, dropout=0.0, dropout_position="pre", seed=7, **kw):
    torch.manual_seed(seed)
    return ParallelLinearAdapter(
        h, o, r, column_parallel=column, base_name=base_name, tp_group=dist.group.WORLD,
        sequence_parallel=sp, alpha=2 * r, strategy=strategy, params_dtype=dtype,
        lora_B_init_method="normal",  # B must be non-zero or every LoRA-A gradient is zero
        gradient_accumulation_fusion=fuse, dropout=dropout, dropout_position=dropout_position, **kw,
    )


def _inputs(rank, t, s, b, h, o, dtype, column, micro_batches, seed=11):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(micro_batches):
        x_full = torch.randn(s, b, h, generator=g).to(dtype)
        dy_full = torch.randn(s, b, o, generator=g).to(dtype)
        if column:  # input split over the sequence, output over features
            x = x_full.chunk(t, 0)[rank]
            dy = dy_full.chunk(t, 2)[rank]
        else:  # input split over features, output over the sequence
            x = x_full.chunk(t, 2)[rank]
            dy = dy_full.chunk(t, 0)[rank]
        out.append((x.clone(), dy.clone()))  # own storages: bytes are counted per storage
    return out


def _gathered(t: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim)


def fp64_reference(adapter, data, rank, t) -> dict:
    """The column-parallel adapter's function in fp64 on every rank's data (``data``: this rank's
    ``(x, dy)`` per micro-batch, x split over the sequence, dy over the output features), from its
    weights as they are: this rank's output and input-gradient shards per micro-batch, and its
    LoRA-A rows and LoRA-B gradients summed over the micro-batches (the reference of results that
    are not the same GEMMs as the gather path's; tests.harness.numerics)."""
    a = adapter.linear_in.weight.detach()
    a = a if a.shape[0] == adapter.dim else _gathered(a, 0)  # a replicated (lowrank) LoRA-A is full
    a = a.double().requires_grad_()
    b = _gathered(adapter.linear_out.weight.detach(), 0).double().requires_grad_()
    out = {"y": [], "dx": []}
    for x, dy in data:
        x_full = _gathered(x.detach(), 0).double().requires_grad_()
        y = (x_full @ a.t()) @ b.t() * adapter.scale
        y.backward(_gathered(dy, 2).double())
        out["y"].append(y.detach().chunk(t, 2)[rank])
        out["dx"].append(x_full.grad.chunk(t, 0)[rank])
    out.update(dA=a.grad.chunk(t, 0)[rank], dB=b.grad.chunk(t, 0)[rank])
    return out


def run_adapter(rank, t, strategy, *, s=16, b=2, h=32, o=48, r=8, dtype=torch.float32, column=True,
                sp=True, fuse=False, micro_batches=1, dropout=0.0, dropout_position="pre", fp64=False):
    """Forward/backward ``micro_batches`` times; return outputs and every gradient (with ``fp64``, also
    their fp64 reference under ``"fp64"``: :func:`fp64_reference`)."""
    enable_megatron_cpu()
    adapter = make_adapter(strategy, h=h, o=o, r=r, dtype=dtype, column=column, sp=sp, fuse=fuse,
                           dropout=dropout, dropout_position=dropout_position)
    a, bw = adapter.linear_in.weight, adapter.linear_out.weight
    if fuse:
        for w in (a, bw):
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
            w.grad_added_to_main_grad = False
    result = {"out": [], "dx": [], "decision": None}
    torch.manual_seed(100 + rank)  # dropout masks: same per rank for both strategies
    for x, dy in _inputs(rank, t, s, b, h, o, dtype, column, micro_batches):
        x = x.requires_grad_()
        with SavedBytes.for_model(adapter) as saved:
            y = adapter(x)
        y.backward(dy)
        result["out"].append(y.detach())
        result["dx"].append(x.grad)
        result["saved_adapter_input"] = saved.of(ADAPTER_INPUT)
    result["decision"] = adapter.last_decision
    if fp64:
        result["fp64"] = fp64_reference(adapter, _inputs(rank, t, s, b, h, o, dtype, column, micro_batches), rank, t)
    if fuse:
        shape = lambda w: None if w.grad is None else tuple(w.grad.shape)
        result.update(dA=a.main_grad, dB=bw.main_grad, A_grad_shape=shape(a), B_grad_shape=shape(bw),
                      A_shape=tuple(a.shape), B_shape=tuple(bw.shape), A_flag=a.grad_added_to_main_grad)
    else:
        result.update(dA=a.grad, dB=bw.grad)
    return result


def count_collectives(rank, t, strategy, *, s=16, b=2, h=32, o=48, r=8):
    enable_megatron_cpu()
    adapter = make_adapter(strategy, h=h, o=o, r=r, dtype=torch.float32)
    (x, dy), = _inputs(rank, t, s, b, h, o, torch.float32, True, 1)
    x.requires_grad_()
    with CollectiveBytes() as fwd:
        y = adapter(x)
    with CollectiveBytes() as bwd:
        y.backward(dy)
    return {"forward": fwd.snapshot(), "backward": bwd.snapshot()}


def run_checkpointed(rank, t, strategy, *, reentrant, s=16, b=2, h=32, o=48, r=8):
    """The adapter inside torch.utils.checkpoint: both passes must take the same path."""
    import torch.utils.checkpoint

    enable_megatron_cpu()
    adapter = make_adapter(strategy, h=h, o=o, r=r, dtype=torch.float32)
    (x, dy), = _inputs(rank, t, s, b, h, o, torch.float32, True, 1)
    x.requires_grad_()
    y = torch.utils.checkpoint.checkpoint(adapter, x, use_reentrant=reentrant)
    y.backward(dy)
    return {"out": y.detach(), "dx": x.grad, "dA": adapter.linear_in.weight.grad,
            "dB": adapter.linear_out.weight.grad, "reason": adapter.last_decision.reason}
