"""``regather estimate``'s per-GPU total: the frozen model, LoRA's state, the frozen model's activations, LoRA's peak.

Everything **modelled** from the sizes, per GPU of the first pipeline stage (with ``pp = 1``, the whole model's share
of one TP x CP rank), ``e`` the activation dtype's bytes:

- **frozen weights** (``e`` per parameter, sharded over TP; context parallelism does not shard weights): per layer
  qkv ``h*(heads+2*kv)*d/t``, proj ``heads*d*h/t``, the dense MLP ``h*ffn*(3 if gated else 2)/t``, or the local
  experts ``experts/ep * h*moe_ffn*(3 if gated else 2)/etp`` and the router ``experts*h``, the norms; the embedding
  ``vocab*h/t`` and (``pp = 1``) the output layer ``vocab*h/t`` and the final norm;
- **LoRA's state**: its weights (``e``), their gradients (fp32 ``main_grad``, megatron's DDP) and Adam's state (fp32
  master weights, two moments: 12 bytes), not sharded (megatron's distributed optimizer would divide the 12 bytes
  by the data x context parallel size);
- **the frozen model's activations**, what it keeps after the forward of one micro-batch (× in flight) with its
  decoder input requiring grad, as a LoRA run's backward needs: frozen weights make megatron's linears (local and
  TE's) keep no input, so a layer keeps its norms' inputs ``[T/t, h]`` (and their fp32 statistics), the attention's
  (TE's fused attention: ``q, k, v`` and its output, and the fp32 softmax statistics; the local spec's unfused one:
  ``q``, ``k`` and ``v`` with each head's own key / value, and the probabilities ``[b, heads/t, s, s]``), Qwen3's
  q / k norm inputs, the activation's input ``[T, (2) ffn/t]`` (MoE: the experts' ``[R, (2) moe_ffn/etp]`` and
  the router's fp32 probabilities); with ``pp = 1`` the final norm's input and the loss's fp32 softmax over the
  vocabulary shard ``[T, vocab/t]`` (megatron's vocab-parallel cross entropy). Selective recompute drops what its
  modules recompute (``core_attn``: the attention's output and statistics; ``mlp`` / ``moe``: the MLP's); full
  recompute keeps each checkpointed layer's input and, in its backward, one checkpoint group's activations;
- **LoRA's peak over the frozen model** (:mod:`regather.tools.estimate.peak`).

Not included: the frozen model's own transients in backward (its input gradients, the attention's backward, the
logits before the loss), the rotary tables, CUDA and NCCL workspaces, allocator fragmentation — the total is a
floor of what the GPU needs, set beside ``--gpu-memory``.
"""

from __future__ import annotations

from regather.tools.estimate.config import (
    Model,
    Run,
    checkpoint_group,
    checkpointed_layers,
    layers_here,
    recompute_modules,
    split_strategy,
)
from regather.tools.estimate.experts import routed_rows
from regather.tools.estimate.peak import peak
from regather.tools.estimate.spec import TE

GIB = 2**30
#: bytes per LoRA parameter beside the weight: the fp32 main_grad and Adam's fp32 master weight and two moments
LORA_GRAD_BYTES, LORA_OPTIMIZER_BYTES = 4, 12
#: how the total is obtained, for the reports
TOTAL_HOW = ("modelled: frozen weights + LoRA's weights, fp32 gradients and Adam state + the frozen model's "
             "activations after the forward (norm and attention inputs and outputs, the activation's input, the "
             "loss's fp32 softmax) + LoRA's peak over the frozen model; not included: the frozen model's own backward "
             "transients, CUDA / NCCL workspaces, fragmentation")


def _head(model: Model) -> tuple[int, int]:
    return model.head_dim or model.hidden // model.heads, model.kv_heads or model.heads


def frozen_weights(model: Model, run: Run) -> int:
    """The frozen model's parameter bytes on this GPU (module doc)."""
    h, t, e = model.hidden, run.tp, run.e
    d, kv = _head(model)
    layer = h * (model.heads + 2 * kv) * d // t + model.heads * d * h // t + 2 * h + (2 * d if model.qk_norm else 0)
    mlp = 3 if model.gated_mlp else 2
    if model.moe:
        layer += model.num_experts // run.ep * h * model.moe_ffn * mlp // run.etp + model.num_experts * h
    else:
        layer += h * model.ffn * mlp // t
    ends = model.vocab * h // t + ((model.vocab * h // t + h) if run.pp == 1 else 0)
    return (layers_here(model, run) * layer + ends) * e


