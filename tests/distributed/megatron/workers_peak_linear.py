"""Rank bodies for test_peak.py (tests/distributed/megatron): LoRA's peak over the frozen linear, one adapter on megatron-core's own
linears (local spec) and on the TE model's, TP2 + SP, every strategy with and without recompute.

One case: a frozen base (column-parallel ``o = 8h``, as fc1; row-parallel ``h_in = 8h``, as fc2; on the
local spec also megatron's expert linears at expert-TP 2, which leave their communication to the token
dispatcher: ``[n, h]`` tokens in, ``[n, o/t]`` out, and a partial ``[n, h]`` out of fc2), its LoRA, one forward + backward; the allocator's bytes (:class:`regather.core.allocated.AllocatedBytes`,
every collective settled) alive at the end of the forward (kept) and at the step's highest point (peak),
the smallest of :data:`REPEATS` steps after a first one (which verifies a recompute and may allocate
scratch). The same for the frozen base alone; the test subtracts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from regather.core.allocated import AllocatedBytes

S, B, H, R = 256, 2, 32, 8
WIDE = 8 * H
REPEATS = 3
#: (strategy, lean_transients): the classic gather (Megatron Bridge's), the same made lean, regather, lowrank
VARIANTS = (("gather", None), ("gather", True), ("regather", None), ("lowrank", None))


def frozen_base(spec: str, kind: str, group):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from tests.harness.te_model import TELayerNormColumnParallelLinear, TERowParallelLinear, te_config

    t = dist.get_world_size(group)
    config = te_config(H, t, True)
    init = lambda w: torch.nn.init.normal_(w, std=0.1)
    torch.manual_seed(3)
    if kind.startswith("expert"):  # megatron's expert linears (SequentialMLP's): expert TP, no TP comm of their own
        column = kind == "expert-column"
        cls = ColumnParallelLinear if column else RowParallelLinear
        kw = dict(gather_output=False) if column else dict(input_is_parallel=True)
        base = cls(*((H, WIDE) if column else (WIDE, H)), config=config, init_method=init, bias=False,
                   skip_bias_add=True, is_expert=True, **kw)
        for p in base.parameters():
            p.requires_grad_(False)
        return base
    if spec == "local":
        cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
        kw = dict(gather_output=False) if kind == "column" else dict(input_is_parallel=True)
    else:
        cls = TELayerNormColumnParallelLinear if kind == "column" else TERowParallelLinear
        kw = dict(gather_output=False, tp_comm_buffer_name="fc1") if kind == "column" else dict(
            input_is_parallel=True, tp_comm_buffer_name="fc2")
        kw.update(is_expert=False, tp_group=group)
    sizes = (H, WIDE) if kind == "column" else (WIDE, H)
    base = cls(*sizes, config=config, init_method=init, bias=False, skip_bias_add=True, **kw)
    for p in base.parameters():
        p.requires_grad_(False)
    return base


def input_batch(kind, rank, t):
    g = torch.Generator().manual_seed(1)
    if kind == "expert-column":  # the dispatched tokens, the same on every expert-TP rank
        return torch.randn(S * B, H, generator=g).requires_grad_(), torch.randn(S * B, WIDE, generator=g).chunk(
            t, 1)[rank].contiguous()
    if kind == "expert-row":  # fc1's output columns in, a partial [n, h] out (the dispatcher sums it)
        return (torch.randn(S * B, WIDE, generator=g).chunk(t, 1)[rank].contiguous().requires_grad_(),
                torch.randn(S * B, H, generator=g))
    if kind == "column":
        x = torch.randn(S, B, H, generator=g).chunk(t, 0)[rank]
        dy = torch.randn(S, B, WIDE, generator=g).chunk(t, 2)[rank]
    else:
        x = torch.randn(S, B, WIDE, generator=g).chunk(t, 2)[rank]
        dy = torch.randn(S, B, H, generator=g).chunk(t, 0)[rank]
    return x.contiguous().requires_grad_(), dy.contiguous()


def step_bytes(module, x, dy, through_loss: bool = False) -> tuple[int, int]:
    """``(kept at the end of forward, the step's peak)``, the smallest of REPEATS steps after a warm-up.
    ``through_loss``: backward from ``(y * dy).sum()``, so the output's gradient is a tensor autograd made
    and hands over alone (as a next layer's backward does), not the caller's ``dy``."""
    counts = []
    for step in range(1 + REPEATS):
        x.grad = None
        with AllocatedBytes(settle_each_collective=True) as a:
            y, _ = module(x)
            a.mark("forward")
            if through_loss:
                (y * dy).sum().backward()
            else:
                y.backward(dy)
            del y
        if step:
            counts.append((a.alive_at("forward"), a.peak))
    return min(c[0] for c in counts), min(c[1] for c in counts)


def adapted(spec: str, kind: str, group, name: str, peft) -> torch.nn.Module:
    """A fresh frozen base named ``name`` wrapped by ``peft`` (a LoRA or DoRA config), the same seed every time."""
    holder = torch.nn.Module()
    setattr(holder, name, frozen_base(spec, kind, group))
    torch.manual_seed(5)
    peft(holder)
    return getattr(holder, name)


def in_eight_chunks(fn, t: int, spec: str, w: int) -> list:
    """``run_ranks(fn, t, spec)`` with chunks of ``w / 8`` bytes (``REGATHER_MIN_CHUNK_BYTES``), as at long context."""
    import os

    from regather.tools.cpu.dist import run_ranks

    os.environ["REGATHER_MIN_CHUNK_BYTES"] = str(w // 8)
    try:
        return run_ranks(fn, t, spec, timeout=300)
    finally:
        del os.environ["REGATHER_MIN_CHUNK_BYTES"]


def run(rank, world, spec: str) -> dict:
    """``(kind, strategy, lean, recompute) -> (kept, peak)`` and ``(kind, "frozen") -> (kept, peak)``; the
    decisions."""
    from tests.harness.te_model import te_behaviour

    from regather import LoRA
    from regather.tools.cpu.models import init_model_parallel

    init_model_parallel(world, etp=world)
    group, out = dist.group.WORLD, {"bytes": {}, "decisions": {}}
    kinds = ("column", "row") + (("expert-column", "expert-row") if spec == "local" else ())
    with te_behaviour("te2.8-2.20"):
        for kind in kinds:
            name = "linear_fc1" if kind.endswith("column") else "linear_fc2"
            x, dy = input_batch(kind, rank, world)
            out["bytes"][(kind, "frozen")] = step_bytes(frozen_base(spec, kind, group), x, dy)
            for strategy, lean in VARIANTS:
                for recompute in (False, True):
                    wrapper = adapted(spec, kind, group, name, LoRA(
                        target_modules=[name], dim=R, alpha=2 * R, lora_B_init_method="normal",
                        sequence_parallel_input_strategy=strategy, lean_transients=lean,
                        recompute_adapter_inputs=recompute))
                    key = (kind, strategy, lean, recompute)
                    out["bytes"][key] = step_bytes(wrapper, x, dy)
                    out["decisions"][key] = str(wrapper.adapter.last_decision)
    return out
