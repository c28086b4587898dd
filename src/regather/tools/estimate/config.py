"""What ``regather estimate`` is asked about: the model, the run, the strategies, and the layout checks.

:class:`Model` and :class:`Run` are :mod:`regather.tools.shapes`' shapes with what only estimate
needs (a preset's name; the LoRA-A gradient dtype, the pipeline stage).

Model presets (config.json of each model on the Hugging Face Hub, as
recalled; check before relying on them): **Qwen3-8B** h=4096, ffn=12288, 36
layers, 32 heads, 8 kv heads, head_dim 128, vocab 151936; **Qwen3-30B-A3B**
h=2048, 48 layers all MoE, 32 heads, 4 kv heads, head_dim 128 (so attention is
4096 wide, wider than h), 128 experts, moe ffn 768, top-8, no dense MLP and no
shared expert; **GPT-OSS-120B** h=2880, 36 layers all MoE, 64 heads, 8 kv heads,
head_dim 64, 128 experts, moe ffn 2880, top-4, vocab 201088; **Llama3-70B**
h=8192, ffn=28672, 80 layers, 64 heads, 8 kv heads, head_dim 128, vocab 128256; **Llama3-8B**
h=4096, ffn=14336, 32 layers, 32 heads, 8 kv heads, head_dim 128, vocab 128256 (torchtitan's
``llama3`` ``8B`` flavor: dim 4096, ``compute_ffn_hidden_dim(4096, multiple_of=1024,
ffn_dim_multiplier=1.3)`` = 14336; ``--front-end torchtitan``'s default).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from regather.megatron.reasons import ALL_TARGETS, ELIGIBLE_BASES, REPLAYED_DISPATCHERS
from regather.tools.shapes import DTYPE_BYTES, ModelShape, RunShape, experts_share_lora

STRATEGIES = ("gather", "regather", "lowrank")
RECOMPUTE = "-recompute"  # suffix: LoRA(recompute_adapter_inputs=True) on that strategy
VARIANTS = tuple(name + RECOMPUTE for name in STRATEGIES)
ALL_STRATEGIES = STRATEGIES + VARIANTS
EXPERT_LORA = ("shared", "per-expert")  # one LoRA pair for a layer's local experts, or one per expert
SPECS = ("te", "local")  # --spec: Transformer Engine (Bridge's recipes) or megatron's local spec


@dataclass(frozen=True)
class Model(ModelShape):
    """A model estimate knows by name. Experts are grouped (``TEGroupedMLP``, as Bridge builds
    these models) unless said otherwise, so that ``share_expert_adapters`` decides the sharing."""

    experts: str = "grouped"
    name: str = field(default="model", kw_only=True)
    # the dense MLP is gated (SwiGLU: fc1 makes gate and up, 2 x ffn wide), as in every preset (fc1's output,
    # what DoRA keeps for it, the memory model's weights and activations depend on it)
    gated_mlp: bool = field(default=False, kw_only=True)
    # per-head RMSNorm on q and k before the rotary embedding (Qwen3's qk_layernorm)
    qk_norm: bool = field(default=False, kw_only=True)


PRESETS = {
    "qwen3-8b": Model(name="Qwen3-8B", hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128,
                      ffn=12288, vocab=151936, gated_mlp=True, qk_norm=True),
    "qwen3-30b-a3b": Model(name="Qwen3-30B-A3B", hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, ffn=0,
                           num_experts=128, moe_ffn=768, topk=8, vocab=151936, gated_mlp=True, qk_norm=True),
    "gpt-oss-120b": Model(name="GPT-OSS-120B", hidden=2880, layers=36, heads=64, kv_heads=8, head_dim=64, ffn=0,
                          num_experts=128, moe_ffn=2880, topk=4, vocab=201088, gated_mlp=True),
    "llama3-70b": Model(name="Llama3-70B", hidden=8192, layers=80, heads=64, kv_heads=8, head_dim=128,
                        ffn=28672, vocab=128256, gated_mlp=True),
    "llama3-8b": Model(name="Llama3-8B", hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
                       ffn=14336, vocab=128256, gated_mlp=True),
}


@dataclass(frozen=True)
class Recipe:
    """A Megatron Bridge PEFT recipe's LoRA: what ``--recipe`` estimates (Bridge 0.6.2's
    ``megatron.bridge.recipes``). A bare ``--recipe`` takes only the LoRA from it; the layout (TP, EP,
    SP, sequence length) stays the command line's, as the reference's runs changed the recipes'
    layouts. ``--recipe LAYOUT`` takes a layout too (:data:`LAYOUTS`)."""

    function: str  # the recipe's function in megatron.bridge.recipes
    targets: tuple
    dim: int
    alpha: int
    layout: str  # the recipe's own parallel layout and sequence length, for the report


BRIDGE_VERSION = "0.6.2"
# Bridge 0.6.2: the Qwen3 recipes set dim=8, alpha=16, target_modules=["linear_qkv", "linear_proj"];
# the GPT-OSS ones keep the default LoRA() (all four targets, dim 32, alpha 32); Llama3-70B's sets dim 16, alpha 32
RECIPES = {
    "qwen3-8b": Recipe("qwen3_8b_peft_1gpu_h100_bf16_config", ("linear_qkv", "linear_proj"), 8, 16,
                       "TP1, SP off, seq 2048"),
    "qwen3-30b-a3b": Recipe("qwen3_30b_a3b_peft_4gpu_h100_bf16_config", ("linear_qkv", "linear_proj"), 8, 16,
                            "TP4/EP4, SP on, seq 2048"),
    "gpt-oss-120b": Recipe("gpt_oss_120b_peft_8gpu_h100_bf16_config", ALL_TARGETS, 32, 32,
                           "TP1/EP8, SP off, seq 2048"),
    "llama3-70b": Recipe("llama3_70b_peft_8gpu_h100_bf16_config", ALL_TARGETS, 16, 32, "TP8, SP off, seq 4096"),
}



@dataclass(frozen=True)
class Layout:
    """A shipped run layout ``--recipe NAME`` selects whole: the preset, its parallel layout and
    sequence length, and the preset's recipe LoRA (:data:`RECIPES`). Read from Bridge 0.6.2's recipe
    functions (``tensor_model_parallel_size``, ``sequence_parallel``, ``seq_length``,
    ``micro_batch_size``; PP 1, EP 1 in both), except the reference's layout, which is its table's."""

    preset: str
    tp: int
    sp: bool
    seq: int
    micro_batch: int
    source: str  # where the layout comes from, for the report and --help


LAYOUTS = {
    "qwen3-8b-peft-1gpu": Layout("qwen3-8b", 1, False, 2048, 1,
                                 "Bridge 0.6.2 qwen3_8b_peft_1gpu_h100_bf16_config"),
    "llama3-70b-peft-8gpu": Layout("llama3-70b", 8, False, 4096, 1,
                                   "Bridge 0.6.2 llama3_70b_peft_8gpu_h100_bf16_config"),
    "qwen3-8b-reference": Layout("qwen3-8b", 2, True, 8192, 1,
                                 "the reference's Qwen3-8B run (TP2, seq 8192, re-gather: SP on)"),
}

# --attention: whether the attention kernel keeps its output for its own backward
ATTENTION = ("unfused", "fused")
ATTENTION_OUTPUT = ("the attention output, which the fused attention keeps for its backward (flash-attention, "
                    "Transformer Engine's fused attention)")


@dataclass(frozen=True)
class Run(RunShape):
    """One GPU's run as estimate models it (a dense model needs ep = etp = 1)."""

    seq: int = 8192
    micro_batch: int = 1
    dtype: str = "bfloat16"
    lora_rank: int = 16
    targets: tuple = ALL_TARGETS
    grad_dtype: str | None = None  # dtype of LoRA-A's gradient (default: dtype; fp32 with main_grad)
    # this GPU holds the first layer: with frozen embeddings, its qkv input needs no
    # gradient, so no path reduce-scatters that adapter's dX (lowrank removes one RS less),
    # and with recompute_adapter_inputs its input_layernorm keeps nothing to recompute from.
    # A later stage's input requires grad; input_requires_grad: layer 0 behaves like every other layer
    first_stage: bool = True
    # the attention kernel keeps its output for its backward (flash-attention / TE's fused attention
    # save ``out``): linear_proj's LoRA-A input is that tensor, 0 new bytes on every strategy.
    # False: megatron's unfused local attention, which saves probs and V, not the output
    attention_keeps_output: bool = False
    # what the base linears keep (regather.tools.estimate.spec): "local" (megatron's local spec, what
    # bench runs; the library default) or "te" (Transformer Engine, what Bridge's recipes run)
    spec: str = "local"
    # the Transformer Engine version on the TE spec, which decides whether recompute releases TE's
    # ln_out (regather.tools.estimate.spec.te_release_reason); None: the newest version read
    te_version: str | None = None
    # context parallel size: each CP rank's linears see seq/cp tokens per sample (docs/design.md 3.8)
    cp: int = 1
    # megatron's activation recompute (TransformerConfig.recompute_*): "full" checkpoints whole layers
    # (recompute_method "uniform": groups of recompute_num_layers; "block": the first recompute_num_layers),
    # "selective" the recompute_modules ("mlp" the dense MLP, "moe" the MoE layer, "core_attn" the attention)
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: tuple = ()
    # the PEFT: "lora" or "dora" (regather.DoRA); DoRA's pre-magnitude output "keep" (as Bridge) or
    # "rebuild" (recompute_dora_output=True) (regather.tools.estimate.dora)
    peft: str = "lora"
    dora_output: str = "keep"

    @property
    def e(self) -> int:
        return self.dtype_bytes

    @property
    def local_seq(self) -> int:
        """Tokens per sample this GPU's linears see: the sequence over context parallelism."""
        return self.seq // self.cp

    @property
    def eg(self) -> int:
        return DTYPE_BYTES[self.grad_dtype or self.dtype]


