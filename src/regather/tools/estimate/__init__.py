"""``regather estimate``: LoRA-A input memory and extra communication, analytically.

Same definitions as ``regather bench`` (docs/design.md §7), so the two agree byte
for byte on the configurations bench can run (``tests/distributed/tools/test_bench.py``,
every strategy and ``-recompute`` variant, frozen and grad-requiring decoder input):

- **adapter-input bytes** — what the LoRA-A weights keep for their gradient, per GPU, summed
  over the adapters of the layers this GPU holds and over the micro-batches in flight;
- **communication** — bytes each rank *receives* per micro-batch (forward + backward) beyond
  the gather path, under ring algorithms (``regather.core.accounting``).

One module per concern:

- :mod:`.config`  — the model and run (:mod:`regather.tools.shapes`), the presets, the strategies
  and the layout checks; which producers keep a tensor to recompute from
- :mod:`.spec`    — what the base linears keep on each layer spec (``--spec te``, the command's default:
  Transformer Engine, what Bridge's recipes run; ``--spec local``: megatron's local spec, what bench
  runs and :class:`Run` defaults to)
- :mod:`.dense`   — the dense adapters' bytes and collectives (the per-adapter tables)
- :mod:`.dora`    — ``--peft dora``: what DoRA's magnitude keeps (the pre-magnitude output), per adapter
- :mod:`.experts` — the expert adapters' bytes (the EP x ETP group's mean) and the collectives of
  rebuilding their inputs from the router's input
- :mod:`.summary` — the totals per strategy (:func:`estimate`)
- :mod:`.report`  — the text report and the JSON document; :mod:`.cli` — ``regather estimate``
- :mod:`.titan`   — ``--front-end torchtitan``: torchtitan's dense blocks under its own sharding
  config, its own LoRA as the baseline (terms, totals, report; :func:`titan_estimate`)

A producer keeps a tensor only when its input requires grad (the base weights are
frozen). With frozen embeddings the decoder input does not, so layer 0's
``input_layernorm`` keeps nothing and layer 0's qkv keeps its input (``x_local``);
likewise layer 0's fc1 when neither qkv nor proj has an adapter, and layer 0's fc2
when nothing before it does (:func:`producer_inputs_need_grad`). A later pipeline stage
(``first_stage=False``) receives an input that requires grad, as does layer 0 with
``input_requires_grad`` (Megatron Bridge's ``maybe_enable_recompute_inputs_grad``, which Bridge
applies when activation recompute is on; HF's ``enable_input_require_grads``). The
``-recompute`` rows give both savings. Transient memory in backward (the rebuilt input, alive
until ``dA``; regather's re-gather buffer; the re-dispatched tokens) is not retained memory and
is not counted, as for every strategy.

**Same work as the reference** (``--recipe``, ``--attention``): the reference does not state its
LoRA targets, and Megatron Bridge's own PEFT recipes for Qwen3-8B and Qwen3-30B-A3B adapt only
``linear_qkv`` and ``linear_proj`` (dim 8; :data:`~regather.tools.estimate.config.RECIPES`), so a
saving on fc1, fc2 or experts is not one a recipe run can show. ``--recipe`` takes the preset's
recipe LoRA; ``--targets``, ``--lora-rank``, ``--attention`` or ``--recipe`` add to the report the
targets used beside the recipe's and the reference's figure, and the most any re-gather can free
on them (:func:`~regather.tools.estimate.report.same_work`). What stays under
``recompute_adapter_inputs`` is ``linear_proj``'s input (the attention output) and, with frozen
embeddings, layer 0's qkv shard; ``--attention fused`` (``Run.attention_keeps_output``: an attention
kernel that keeps its output for its own backward, as flash-attention and Transformer Engine's
fused attention do; the TE spec's default) counts ``linear_proj``'s input as 0 new bytes on every
strategy. The local spec's report is unchanged by these options. ``--recipe LAYOUT`` also takes a
shipped layout whole (:data:`~regather.tools.estimate.config.LAYOUTS`: Qwen3-8B's 1-GPU recipe at
TP 1, Llama 3 70B's at TP 8 with SP off, and the reference's Qwen3-8B TP2 + SP run).

Assumptions: SP layout ``[s, b, h]`` sharded over ``s``; LoRA on the linears
named in ``--targets``; in MoE layers ``linear_fc1``/``linear_fc2`` are the
experts' (they never re-gather, docs/design.md §5), routing is dropless (no capacity
drop-and-pad), the dispatcher is megatron's alltoall or allgather one, and expert
bytes are the EP x ETP group's mean (:mod:`.experts`); pipeline stages hold ``layers/pp``
layers; router, attention internals, allocator and workspace memory are not
modelled.
"""

from regather.megatron.reasons import ALL_TARGETS, EXPERT_TARGETS, NORM_OF, ROUTER_KEEPS_NOTHING
from regather.tools.estimate.config import (
    ALL_STRATEGIES,
    ATTENTION,
    EXPERT_LORA,
    LAYOUTS,
    PRESETS,
    RECIPES,
    RECOMPUTE,
    SPECS,
    STRATEGIES,
    VARIANTS,
    AdapterInput,
    Layout,
    Model,
    Recipe,
    Run,
    check_run,
    eligible_per_layer,
    expert_lora,
    layers_here,
    producer_inputs_need_grad,
    split_strategy,
)
from regather.tools.estimate.dense import adapter_inputs, dense_comm_changes
from regather.tools.estimate.dora import DORA_OUTPUTS, PEFTS, dora_output_bytes
from regather.tools.estimate.experts import (
    expert_adapters_per_layer,
    expert_comm_changes,
    expert_fc1_source,
    expert_inputs,
    expert_layout,
    local_tokens,
    predispatch_comm,
    redispatch_comm,
    routed_rows,
)
from regather.tools.estimate.report import REFERENCE, as_json, format_report, reference_for, same_work
from regather.tools.estimate.summary import (
    adapter_input_bytes,
    comm_changes,
    estimate,
    extra_comm_bytes,
    recompute_summary,
    saved_vs_gather,
    shared_summary,
)
from regather.tools.estimate.titan import titan_estimate

__all__ = [
    "ALL_STRATEGIES", "ALL_TARGETS", "ATTENTION", "DORA_OUTPUTS", "EXPERT_LORA", "EXPERT_TARGETS", "LAYOUTS", "NORM_OF",
    "PEFTS", "PRESETS", "RECIPES", "RECOMPUTE", "REFERENCE", "ROUTER_KEEPS_NOTHING", "SPECS", "STRATEGIES", "VARIANTS",
    "AdapterInput", "Layout", "Model", "Recipe",
    "Run", "adapter_input_bytes", "adapter_inputs", "as_json", "check_run", "comm_changes", "dense_comm_changes",
    "dora_output_bytes", "eligible_per_layer", "estimate", "expert_adapters_per_layer", "expert_comm_changes",
    "expert_fc1_source", "expert_inputs", "expert_layout", "expert_lora", "extra_comm_bytes", "format_report",
    "layers_here", "local_tokens", "predispatch_comm", "producer_inputs_need_grad", "recompute_summary",
    "redispatch_comm", "reference_for", "routed_rows", "same_work", "saved_vs_gather", "shared_summary",
    "split_strategy", "titan_estimate",
]
