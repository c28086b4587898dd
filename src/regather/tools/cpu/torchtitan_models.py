"""torchtitan 0.3.0 models on CPU ranks, built as its trainer builds them: what
``regather bench --torchtitan``, the torchtitan tests and their workers share.

A model is built as the trainer does (its sharding config, the ``partial_dtensor`` SPMD backend,
build on meta, parallelize, materialize, init), then every parameter gets the same values from its
name; :func:`step` runs one forward (bytes and collectives counted) and backward.

Choices (not shims, :mod:`regather.tools.cpu.torchtitan_cpu` has those): a llama3 model of the
:class:`TinyLlama3` shape — by default torchtitan's ``debugmodel`` (dim 256, 16 heads, ffn 768,
vocab 2048) cut to 2 layers, batch 2, sequence 128, fp32 — built from torchtitan's own layer
builder, so another shape is the same model at other sizes; qwen3's ``debugmodel`` cut to the
shape's layers; the embedding's output made to require grad (as if a previous stage or a trained
embedding fed the blocks, so layer 0's norm keeps its input); per-document positions passed, as
torchtitan's dataloaders do; LoRA-B non-zero (every parameter from its name), so the adapters
change the loss.

torchtitan's own ``LoRALinear`` labels nothing it saves; :func:`label_adapter_inputs` attributes
what its LoRA-A saves to ``adapter_input:<kind>`` as regather's adapters label theirs, so the two
compare per adapter kind.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from regather.core import accounting
from regather.core.accounting import CollectiveBytes, SavedBytes
from regather.core.allocated import AllocatedBytes
from regather.tools.cpu.torchtitan_cpu import enable_torchtitan_cpu
from regather.tools.shapes import ModelShape
from regather.torchtitan import reasons

#: what a torchtitan run imports: torchtitan and the two packages it imports that its pins bring
NEEDED = ("torchtitan", "spmd_types", "tyro")
#: every linear torchtitan's llama3 / qwen3 blocks have, by torchtitan's names
TARGETS = list(reasons.TARGETS)


def missing() -> str | None:
    """Why torchtitan cannot run here (a package not installed), or None."""
    absent = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if not absent:
        return None
    return (f"{', '.join(absent)} not installed (make venv installs torchtitan==0.3.0 and spmd_types==0.2.3 "
            "with --no-deps, tyro from requirements-dev.txt)")


@dataclass(frozen=True)
class TinyLlama3(ModelShape):
    """A llama3 model's sizes (``hidden`` is torchtitan's ``dim``, ``kv_heads`` its ``n_kv_heads``) and
    its batches. Defaults: torchtitan's ``debugmodel`` cut to 2 layers, batch 2, sequence 128."""

    hidden: int = 256
    layers: int = 2
    heads: int = 16
    ffn: int = 768
    vocab: int = 2048
    seq: int = 128
    micro_batch: int = 2


DEFAULT = TinyLlama3()
B, S, LAYERS, VOCAB = DEFAULT.micro_batch, DEFAULT.seq, DEFAULT.layers, DEFAULT.vocab
KW = dict(rank=8, alpha=16.0, target_modules=TARGETS)


def converter(fields: dict | None, **kw):
    """torchtitan's ``LoRAConverter.Config`` (``fields`` None) or regather's with ``fields``; ``kw``
    over :data:`KW` (rank 8, alpha 16, every linear)."""
    enable_torchtitan_cpu()
    if fields is None:
        from torchtitan.components.lora import LoRAConverter

        return LoRAConverter.Config(**dict(KW, **kw))
    from regather.torchtitan import LoRAConverter

    return LoRAConverter.Config(**dict(KW, **kw), **fields)


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


def llama3_config(shape: TinyLlama3 = DEFAULT):
    """A llama3 ``Model.Config`` of ``shape``, built as torchtitan builds its flavors (its
    ``debugmodel`` at the default shape): fused wqkv, complex rope, flex attention."""
    enable_torchtitan_cpu()
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model

    # torchtitan's own per-layer builder (private there; every flavor of llama3_configs uses it)
    from torchtitan.models.llama3 import _build_llama3_layers as build_layers

    dim, heads = shape.hidden, shape.heads
    layers = build_layers(fuse_qkv=True, n_layers=shape.layers, dim=dim, n_heads=heads, n_kv_heads=shape.kv_heads,
                          hidden_dim=shape.ffn, attn_backend="flex",
                          rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=131072, theta=500000,
                                                  scaling="llama"))
    s = dim**-0.5
    return Llama3Model.Config(
        dim=dim, vocab_size=shape.vocab, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=shape.vocab, embedding_dim=dim,
                                        param_init={"weight": functools.partial(torch.nn.init.normal_, std=1.0)}),
        norm=RMSNorm.Config(normalized_shape=dim, param_init={"weight": torch.nn.init.ones_}),
        lm_head=Linear.Config(in_features=dim, out_features=shape.vocab, param_init={
            "weight": functools.partial(torch.nn.init.trunc_normal_, std=s, a=-3 * s, b=3 * s),
            "bias": torch.nn.init.zeros_}))