def expert_lora(model: Model, run: Run) -> str:
    """``"shared"``: one LoRA pair for a MoE layer's local experts; ``"per-expert"``: one per expert."""
    return "shared" if experts_share_lora(model, run) else "per-expert"


def lean_output(strategy: str) -> bool:
    """Whether ``strategy``'s adapters run the lean output path (``LoRA(lean_transients=None)``, the default: every
    strategy but the gather path, which stays Megatron Bridge's bit for bit; docs/design.md 3.7)."""
    return split_strategy(strategy)[0] != "gather"


def split_strategy(name: str) -> tuple[str, bool]:
    """``"regather-recompute"`` -> ``("regather", True)``; ``"lowrank"`` -> ``("lowrank", False)``."""
    base, recompute = (name[: -len(RECOMPUTE)], True) if name.endswith(RECOMPUTE) else (name, False)
    if base not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; expected one of {ALL_STRATEGIES}")
    return base, recompute


def ring(nbytes: int, t: int) -> int:
    """Bytes received per rank for a gather output / scatter input of ``nbytes`` (regather.core.accounting)."""
    return nbytes * (t - 1) // t


def check_run(model: Model, run: Run) -> None:
    """A ``ValueError`` naming the values for a layout that cannot exist (sizes that do not divide)
    or that estimate does not model."""
    if run.spec not in SPECS:
        raise ValueError(f"spec {run.spec!r}: expected one of {SPECS}")
    small = [f"{what} {n}" for what, n in (("TP", run.tp), ("PP", run.pp), ("sequence", run.seq),
                                            ("micro-batch", run.micro_batch), ("micro-batches in flight", run.in_flight))
             if n < 1]
    if small:
        raise ValueError(f"{', '.join(small)}: must be at least 1")
    if run.cp < 1:
        raise ValueError(f"CP {run.cp}: must be at least 1")
    if run.cp > 1 and run.seq % (2 * run.cp):
        raise ValueError(f"sequence {run.seq} does not split into 2 x CP = {2 * run.cp} chunks (megatron gives each "
                         "CP rank two chunks, for causal load balance)")
    if run.cp > 1 and run.spec == "local" and not run.attention_keeps_output:
        raise ValueError(f"CP {run.cp} on the local spec's unfused attention: megatron's local DotProductAttention "
                         "asserts context_parallel_size == 1 (CP runs through Transformer Engine's attention: --spec te)")
    if run.sp and run.local_seq % run.tp:
        raise ValueError(f"sequence {run.local_seq}" + (f" (per CP rank: {run.seq}/{run.cp})" if run.cp > 1 else "")
                         + f" is not divisible by TP {run.tp}")
    check_recompute(run)
    # megatron splits the heads, the query groups and the dense MLP over TP and refuses what does not divide
    split = [f"{what} {n}" for what, n in (("heads", model.heads), ("query groups", model.kv_heads or model.heads),
                                            ("ffn", model.ffn)) if n % run.tp]
    if split:
        raise ValueError(f"{', '.join(split)} not divisible by TP {run.tp}")
    if model.dispatcher not in REPLAYED_DISPATCHERS:
        raise ValueError(f"dispatcher={model.dispatcher!r}: expected one of {REPLAYED_DISPATCHERS} (the flex "
                         "dispatcher's route cannot be replayed)")
    if run.ep < 1 or run.etp < 1:
        raise ValueError(f"EP {run.ep} and expert TP {run.etp} must be at least 1")
    if not model.moe:
        if (run.ep, run.etp) != (1, 1):
            raise ValueError(f"EP {run.ep} / expert TP {run.etp} on {model.name}, which has no experts")
        return
    if model.moe_layer_freq != 1 or model.shared_expert_ffn:
        raise ValueError(f"moe_layer_freq={model.moe_layer_freq}, shared_expert_ffn={model.shared_expert_ffn}: "
                         "estimate models every layer MoE and no shared expert")
    if not 1 <= model.topk <= model.num_experts:
        raise ValueError(f"top-{model.topk} routing over {model.num_experts} experts")
    if model.num_experts % run.ep:
        raise ValueError(f"{model.num_experts} experts do not split over EP {run.ep}")
    if model.moe_ffn % run.etp:
        raise ValueError(f"moe_ffn {model.moe_ffn} is not divisible by expert TP {run.etp}")
    if "linear_fc1" in run.targets and run.lora_rank % run.etp:
        raise ValueError(f"LoRA rank {run.lora_rank} is not divisible by expert TP {run.etp} (expert linear_fc1 "
                         "is column-parallel: its LoRA-A is split by rows over expert TP)")
    if run.tp > 1 and not run.sp:
        raise ValueError(f"TP {run.tp} without sequence parallelism: megatron's MoELayer refuses to train "
                         "a MoE model so")