def lora_parameters(model: Model, run: Run, strategy: str) -> int:
    """LoRA's parameters on this GPU (``A`` and ``B`` of every adapter, in the TP layout of docs/design.md §2;
    lowrank's column LoRA-A replicated ``[r, h]``)."""
    h, t, r = model.hidden, run.tp, run.lora_rank
    d, kv = _head(model)
    lowrank = split_strategy(strategy)[0] == "lowrank"
    a_col = r * h if lowrank else r * h // t
    per = {"linear_qkv": a_col + (model.heads + 2 * kv) * d // t * r, "linear_proj": r * model.heads * d // t + h // t * r}
    gated = 2 if model.gated_mlp else 1
    if model.moe:
        n = 1 if run.share_expert_adapters and model.experts == "grouped" else model.num_experts // run.ep
        per["linear_fc1"] = n * (r * h + model.moe_ffn * gated // run.etp * r)
        per["linear_fc2"] = n * (r * model.moe_ffn // run.etp + h * r)
    else:
        per["linear_fc1"] = a_col + model.ffn * gated // t * r
        per["linear_fc2"] = r * model.ffn // t + h // t * r
    return layers_here(model, run) * sum(n for name, n in per.items() if name in run.targets)


def lora_state(model: Model, run: Run, strategy: str) -> dict:
    """LoRA's weights, gradients and optimizer state on this GPU, in bytes (module doc)."""
    n = lora_parameters(model, run, strategy)
    return {"parameters": n, "weights": n * run.e, "grads": n * LORA_GRAD_BYTES, "optimizer": n * LORA_OPTIMIZER_BYTES}


def layer_activations(model: Model, run: Run, checkpointed: bool = False) -> dict:
    """What one frozen layer keeps after the forward of one micro-batch, by part (module doc); a layer full recompute
    checkpoints keeps only its input."""
    h, t, e, b = model.hidden, run.tp, run.e, run.micro_batch
    d, kv = _head(model)
    T = run.local_seq * b
    tsp = T // t if run.sp and t > 1 else T
    heads, groups = model.heads // t, kv // t if kv >= t else 1
    if checkpointed:
        return {"layer input (checkpoint)": tsp * h * e}
    modules = recompute_modules(run)
    out = {"norm inputs": 2 * tsp * h * e + 2 * tsp * 4}
    if model.qk_norm:
        out["q / k norm inputs"] = T * (heads + groups) * d * e
    if run.spec == TE or run.attention_keeps_output:
        out["attention q, k, v"] = T * (heads + 2 * groups) * d * e
        if "core_attn" not in modules:
            out["attention output and statistics"] = T * heads * d * e + T * heads * 4
    else:  # megatron's unfused local attention: q, k and v per head, the probabilities (CP 1 only)
        out["attention q, k, v"] = 3 * T * heads * d * e
        if "core_attn" not in modules:
            out["attention probabilities"] = b * heads * run.local_seq * run.local_seq * e
    gated = 2 if model.gated_mlp else 1
    if model.moe:
        if "moe" not in modules:
            out["experts' activation input"] = routed_rows(model, run) * gated * model.moe_ffn // run.etp * e
            out["router probabilities"] = tsp * model.num_experts * 4
    elif "mlp" not in modules:
        out["activation input"] = T * gated * model.ffn // t * e
    return out


def frozen_activations(model: Model, run: Run) -> dict:
    """The frozen model's activations on this GPU after the forward (× micro-batches in flight), and the most alive
    in a checkpointed layer's backward under full recompute: ``{"per_layer", "layers", "ends", "checkpoint",
    "total"}`` (module doc)."""
    full = checkpointed_layers(model, run)
    plain = layer_activations(model, run)
    inside = sum(layer_activations(model, run, True).values())
    layers = sum(inside if c else sum(plain.values()) for c in full)
    T = run.local_seq * run.micro_batch
    tsp = T // run.tp if run.sp and run.tp > 1 else T
    ends = (tsp * model.hidden * run.e + T * model.vocab // run.tp * 4) if run.pp == 1 else 0
    group = checkpoint_group(model, run) * sum(plain.values()) if any(full) else 0
    return {"per_layer": plain, "layers": layers * run.in_flight, "ends": ends * run.in_flight,
            "checkpoint": group, "total": (layers + ends) * run.in_flight + group}


def gpu_total(model: Model, run: Run, strategy: str, gpu_gib: float | None = None) -> dict:
    """The per-GPU total for ``strategy`` (module doc) by part, and against ``gpu_gib`` GiB where given
    (``fits``, ``headroom``)."""
    p = peak(model, run, strategy)
    lora = lora_state(model, run, strategy)
    parts = {"frozen weights": frozen_weights(model, run),
             "LoRA weights, grads, optimizer": lora["weights"] + lora["grads"] + lora["optimizer"],
             "frozen activations": frozen_activations(model, run)["total"],
             "LoRA peak over frozen": p["peak_over_frozen"]}
    total = sum(parts.values())
    out = {"parts": parts, "total": total, "lora": lora, "how": TOTAL_HOW}
    if gpu_gib is not None:
        out.update(gpu_bytes=int(gpu_gib * GIB), fits=total <= gpu_gib * GIB, headroom=int(gpu_gib * GIB) - total)
    return out
