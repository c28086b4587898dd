"""torchtitan 0.3.0 models on CPU ranks, built as its trainer builds them: what
``regather bench --torchtitan``, the torchtitan tests and their workers share.

A model is built as the trainer does (its sharding config, an SPMD backend — ``partial_dtensor``
by default; ``spmd_types``, torchtitan's default, and ``full_dtensor`` as asked —, build on meta,
parallelize, materialize, init), then every parameter gets the same values from its name;
:func:`step` runs one forward (bytes and collectives counted) and backward inside the trainer's
``train_context`` (under ``spmd_types`` it sets the current SPMD mesh torchtitan's
redistributions and its loss read). :func:`parallelize_llama` is the trainer's parallelization
(TP, then activation checkpointing, compile, FSDP2) for any backend.

Every model is built with torchtitan's #4267 (after 0.3.0) applied from outside
(:func:`regather.torchtitan.frozen.keep_frozen`): under ``spmd_types`` torchtitan 0.3.0 makes
every frozen parameter trainable again in ``parallelize``, its own LoRA's base included; the
baselines are compared with their base frozen, as regather's converter keeps it
(``build(..., keep_frozen=False)`` shows torchtitan 0.3.0 as it is).

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
from regather.torchtitan.compat import sharding_config as compat_sharding_config

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


#: torchtitan 0.3.0's SPMD backends (``parallelism.spmd_backend``; its default is ``spmd_types``)
BACKENDS = ("partial_dtensor", "spmd_types", "full_dtensor")
_context = {"train": contextlib.nullcontext, "pd": None}
_built: dict = {}


def parallel_dims(tp: int = 2, dp_shard: int = 1, backend: str = "partial_dtensor"):
    """torchtitan's ParallelDims on ``backend`` (set as the trainer sets it from
    ``parallelism.spmd_backend``), its meshes built; :func:`train_context` is its trainer's from
    now on."""
    if backend not in BACKENDS:
        raise ValueError(f"parallel_dims(backend={backend!r}): expected one of {', '.join(BACKENDS)}")
    enable_torchtitan_cpu()
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.distributed.parallel_dims import ParallelDims

    dist_utils.set_spmd_backend(backend)
    key = (tp, dp_shard, backend, dist.get_world_size())
    pd = _built.get(key)
    if pd is None:  # one per process and layout, as in the trainer: torch 2.14's FSDP2 on spmd_types
        # refuses a second set of equal meshes ("Expected param's DTensor mesh to be the same mesh
        # passed to fully_shard"), DTensor reusing the first one's
        pd = _built[key] = ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=1, tp=tp, pp=1, ep=1,
                                        world_size=dist.get_world_size(), spmd_backend=backend)
        pd.build_mesh()
    _context.update(train=dist_utils.get_spmd_context(parallel_dims=pd), pd=pd)
    return pd


def train_context():
    """The trainer's ``train_context`` for the last :func:`parallel_dims` (its forward, loss and
    backward run in it): the current SPMD mesh under ``spmd_types``, nothing otherwise."""
    return _context["train"]()


def trainer_inputs(inp, labels, pos):
    """The batch as the trainer hands it to the model for the last :func:`parallel_dims`'s backend
    (``post_dataloading_process``): DTensors on the dense mesh under ``full_dtensor``, annotated
    plain tensors under ``spmd_types``, as they are otherwise. Returns ``(inp, labels, positions)``."""
    pd = _context["pd"]
    backend = pd.spmd_backend if pd is not None else "partial_dtensor"
    if backend == "full_dtensor":
        from torchtitan.distributed.full_dtensor import parallelize_inputs

        inp, labels, extra = parallelize_inputs(pd, inp, labels, {"positions": pos})
        return inp, labels, extra["positions"]
    if backend == "spmd_types":
        from torchtitan.distributed.spmd_types import annotate_input_spmd_types

        inp, labels, extra = annotate_input_spmd_types(pd, inp, labels, {"positions": pos})
        return inp, labels, extra["positions"]
    return inp, labels, pos


def fsdp_unsupported(backend: str) -> str | None:
    """Why torchtitan's FSDP2 cannot run on ``backend`` with this torch, or None."""
    if backend == "spmd_types" and tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14):
        return (f"torchtitan 0.3.0's spmd_types with FSDP2 needs torch 2.14 (its release checks pinned 2.14.0): "
                f"on torch {torch.__version__} fully_shard raises 'When dp_mesh_dims is provided, all parameters "
                "must be DTensors on the full SPMD mesh', for torchtitan's own LoRA too")
    return None