#: --recompute-granularity and --recompute-method's choices (megatron's TransformerConfig)
GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


def check_recompute(run: Run) -> None:
    """A ``ValueError`` for recompute settings megatron's ``TransformerConfig`` refuses (full needs a method and a
    layer count; selective takes neither)."""
    g = run.recompute_granularity
    if g is not None and g not in GRANULARITIES:
        raise ValueError(f"recompute_granularity={g!r}: expected one of {GRANULARITIES}")
    if g == "full":
        if run.recompute_method not in RECOMPUTE_METHODS:
            raise ValueError(f"full recompute with recompute_method={run.recompute_method!r}: megatron needs "
                             f"{' or '.join(RECOMPUTE_METHODS)}")
        if not run.recompute_num_layers or run.recompute_num_layers < 1:
            raise ValueError(f"full recompute with recompute_num_layers={run.recompute_num_layers}: megatron needs "
                             "1 to the layers of a pipeline stage")
    elif run.recompute_method is not None or run.recompute_num_layers is not None:
        raise ValueError(f"recompute_method={run.recompute_method!r}, recompute_num_layers="
                         f"{run.recompute_num_layers}: only with full recompute (megatron refuses them otherwise)")


def recompute_modules(run: Run) -> tuple:
    """The modules selective recompute checkpoints (megatron's default ``("core_attn",)`` where none are named);
    none without selective recompute."""
    if run.recompute_granularity != "selective":
        return ()
    return tuple(run.recompute_modules) or ("core_attn",)


