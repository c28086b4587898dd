"""The torchtitan 0.3.0 CPU harness the rank bodies share: build a model as the trainer does (its
sharding config, ``partial_dtensor``, build on meta, parallelize, materialize, init), give every
parameter the same values from its name, run one step, read gradients and bytes.

Choices (not shims, regather.testing.torchtitan_cpu has those): llama3 / qwen3 ``debugmodel`` cut
to 2 layers; batch 2, sequence 128, fp32; the embedding's output made to require grad (as if a
previous stage or a trained embedding fed the blocks, so layer 0's norm keeps its input);
per-document positions passed, as torchtitan's dataloaders do; LoRA-B non-zero (every parameter
from its name), so the adapters change the loss.
"""

from __future__ import annotations

import importlib.util
import zlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from regather.core.accounting import CollectiveBytes, SavedBytes
from regather.testing.torchtitan_cpu import enable_torchtitan_cpu

#: what the torchtitan tests import: torchtitan and the two packages it imports that its pins bring
NEEDED = ("torchtitan", "spmd_types", "tyro")


def missing() -> str | None:
    """Why the torchtitan tests cannot run here (a package not installed), or None."""
    absent = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if not absent:
        return None
    return (f"{', '.join(absent)} not installed (make venv installs torchtitan==0.3.0 and spmd_types==0.2.3 "
            "with --no-deps, tyro from requirements-dev.txt)")


TARGETS = ["wqkv", "wo", "w1", "w2", "w3"]
B, S, LAYERS, VOCAB = 2, 128, 2, 2048
KW = dict(rank=8, alpha=16.0, target_modules=TARGETS)


def parallel_dims(tp: int = 2, dp_shard: int = 1):
    """torchtitan's ParallelDims on the partial_dtensor backend (what the trainer sets from
    ``parallelism.spmd_backend``), its meshes built."""
    enable_torchtitan_cpu()
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.distributed.parallel_dims import ParallelDims

    dist_utils.set_spmd_backend("partial_dtensor")
    pd = ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=1, tp=tp, pp=1, ep=1,
                      world_size=dist.get_world_size(), spmd_backend="partial_dtensor")
    pd.build_mesh()
    return pd


def model_config(converter=None, model: str = "llama3", enable_sp: bool = True):
    """The debugmodel's config through the model registry with ``converter``, cut to 2 layers,
    with its sharding config (what ``update_from_config`` does, without importing the trainer)."""
    converters = [converter] if converter is not None else None
    if model == "qwen3":
        from torchtitan.models.qwen3 import model_registry
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        config = model_registry("debugmodel", converters=converters).model
        config.layers = config.layers[:LAYERS]
        set_qwen3_sharding_config(config, enable_sp=enable_sp, enable_ep=False)
        return config
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    config = model_registry("debugmodel", converters=converters).model
    config.layers = config.layers[:LAYERS]
    set_llama3_sharding_config(config, enable_sp=enable_sp)
    return config


def build(config, pd, parallelize=None, dtype=torch.float32):
    """Build on meta, parallelize (``Module.parallelize``, or ``parallelize(model)``), materialize
    on CPU, init, then every parameter from its name: the trainer's order. ``dtype``: the
    parameters' (the default dtype while building; ``Module.to(torch.float64)`` would turn the
    complex rope cache real)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = config.build()
        if parallelize is None:
            model.parallelize(pd)
        else:
            model = parallelize(model)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=None)
    finally:
        torch.set_default_dtype(default)
    model.train()
    set_params(model)
    return model


def value_for(name: str, shape) -> torch.Tensor:
    """The same full tensor for a parameter name on every rank and in every model."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    t = torch.randn(shape, generator=g)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * t
    return t if "tok_embeddings" in name else 0.05 * t


@torch.no_grad()
def set_params(model) -> None:
    for name, p in model.named_parameters():
        full = value_for(name, tuple(p.shape)).to(p.dtype)
        if isinstance(p, DTensor):
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
        else:
            p.copy_(full)


def tokens():
    x = torch.randint(0, VOCAB, (B, S + 1), generator=torch.Generator().manual_seed(1234))
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def positions():
    return torch.arange(S).expand(B, S).contiguous()


def loss_of(pred, labels):
    from torchtitan.components.loss import cross_entropy_loss

    return cross_entropy_loss(pred, labels) / labels.numel()


def step(model, count: bool = True, dtype=None):
    """One forward (bytes and collectives counted) and backward. Returns the loss, the saved bytes
    of the model's forward, and the collective bytes of forward and backward."""
    cast = dtype or torch.float32
    hook = model.tok_embeddings.register_forward_hook(lambda m, a, out: out.detach().to(cast).requires_grad_(True))
    inp, labels = tokens()
    with CollectiveBytes(functional=True) as fwd, SavedBytes.for_model(model) as saved:
        pred = model(inp, positions())
    hook.remove()
    loss = loss_of(pred, labels)
    with CollectiveBytes(functional=True) as bwd:
        loss.backward()
    return loss.detach(), saved, dict(fwd=dict(fwd.calls), bwd=dict(bwd.calls), bwd_bytes=dict(bwd.bytes))


def lora_grads(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            g = p.grad
            out[name] = None if g is None else (g.full_tensor() if isinstance(g, DTensor) else g).clone()
    return out