def parallelize_llama(pd, ac: str = "none", compile_backend: str | None = None):
    """torchtitan's own ``parallelize_llama`` as the trainer calls it for ``pd``'s backend: TP
    (``Module.parallelize``), activation checkpointing (``ac``: ``none``, ``selective``, ``full``:
    its SelectiveAC / FullAC with their default configs), ``apply_compile`` (``compile_backend``:
    ``inductor`` or ``aot_eager``; None: off), then FSDP2 (always: at dp_shard 1 it installs the
    mixed-precision policy, and under ``spmd_types`` it reduces the TP-partial gradients of
    replicated weights). A ``build(parallelize=...)`` callable."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.llama3.parallelize import parallelize_llama as titan_parallelize

    from regather.tools.cpu.torchtitan_cpu import sum_reduction_for_gloo

    ac_config = {"none": None, "selective": SelectiveAC.Config, "full": FullAC.Config}[ac]
    compile_config = CompileConfig(enable=compile_backend is not None, backend=compile_backend or "inductor")

    def parallelize(model):
        parallelism = ParallelismConfig(tensor_parallel_degree=pd.tp, data_parallel_shard_degree=pd.dp_shard,
                                        spmd_backend=pd.spmd_backend)
        model = titan_parallelize(model, parallel_dims=pd, training=TrainingConfig(mixed_precision_param="float32"),
                                  parallelism=parallelism, compile_config=compile_config,
                                  ac_config=ac_config() if ac_config else None, dump_folder="/tmp")
        if pd.dp_shard > 1:
            sum_reduction_for_gloo(model)
        return model

    return parallelize


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


def build(config, pd, parallelize=None, dtype=torch.float32, keep_frozen: bool = True):
    """Build on meta, parallelize (``Module.parallelize``, or ``parallelize(model)``), materialize
    on CPU, init, then every parameter from its name: the trainer's order. ``dtype``: the
    parameters' (the default dtype while building; ``Module.to(torch.float64)`` would turn the
    complex rope cache real). ``keep_frozen``: torchtitan's #4267 applied (the module doc)."""
    from regather.torchtitan.frozen import keep_frozen as keeping_frozen

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = config.build()
        if keep_frozen:
            keeping_frozen(model)
        if parallelize is None:
            model.parallelize(pd)
        else:
            model = parallelize(model)
        model.to_empty(device="cpu")
        # in the trainer's context: without FSDP, spmd_types' weights are plain shards whose init
        # reads the current SPMD mesh (FSDP2 makes them DTensors; the trainer always applies it)
        with torch.no_grad(), train_context():
            model.init_weights(buffer_device=None)
    finally:
        torch.set_default_dtype(default)
    model.train()
    with train_context():
        set_params(model)
    return model


def value_for(name: str, shape) -> torch.Tensor:
    """The same full tensor for a parameter name on every rank and in every model."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    t = torch.randn(shape, generator=g)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * t
    return t if "tok_embeddings" in name else 0.05 * t


def _spmd_shard(model, name: str, local: torch.Tensor):
    """``(full shape, this rank's block of it)`` of a plain parameter that spmd_types shards on
    ``tp`` (its module's declared layout: ``S(d)``), or None."""
    from regather.torchtitan import spmd

    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    group = spmd.tp_group() if spmd.declares(module) else None
    config = compat_sharding_config(module)
    layout = config.state_shardings.get(attr) if config is not None else None
    kind = spmd.tp_type(layout) if layout is not None else None
    if group is None or not hasattr(kind, "dim"):
        return None
    dim, world = kind.dim % local.ndim, group.size()
    shape = list(local.shape)
    shape[dim] *= world
    return tuple(shape), lambda full: full.chunk(world, dim=dim)[dist.get_rank(group)]


@torch.no_grad()
def set_params(model) -> None:
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            full = value_for(name, tuple(p.shape)).to(p.dtype)
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
            continue
        sharded = _spmd_shard(model, name, p)
        if sharded is None:
            p.copy_(value_for(name, tuple(p.shape)).to(p.dtype))
        else:  # spmd_types without FSDP2: this rank's block of the same full tensor
            shape, block = sharded
            p.copy_(block(value_for(name, shape).to(p.dtype)))


def tokens(shape: TinyLlama3 = DEFAULT, seed: int = 1234):
    """Inputs and labels ``[batch, seq]``, the same on every rank."""
    x = torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq + 1), generator=torch.Generator().manual_seed(seed))
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def positions(shape: TinyLlama3 = DEFAULT):
    return torch.arange(shape.seq).expand(shape.micro_batch, shape.seq).contiguous()


