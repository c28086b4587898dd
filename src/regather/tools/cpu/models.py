"""Tiny real megatron-core GPT models for tests, the demo and the benchmark."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from operator import attrgetter

import torch

from regather.tools.shapes import ModelShape

#: megatron's names (``TransformerConfig`` / ``GPTModel``) of the shape fields: the tiny models' shapes
#: take them as constructor keywords and answer to them as attributes.
MEGATRON_NAMES = {"num_layers": "layers", "hidden_size": "hidden", "num_attention_heads": "heads",
                  "num_query_groups": "kv_heads", "ffn_hidden_size": "ffn", "vocab_size": "vocab",
                  "seq_length": "seq"}


def accepts_megatron_names(names: dict):
    """Class decorator for a shape dataclass: its constructor also takes the ``names`` keys
    (megatron's spelling of a field) as keywords, and the class answers to them as read-only
    attributes. Keywords only: the fields' order is not megatron's."""

    def decorate(cls):
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, **kwargs):
            fields = {}
            for key, value in kwargs.items():
                name = names.get(key, key)
                if name in fields:
                    raise TypeError(f"{cls.__name__}() got {key!r} and {name!r}: the same field twice")
                fields[name] = value
            init(self, **fields)

        cls.__init__ = __init__
        for alias, name in names.items():
            setattr(cls, alias, property(attrgetter(name), doc=f"megatron's name of ``{name}``"))
        return cls

    return decorate


@accepts_megatron_names(MEGATRON_NAMES)
@dataclass(frozen=True)
class TinyGPT(ModelShape):
    """Shape of a small dense GPT built from megatron-core's local spec: :class:`ModelShape` (the tiny
    test GPT's sizes) and the sequence its batches have (megatron's ``max_sequence_length``).
    Also built with megatron's names: ``TinyGPT(num_layers=2, hidden_size=64, seq_length=32)``."""

    seq: int = 32

    def __post_init__(self):
        super().__post_init__()
        if type(self) is TinyGPT and self.moe:
            raise ValueError(f"TinyGPT(num_experts={self.num_experts}): a MoE GPT is a TinyMoE")


def init_model_parallel(
    tp: int,
    seed: int = 1234,
    pp: int = 1,
    vpp: int | None = None,
    timeout_minutes: float | None = None,
    ep: int = 1,
    etp: int | None = None,
    cp: int = 1,
) -> None:
    """Initialise megatron's parallel state on an existing default group.

    ``tp`` x ``cp`` x ``pp`` model parallelism (data parallel over the remaining ranks; ``cp``:
    megatron's context parallelism, whose attention only the Transformer Engine spec runs),
    ``vpp`` virtual pipeline chunks per stage. ``timeout_minutes`` bounds each
    collective / p2p op of megatron's groups (megatron's default is 30 min; a test
    that can leave one pipeline stage waiting on a failed peer wants less). ``ep`` /
    ``etp``: expert model / expert tensor parallelism (megatron's default ETP is ``tp``);
    with ``ep > 1`` or an ``etp`` the MoE CPU shims (:mod:`regather.tools.cpu.moe_cpu`) are on.
    """
    from megatron.core import parallel_state, tensor_parallel

    from regather.tools.cpu.megatron_cpu import enable_megatron_cpu

    enable_megatron_cpu()
    parallel_state.destroy_model_parallel()
    kwargs = {}
    if pp > 1:
        kwargs.update(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp)
    if timeout_minutes is not None:
        kwargs["distributed_timeout_minutes"] = timeout_minutes
    if cp > 1:
        kwargs["context_parallel_size"] = cp
    if ep > 1 or etp is not None:
        from regather.tools.cpu.moe_cpu import enable_moe_cpu

        enable_moe_cpu()
        kwargs.update(expert_model_parallel_size=ep, expert_tensor_parallel_size=tp if etp is None else etp)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, **kwargs)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def keep_fp64_cross_entropy() -> None:
    """megatron's vocab-parallel cross entropy casts its logits to fp32 (``calculate_logits_max``'s
    ``.float()``), which rounds an fp64 reference model's loss and its logits' gradient to fp32 (the
    fp32 model's loss then equals it bit for bit). Patched once: fp64 logits stay fp64, any other dtype
    is cast to fp32 as before. :func:`build_gpt` and ``build_moe_gpt`` apply it to fp64 models."""
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as CE

    if getattr(CE.calculate_logits_max, "_keeps_fp64", False):
        return

    def calculate_logits_max(vocab_parallel_logits):
        if vocab_parallel_logits.dtype != torch.float64:
            vocab_parallel_logits = vocab_parallel_logits.float()
        return vocab_parallel_logits, torch.max(vocab_parallel_logits, dim=-1)[0]

    calculate_logits_max._keeps_fp64 = True
    CE.calculate_logits_max = staticmethod(calculate_logits_max)


