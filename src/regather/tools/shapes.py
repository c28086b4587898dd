"""The model and run shapes every tool (and the tests, through the tiny models) describe a run with.

:class:`ModelShape` is what the model is (sizes, experts), :class:`RunShape` how it runs
(parallel layout, batch, precision, LoRA). ``regather estimate`` (``Model``, ``Run``), ``regather
doctor`` (``Setup``), ``regather bench`` (``BenchSpec``, ``MoEBenchSpec``), ``regather demo`` and the
tiny models they run (``regather.tools.cpu.models.TinyGPT``, ``regather.tools.cpu.moe_models.TinyMoE``)
are these classes, subclassed: each adds only what is its own, and a subclass that wants other
defaults (bench's float32 against estimate's bfloat16) restates the default, not the field.

Names are regather's own; front ends map them to theirs (megatron's ``hidden_size``,
``num_query_groups``, ...). Target names are the front end's: the shapes hold them and never
interpret them. Torch-free, so the tools can describe a run without a framework.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

#: Bytes per element of the activation / gradient dtypes the tools accept.
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
#: the short names of :data:`DTYPE_BYTES` and the torch names they stand for
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
#: How a MoE layer's experts are built: one module per expert (megatron's ``SequentialMLP``) or one
#: grouped GEMM for the local experts (``TEGroupedMLP``, ``moe_grouped_gemm=True``).
EXPERT_KINDS = ("sequential", "grouped")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes. Defaults: the tiny GPT the tests build."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int | None = None  # query groups (GQA); None: one per head
    head_dim: int | None = None  # None: hidden // heads
    ffn: int = 128  # the dense MLP's width (0: no dense MLP, every layer is MoE)
    vocab: int = 256
    # mixture of experts (num_experts 0: a dense model)
    num_experts: int = 0
    moe_ffn: int = 0  # each expert's MLP width
    topk: int = 0  # experts per token
    experts: str = "sequential"  # how the experts are built: one of EXPERT_KINDS
    dispatcher: str = "alltoall"  # megatron's moe_token_dispatcher_type
    shared_expert_ffn: int = 0  # the shared expert's width (0: none)
    moe_layer_freq: int = 1  # every n-th layer is MoE (1: all), the others dense

    def __post_init__(self):
        if self.experts not in EXPERT_KINDS:
            raise ValueError(f"{type(self).__name__}(experts={self.experts!r}): expected one of {EXPERT_KINDS}")

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attn_width(self) -> int:
        """The attention output's width (``heads * head_dim``; wider than ``hidden`` in Qwen3-30B-A3B)."""
        return self.heads * (self.head_dim or self.hidden // self.heads)

    @property
    def layer_pattern(self) -> list[int]:
        """megatron's ``moe_layer_freq`` as a list: 1 where a layer is MoE."""
        return [1 if i % self.moe_layer_freq == 0 else 0 for i in range(self.layers)]


@dataclass(frozen=True)
class RunShape:
    """How a model runs on one GPU's share of the ranks, and the LoRA it trains."""

    tp: int = 2
    sp: bool = True  # sequence parallelism
    seq: int = 32  # tokens per sample
    micro_batch: int = 2
    in_flight: int = 1  # micro-batches whose activations are alive at once (pipeline schedules)
    pp: int = 1
    ep: int = 1  # expert parallel size
    etp: int = 1  # expert tensor parallel size
    dtype: str = "float32"  # activations (a key of DTYPE_BYTES)
    lora_rank: int = 8
    targets: tuple = ()  # the adapted linears, by the front end's names
    # the decoder's input requires grad although the embeddings are frozen (Megatron Bridge's
    # maybe_enable_recompute_inputs_grad, HF's enable_input_require_grads)
    input_requires_grad: bool = False
    # LoRA(share_expert_adapters=True): grouped experts get one LoRA pair for the local experts
    # (Bridge's default); sequential experts always have one per expert (experts_share_lora)
    share_expert_adapters: bool = True
    # LoRA(redispatch_expert_inputs=True): per-expert fc1 inputs dispatched again in backward
    redispatch_expert_inputs: bool = False

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


def experts_share_lora(model: ModelShape, run: RunShape) -> bool:
    """One LoRA pair for a MoE layer's local experts: grouped experts with ``share_expert_adapters``;
    a ``SequentialMLP`` has one per expert."""
    return model.experts == "grouped" and run.share_expert_adapters


def shape_fields(shape: type, obj) -> dict:
    """``obj``'s values of the fields of ``shape`` (:class:`ModelShape` or :class:`RunShape`): what
    one class derived from the shapes hands to another (``TinyGPT(**shape_fields(ModelShape, spec))``)."""
    return {f.name: getattr(obj, f.name) for f in fields(shape)}


def tp_problems(model: ModelShape, tp: int, seq: int, sp: bool = True, ffn_flag: str = "--ffn") -> list[str]:
    """What megatron refuses for ``model`` at tensor parallel size ``tp`` (its heads, query groups and
    MLP split over TP; the sequence too under sequence parallelism), named as the commands' flags name
    them (``ffn_flag``: how the command sets the MLP width); empty: nothing. A command checks this
    before it starts any rank."""
    out = []
    for flag, size in (("--heads", model.heads), ("--kv-heads", model.kv_heads or 0), (ffn_flag, model.ffn),
                       ("--seq", seq if sp else 0)):
        if size % tp:
            out.append(f"{flag} {size} is not divisible by --tp {tp}")
    if model.hidden % model.heads:
        out.append(f"--hidden {model.hidden} is not divisible by --heads {model.heads}")
    return out
