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


def model_runs(rank, world_size, cfgs: dict, twins: dict) -> dict:
    """``train_lora`` of each of ``cfgs`` (one spawn: one TP size), and for each ``twins[name]``, a
    config, the float64 twin of that config's model (:func:`fp64_first_step`)."""
    from regather.tools.cpu.train import train_lora

    out = {name: train_lora(rank, world_size, cfg) for name, cfg in cfgs.items()}
    out.update({name: fp64_first_step(cfg) for name, cfg in twins.items()})
    return out


def fp64_first_step(cfg: RunConfig) -> dict:
    """``cfg``'s model in float64 holding the weights ``train_lora`` starts ``cfg`` from (built in
    fp32, loaded into the fp64 build): step 0's loss and LoRA gradients, the reference of results that
    sum in another order (tests.harness.numerics)."""
    from regather.tools.cpu.train import token_batches

    weights = build_lora_gpt(cfg).state_dict()
    model = build_lora_gpt(dataclasses.replace(cfg, dtype="float64"))
    model.load_state_dict(weights, strict=True)
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    loss = gpt_loss(model, next(token_batches(cfg)))
    loss.backward()
    return {"loss": [loss.item()], "grads": {n: p.grad.detach().clone() for n, p in named.items()}}
