"""Rank bodies for the model-level tests (a real megatron-core GPTModel on gloo ranks)."""

import dataclasses

import torch

from regather.tools.cpu.models import gpt_batch, gpt_loss
from regather.tools.cpu.train import RunConfig, build_lora_gpt


def odd_sequence_error(rank, world_size, cfg: RunConfig):
    """Feed a sequence that two ranks cannot split; return the error message."""
    model = build_lora_gpt(cfg)
    shape = cfg.shape
    odd = dataclasses.replace(shape, seq=shape.seq - 1)
    try:
        gpt_loss(model, gpt_batch(odd, cfg.micro_batch))
    except ValueError as exc:
        return str(exc)
    return None


def full_layout(grads_per_rank: list[dict], name: str) -> torch.Tensor:
    """Concatenate a LoRA weight's TP shards into the TP=1 layout."""
    row_parallel_a = "linear_in" in name and ("linear_proj" in name or "linear_fc2" in name)
    return torch.cat([g[name] for g in grads_per_rank], dim=1 if row_parallel_a else 0)
