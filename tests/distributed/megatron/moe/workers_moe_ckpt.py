"""Rank bodies for tests/distributed/megatron/moe/test_moe_checkpoint.py: a LoRA-wrapped tiny MoE GPT saved
with megatron's ``dist_checkpointing`` at one TP x EP x ETP and loaded (strict) at another.

Each side loads its own full weights (``full_weights(seed=...)``: the load side starts from other
values than the ones saved, so a key that does not load shows) and returns every parameter as
``GlobalLayout.scatter`` pieces, which the parent reassembles into full tensors per global name.
"""

from __future__ import annotations

import os

import torch

from regather.tools.cpu.moe_models import GlobalLayout, TinyMoE, build_moe_gpt, full_weights

KINDS = {
    # kind -> (TinyMoE experts, share_expert_adapters)
    "sequential": ("sequential", True),
    "grouped_shared": ("grouped", True),
    "grouped_per_expert": ("grouped", False),
}
SAVE_SEED, LOAD_SEED = 0, 1


def shape_of(kind: str) -> TinyMoE:
    # SwiGLU experts: megatron shards a gated fc1 (and its LoRA-B) in gate and up halves
    return TinyMoE(experts=KINDS[kind][0], gated=True)


def build(kind: str, tp: int, ep: int, etp: int, seed: int):
    from regather import LoRA

    model = build_moe_gpt(shape_of(kind), tp, ep, etp)
    model = LoRA(target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], dim=8, alpha=16,
                 sequence_parallel_input_regather=True, share_expert_adapters=KINDS[kind][1])(model, training=True)
    layout = GlobalLayout(model, shape_of(kind))
    layout.load(model, full_weights(layout.global_shapes(), seed=seed))
    return model, layout


def _pieces(model, layout) -> dict:
    return layout.scatter({n: p.detach().clone() for n, p in model.named_parameters()})


def save_side(rank: int, world: int, root: str, tp: int, ep: int, etp: int) -> dict:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from tests.harness.megatron_ckpt import enable_dist_checkpointing_cpu

    enable_dist_checkpointing_cpu()
    out = {}
    for kind in KINDS:
        model, layout = build(kind, tp, ep, etp, SAVE_SEED)
        path = os.path.join(root, kind)
        if rank == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(model.sharded_state_dict(), path)
        out[kind] = _pieces(model, layout)
    return out


def load_side(rank: int, world: int, root: str, tp: int, ep: int, etp: int) -> dict:
    """Strict: ``dist_checkpointing.load`` into the model's own sharded state dict (megatron
    raises on a key missing from the checkpoint), then ``load_state_dict(strict=True)``."""
    from megatron.core import dist_checkpointing
    from tests.harness.megatron_ckpt import enable_dist_checkpointing_cpu

    enable_dist_checkpointing_cpu()
    out = {}
    for kind in KINDS:
        model, layout = build(kind, tp, ep, etp, LOAD_SEED)
        before = _pieces(model, layout)
        loaded = dist_checkpointing.load(model.sharded_state_dict(), os.path.join(root, kind))
        result = model.load_state_dict(loaded, strict=True)
        out[kind] = {"before": before, "after": _pieces(model, layout),
                     "unexpected": list(result.unexpected_keys),
                     "missing": [k for k in result.missing_keys if not k.endswith("_extra_state")]}
        del model
    torch.distributed.barrier()
    return out