def checkpointed_layers(model: Model, run: Run) -> list[bool]:
    """Per layer of this GPU: whether full recompute checkpoints it (nothing inside it is kept after the forward:
    megatron's ``TransformerBlock._checkpointed_forward``, uniform groups or the first ``recompute_num_layers``)."""
    n = layers_here(model, run)
    if run.recompute_granularity != "full":
        return [False] * n
    if run.recompute_method == "block":
        return [i < run.recompute_num_layers for i in range(n)]
    return [True] * n


def checkpoint_group(model: Model, run: Run) -> int:
    """Layers whose recomputed activations are alive at once in a checkpointed layer's backward (uniform: a group
    of ``recompute_num_layers``; block: one layer; 0 without full recompute)."""
    if run.recompute_granularity != "full":
        return 0
    return min(run.recompute_num_layers, layers_here(model, run)) if run.recompute_method == "uniform" else 1


def checkpointed_target(model: Model, run: Run, layer_checkpointed: bool, target: str) -> bool:
    """Whether an adapter on ``target`` (a dense name, or ``experts.linear_fc1`` / ``experts.linear_fc2``) runs
    inside megatron's activation checkpoint in a layer (``layer_checkpointed``: full recompute's): full recompute,
    or selective ``mlp`` (a dense MLP's fc1 / fc2) or ``moe`` (the expert linears)."""
    if layer_checkpointed:
        return True
    modules = recompute_modules(run)
    if target.startswith("experts."):
        return "moe" in modules
    return "mlp" in modules and not model.moe and target in ("linear_fc1", "linear_fc2")


