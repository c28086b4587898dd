"""The sentences a torchtitan adapter explains its choices with (``regather.torchtitan.decisions``,
the fallback log). A sentence never embeds a measured number: numbers go into the reason's
``detail`` (:class:`regather.core.decision.Reason`), so one reason is logged once per model, at
its own level (:func:`~regather.core.decision.expected`: INFO; any other: WARNING).

Fallbacks of the strategy (the adapter runs torchtitan's own LoRA-A, bit for bit):
"""

from __future__ import annotations

from regather.core import moment
from regather.core.decision import expected
from regather.core.recompute.reasons import NOTHING_KEPT

#: torchtitan's llama3 / qwen3 block linears by name (LoRA's ``target_modules``), and the
#: column-parallel ones, whose input is gathered over the sequence (``w1`` and ``w3`` by one gather)
TARGETS = ("wqkv", "wo", "w1", "w2", "w3")
COLUMN_TARGETS = ("wqkv", "w1", "w3")
#: the norm whose output is a column adapter's sequence shard, by its name in the block
NORM_OF = {"wqkv": "attention_norm", "w1": "ffn_norm", "w3": "ffn_norm"}
#: what ``w2``'s input is rebuilt from (``input recomputed from the SwiGLU multiply``)
SWIGLU_PRODUCT = "the SwiGLU multiply"

EVAL, NO_GRAD, FROZEN_A = moment.EVAL, moment.NO_GRAD, moment.FROZEN_A
IN_CHECKPOINT = expected("running inside activation checkpointing (the checkpointed block keeps no adapter input "
                         "anyway)")
NOT_DTENSOR = ("the base weight is not a DTensor and no torchtitan spmd_types sharding config declares its layout "
               "(no tensor parallelism here)")
NOT_DECLARED = ("torchtitan's spmd_types sharding config declares no tensor-parallel layout for the base weight or "
                "LoRA-A (tensor parallelism is off for this linear)")
MESH_DIMS = ("the base weight lives on a {n}-D device mesh without a dim named 'tp' (regather reads the "
             "tensor-parallel dim)")
SHARDED_ELSEWHERE = ("the weights are sharded on a mesh dim other than 'tp' (base weight {base}, LoRA-A {lora_a}): "
                     "regather reads weights replicated there")
UNKNOWN_LAYOUT = "unknown tensor-parallel layout: base weight {base}, LoRA-A {lora_a}"
ROW = expected("row-parallel base: its input is split over hidden, not over the sequence")
NO_GATHER_SITE = ("no module before this linear gathers its input over the sequence (sequence parallelism "
                  "is off, or the layout declares no Shard -> Replicate input redistribution)")
NOT_THIS_GATHER = "the adapter input is not the sequence all-gather made for it in this forward"
GATHER_MODIFIED = "the gathered input was modified in place before the adapter read it"

# recompute_adapter_inputs: why an input is kept (INFO unless it may surprise)
GATHER_KEEPS = expected("the gather path keeps its gathered input as it is (recompute of a column-parallel "
                        "adapter's input needs regather or lowrank)")
NO_NORM = "no norm next to this linear produced the sequence shard in this forward"
NOT_NORM_OUTPUT = "the sequence shard is not {name}'s output of this forward"
NORM_NOT_REPRODUCED = "recomputing {name} does not reproduce the sequence shard bit for bit; the input is kept"
NOT_SWIGLU = "its input is not the SwiGLU product silu(w1 x) * w3 x of this forward"
SWIGLU_NOT_REPRODUCED = "multiplying the SwiGLU operands again does not reproduce the input bit for bit"
ALREADY_SAVED = "its input is already saved by {node} (kept: no bytes added)"  # INFO: expected(...format())
NOT_KEPT = "nothing before it keeps its input (row-parallel input other than the SwiGLU product)"
NORM_KEEPS_NOTHING = f"the norm: {NOTHING_KEPT}"

# torch.compile: the traced forward (regather.torchtitan.traced)
NOT_GATHERED_TRACED = "under torch.compile its input is not the sequence gather recorded for it in this forward"
INDIVISIBLE_TRACED = ("under torch.compile the input's sequence length {length} is not divisible by the "
                      "group size {world}: the gather path runs")
#: the producer a compiled input is rebuilt from (``Decision.recompute``)
REBUILT_TRACED = "what the backward reads anyway, by the compiled partitioner ({nodes} pointwise nodes)"
KEPT_TRACED = "under torch.compile: {why}"
NOT_COMPILED_HERE = expected("under torch.compile, no outcome of regather's joint-graph pass in this process "
                             "(not compiled yet, compiled from a cache, or by a backend other than Inductor: "
                             "the partitioner decides alone)")