def model_config(converter=None, model: str = "llama3", enable_sp: bool = True, shape: TinyLlama3 = DEFAULT):
    """The model's config with ``converter`` applied (as ``model_registry(..., converters=[...])``
    applies it) and its sharding config (what ``update_from_config`` does, without importing the
    trainer). ``model``: ``"llama3"`` of ``shape``, or ``"qwen3"``'s debugmodel cut to
    ``shape.layers``."""
    enable_torchtitan_cpu()
    converters = [converter] if converter is not None else None
    if model == "qwen3":
        from torchtitan.models.qwen3 import model_registry
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        config = model_registry("debugmodel", converters=converters).model
        config.layers = config.layers[:shape.layers]
        set_qwen3_sharding_config(config, enable_sp=enable_sp, enable_ep=False)
        return config
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config
    from torchtitan.models.utils import validate_converter_order

    config = llama3_config(shape)
    if converters:
        validate_converter_order(converters)
        for c in converters:
            config = c.build().convert(config)
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


def tokens(shape: TinyLlama3 = DEFAULT, seed: int = 1234):
    """Inputs and labels ``[batch, seq]``, the same on every rank."""
    x = torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq + 1), generator=torch.Generator().manual_seed(seed))
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def positions(shape: TinyLlama3 = DEFAULT):
    return torch.arange(shape.seq).expand(shape.micro_batch, shape.seq).contiguous()


def loss_of(pred, labels):
    from torchtitan.components.loss import cross_entropy_loss

    return cross_entropy_loss(pred, labels) / labels.numel()


def step(model, count: bool | str = "all", dtype=None, shape: TinyLlama3 = DEFAULT, seed: int = 1234):
    """One forward (bytes and collectives counted: ``count="all"``; the allocator's bytes only:
    ``"allocator"``; nothing: False) and backward. Returns the loss, the saved bytes
    of the model's forward, and the collective calls and bytes of forward and backward, with the
    allocator's bytes alive at the end of the forward (``alive``: what checkpoints and compiled graphs
    keep, which saved-tensor hooks do not see)."""
    cast = dtype or torch.float32
    hook = model.tok_embeddings.register_forward_hook(lambda m, a, out: out.detach().to(cast).requires_grad_(True))
    inp, labels = tokens(shape, seed)
    # compiled blocks take the allocator alone ("allocator") or nothing (False): the collective
    # counter's dispatch mode and patched functions and the saved-tensor hooks would make Dynamo
    # recompile them (and refuse, under a mode)
    full = count == "all"
    alloc = AllocatedBytes(settle_collectives=True, hold_collective_tensors=full)
    fwd, bwd, saved = CollectiveBytes(functional=True), CollectiveBytes(functional=True), SavedBytes.for_model(model)
    try:
        # the allocator's region outermost: its closing drain all-reduces are not counted by fwd
        with alloc if count else contextlib.nullcontext():
            with fwd if full else contextlib.nullcontext(), saved if full else contextlib.nullcontext():
                pred = model(inp, positions(shape))
    finally:
        hook.remove()
    loss = loss_of(pred, labels)
    with bwd if full else contextlib.nullcontext():
        loss.backward()
    if not full:
        return loss.detach(), None, dict(alive=alloc.alive)
    return loss.detach(), saved, dict(fwd=dict(fwd.calls), bwd=dict(bwd.calls), fwd_bytes=dict(fwd.bytes),
                                      bwd_bytes=dict(bwd.bytes), alive=alloc.alive)


def lora_grads(model) -> dict:
    """Every trainable parameter's gradient as a full tensor (a collective for sharded or partial
    gradients: every rank calls it)."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            g = p.grad
            out[name] = None if g is None else (g.full_tensor() if isinstance(g, DTensor) else g).clone()
    return out


def label_adapter_inputs(model) -> int:
    """Make torchtitan's own LoRA linears attribute what their LoRA-A saves to
    ``adapter_input:<kind>`` (``kind``: the linear's name, ``wqkv``, ``w1``, ...), the label regather's
    adapters give theirs (:func:`regather.core.accounting.label`). Numerics unchanged. Returns how
    many it labelled (regather's adapters label themselves and are left alone)."""
    from regather.torchtitan import adapters

    ours = set(map(id, adapters(model).values()))
    done = 0
    for path, module in model.named_modules():
        lora_a = getattr(module, "lora_a", None)
        if lora_a is None or not hasattr(module, "lora_b") or id(module) in ours:
            continue
        lora_a.forward = _labelled(lora_a.forward, f"{accounting.ADAPTER_INPUT}:{path.rsplit('.', 1)[-1]}")
        done += 1
    return done


def _labelled(forward, name: str):
    @functools.wraps(forward)
    def labelled(*args, **kwargs):
        with accounting.label(name):
            return forward(*args, **kwargs)

    return labelled