def build_gpt(
    shape: TinyGPT,
    tp: int,
    sequence_parallel: bool = True,
    dtype: torch.dtype = torch.float32,
    seed: int = 1234,
    gradient_accumulation_fusion: bool = False,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    init_parallel: bool = True,
    transformer_layer_spec=None,
    cp: int = 1,
    **config_overrides,
):
    """Build a megatron-core ``GPTModel`` (local spec) on the current ranks.

    Weights are initialised on CPU from the full master weight and split
    (``use_cpu_initialization``), so models with different TP sizes start
    from the same parameters.

    Pipeline parallelism: pass ``pre_process`` / ``post_process`` (first / last
    stage), ``vp_stage`` (virtual pipeline chunk) and, in ``config_overrides``,
    ``pipeline_model_parallel_size`` / ``virtual_pipeline_model_parallel_size``
    as megatron's ``get_model`` does; ``init_parallel=False`` keeps the parallel
    state set up by :func:`init_model_parallel` (several chunks, one state) and
    only reseeds megatron's RNG tracker.

    ``transformer_layer_spec``: another layer spec than megatron's local one (the tests' Transformer
    Engine model builds megatron's TE spec on its CPU stand-ins). ``cp``: context parallelism (the
    parallel state and ``context_parallel_size``; megatron's local attention refuses it).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    if init_parallel:
        init_model_parallel(tp, seed, cp=cp)
    else:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    if dtype == torch.float64:
        keep_fp64_cross_entropy()
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads,
        ffn_hidden_size=shape.ffn,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel and tp > 1,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gradient_accumulation_fusion=gradient_accumulation_fusion,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        **({} if shape.head_dim is None else {"kv_channels": shape.head_dim}),
        **config_overrides,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=transformer_layer_spec or get_gpt_layer_local_spec(),
        vocab_size=shape.vocab,
        max_sequence_length=shape.seq,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        **({} if vp_stage is None else {"vp_stage": vp_stage}),
    )
    if dtype != torch.float32:
        model = model.to(dtype)
    return model


def gpt_batch(shape: TinyGPT, micro_batch: int, seed: int = 0):
    """A deterministic batch (tokens, labels, position ids, attention mask), same on every rank."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, shape.vocab, (micro_batch, shape.seq + 1), generator=g)
    return batch_from_tokens(tokens)


def batch_from_tokens(tokens: torch.Tensor):
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    s = inputs.shape[1]
    position_ids = torch.arange(s).unsqueeze(0).expand_as(inputs)
    mask = torch.tril(torch.ones(s, s, dtype=torch.bool)).logical_not().view(1, 1, s, s)
    return inputs, labels, position_ids, mask


def gpt_loss(model, batch) -> torch.Tensor:
    """Mean next-token loss (megatron's vocab-parallel cross entropy)."""
    inputs, labels, position_ids, mask = batch
    per_token = model(inputs, position_ids, mask, labels=labels)
    return per_token.to(torch.promote_types(per_token.dtype, torch.float32)).mean()  # fp64 stays fp64