def layers_here(model: Model, run: Run) -> int:
    if model.layers % run.pp:
        raise ValueError(f"{model.layers} layers do not split into {run.pp} pipeline stages")
    return model.layers // run.pp


def eligible_per_layer(model: Model, run: Run) -> list[str]:
    """Adapters that may keep only their shard (qkv, and fc1 of a dense MLP)."""
    if not run.sp or run.tp <= 1:
        return []
    names = [n for n in ELIGIBLE_BASES if n in run.targets]
    return [n for n in names if not (n == "linear_fc1" and model.moe)]


def producer_inputs_need_grad(targets, layers: int, decoder_input_grad: bool) -> list[dict]:
    """Per layer of this GPU: whether the producer of each recomputable adapter input has an
    input that requires grad — the only case in which its autograd node keeps a tensor to
    recompute from (base weights are frozen). ``decoder_input_grad``: the first layer's input
    does (a later pipeline stage; or Bridge/HF make it require grad); otherwise the residual
    stream starts requiring grad after the first trainable adapter.

    ``linear_qkv``: ``input_layernorm``'s input (the residual stream); ``linear_fc1``:
    ``pre_mlp_layernorm``'s input (the residual after attention: needs grad once qkv or proj
    has an adapter) — in a MoE layer also whether the router's input (the norm's output) does;
    ``linear_fc2``: fc1's output (needs grad when fc1 has an adapter too).
    """
    g, out = decoder_input_grad, []
    for _ in range(layers):
        row = {"linear_qkv": g}
        g = g or "linear_qkv" in targets or "linear_proj" in targets
        row["linear_fc1"] = g
        row["linear_fc2"] = g or "linear_fc1" in targets
        g = g or "linear_fc1" in targets or "linear_fc2" in targets
        out.append(row)
    return out


def needs_grad(model: Model, run: Run) -> list[dict]:
    """:func:`producer_inputs_need_grad` for the layers of this GPU."""
    return producer_inputs_need_grad(run.targets, layers_here(model, run),
                                     run.input_requires_grad or not run.first_stage)


@dataclass(frozen=True)
class AdapterInput:
    """One adapter's input for LoRA-A's gradient: the bytes it adds (0 when recomputed) and,
    with recompute asked, the producer it is rebuilt from or why it is kept. An expert row
    stands for the ``adapters`` of one MoE layer that read the same routed rows."""

    target: str
    kept_bytes: int  # per micro-batch
    recomputed_from: str | None = None
    kept_because: str | None = None
    adapters: int = 1
    shared_with: str | None = None  # kept anyway by this op for its own backward: 0 new bytes
    # the rank-r tensor LoRA-B keeps for its weight gradient (``mid``, per micro-batch): [s, b, r], and on its
    # sequence shard [s/t, b, r] for a lean row adapter under SP (docs/design.md 3.7)
    mid_bytes: int = 0
    # inside megatron's activation checkpoint (full recompute, selective mlp / moe): nothing is kept after the
    # forward (kept_bytes and mid_bytes 0); what the adapter keeps in its layer's recomputed forward, alive until
    # that layer's backward is done (the gather path's input and mid: a checkpointed adapter takes the gather path)
    checkpointed_bytes: int | None = None