def loss_of(pred, labels, vocab: int = VOCAB):
    """torchtitan's summed cross-entropy over the tokens (vocabulary-parallel on TP-sharded
    logits: a DTensor under the DTensor backends, this rank's columns under ``spmd_types``, whose
    loss needs the vocabulary's size), divided by their count."""
    from torchtitan.components.loss import cross_entropy_loss

    return cross_entropy_loss(pred, labels, global_vocab_size=vocab) / labels.numel()


def step(model, count: bool | str = "all", dtype=None, shape: TinyLlama3 = DEFAULT, seed: int = 1234):
    """One forward (bytes and collectives counted: ``count="all"``; the allocator's bytes only:
    ``"allocator"``; nothing: False) and backward. Returns the loss, the saved bytes
    of the model's forward, and the collective calls and bytes of forward and backward, with the
    allocator's bytes alive at the end of the forward (``alive``: what checkpoints and compiled graphs
    keep, which saved-tensor hooks do not see)."""
    cast = dtype or torch.float32
    hook = model.tok_embeddings.register_forward_hook(lambda m, a, out: out.detach().to(cast).requires_grad_(True))
    inp, labels, pos = trainer_inputs(*tokens(shape, seed), positions(shape))
    # compiled blocks take the allocator alone ("allocator") or nothing (False): the collective
    # counter's dispatch mode and patched functions and the saved-tensor hooks would make Dynamo
    # recompile them (and refuse, under a mode)
    full = count == "all"
    alloc = AllocatedBytes(settle_collectives=True, hold_collective_tensors=full)
    fwd, bwd, saved = CollectiveBytes(functional=True), CollectiveBytes(functional=True), SavedBytes.for_model(model)
    with train_context():
        try:
            # the allocator's region outermost: its closing drain all-reduces are not counted by fwd
            with alloc if count else contextlib.nullcontext():
                with fwd if full else contextlib.nullcontext(), saved if full else contextlib.nullcontext():
                    pred = model(inp, pos)
        finally:
            hook.remove()
        loss = loss_of(pred, labels, shape.vocab)
        with bwd if full else contextlib.nullcontext():
            loss.backward()
    loss = loss.detach()
    if isinstance(loss, DTensor):  # full_dtensor's loss: a DTensor on the dense mesh
        loss = loss.full_tensor()
    if not full:
        return loss, None, dict(alive=alloc.alive)
    return loss, saved, dict(fwd=dict(fwd.calls), bwd=dict(bwd.calls), fwd_bytes=dict(fwd.bytes),
                                      bwd_bytes=dict(bwd.bytes), alive=alloc.alive)


def step_peak(model, dtype=None, shape: TinyLlama3 = DEFAULT, seed: int = 1234) -> dict:
    """One forward and backward under the allocator's count with every collective settled
    (:class:`~regather.core.allocated.AllocatedBytes` ``settle_each_collective``: an exact peak under gloo; eager
    blocks only, its dispatch mode is no place for compiled ones): ``kept`` = allocated in the forward and alive at
    its end, ``peak`` = the most alive at once over the step, both over what was alive before it."""
    cast = dtype or torch.float32
    hook = model.tok_embeddings.register_forward_hook(lambda m, a, out: out.detach().to(cast).requires_grad_(True))
    inp, labels, pos = trainer_inputs(*tokens(shape, seed), positions(shape))
    with train_context(), AllocatedBytes(settle_each_collective=True) as alloc:
        try:
            pred = model(inp, pos)
        finally:
            hook.remove()
        loss = loss_of(pred, labels, shape.vocab)
        del pred
        alloc.mark("forward")
        loss.backward()
        del loss
    return {"kept": alloc.alive_at("forward"), "peak": alloc.peak}


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
