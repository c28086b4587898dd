"""``regather estimate``: LoRA-A input memory and extra communication, analytically.

Same definitions as ``regather bench`` (design.md §7), so the two agree byte
for byte on the configurations bench can run (``tests/tools/test_bench.py``,
every strategy and ``-recompute`` variant, frozen and grad-requiring decoder input):

- **adapter-input bytes** — what the LoRA-A weights keep for their gradient,
  per GPU, summed over the adapters of the layers this GPU holds and over the
  micro-batches in flight. Per adapter and micro-batch (``e`` = activation
  bytes, ``t`` TP size, SP on):

  ======================= ===================== =============================
  adapter                 gather                regather / lowrank
  ======================= ===================== =============================
  linear_qkv, dense fc1   ``s*b*h*e``           ``s*b*h/t*e`` (eligible)
  linear_proj             ``s*b*(heads*d)/t*e`` same (row-parallel, ineligible)
  dense linear_fc2        ``s*b*ffn/t*e``       same
  expert fc1 (per layer)  ``R*h*e``             same (experts never re-gather)
  expert fc2 (per layer)  ``R*f_moe/et*e``      same
  ======================= ===================== =============================

  Without SP, or at TP=1, every strategy keeps ``s*b*h*e`` for qkv/fc1.

  **Expert rows** (MoE layers: ``k`` = top-k, ``p`` = EP, ``et`` = expert TP, ``f_moe`` =
  ``moe_ffn``). A GPU routes ``T = s*b/t`` local tokens per micro-batch (its sequence shard;
  ``T = s*b`` at TP 1; megatron's MoE layer refuses to train at TP > 1 without SP). Expert
  bytes are per GPU as the **mean over the EP x ETP group** — the ``g = p*et`` ranks that share
  one dispatch (megatron's ``tp_ep`` group). That mean is exact for dropless routing whatever
  the routing: each of the group's ``g*T`` tokens reaches exactly ``k`` experts, and each
  routed row is gathered onto the ``et`` expert-TP ranks of its expert, so the group holds
  ``g*T*k*et`` rows and one rank ``R = T*k*et`` on average (a given rank may hold more or
  fewer, as its experts are popular or not). Counted once per layer: SequentialMLP's
  per-expert fc1 inputs are row blocks of one buffer, and the per-expert fc2 inputs add up to
  the same ``R`` rows. The number of local experts (``experts/p``) changes how many adapters a
  layer has — one LoRA pair shared by the local experts (``expert_lora="shared"``: grouped
  experts with ``share_expert_adapters=True``, Bridge's default) or one per local expert
  (``"per-expert"``: SequentialMLP, or ``share_expert_adapters=False``) — not the bytes.

  **Recompute** (``<strategy>-recompute`` = ``LoRA(recompute_adapter_inputs=True)``,
  :mod:`regather.megatron.dense.producers`): an adapter that rebuilds its input in backward adds
  **0** bytes — it saves the tensor its producer already keeps. Which ones do:

  ======================= ============================================================
  adapter                 recomputes when
  ======================= ============================================================
  linear_qkv, dense fc1   regather or lowrank on an eligible adapter (SP, TP>1), and the
                          norm's input (``input_layernorm`` / ``pre_mlp_layernorm``)
                          requires grad; on the gather path or without SP: kept
  dense linear_fc2        every strategy, when fc1's output requires grad
  expert fc2              every strategy, when fc1's output requires grad (the experts'
                          activation x probs, SequentialMLP or TEGroupedMLP)
  expert fc1, shared      every strategy, when the router's input requires grad: LoRA-A
  LoRA-A                  runs before the dispatch (``regather.megatron.reasons.PREDISPATCH``)
  expert fc1, per-expert  every strategy, with ``redispatch`` (``LoRA(redispatch_expert_
  LoRA-A                  inputs=True)``) and when the router's input requires grad: it is
                          dispatched again in backward (``regather.megatron.reasons.REDISPATCH``);
                          without the opt-in: kept (``regather.megatron.reasons.REDISPATCH_OPT_IN``)
  linear_proj             never (no recomputable producer)
  ======================= ============================================================

  A producer keeps a tensor only when its input requires grad (the base weights are
  frozen). With frozen embeddings the decoder input does not, so layer 0's
  ``input_layernorm`` keeps nothing and layer 0's qkv keeps its input (``x_local``);
  likewise layer 0's fc1 when neither qkv nor proj has an adapter, and layer 0's fc2
  when nothing before it does (:func:`producer_inputs_need_grad`). The router's input is
  ``pre_mlp_layernorm``'s output, which requires grad exactly when the norm's input does
  (the fc1 entry of :func:`producer_inputs_need_grad`); when it does not, the router keeps
  nothing and layer 0's expert fc1 adapters keep their input (``ROUTER_KEEPS_NOTHING``).
  A later pipeline stage (``first_stage=False``) receives an input that requires grad, as
  does layer 0 with ``input_requires_grad`` (Megatron Bridge's
  ``maybe_enable_recompute_inputs_grad``, which Bridge applies when activation recompute is
  on; HF's ``enable_input_require_grads``). The ``-recompute`` rows give both savings.
  Transient memory in backward (the rebuilt input, alive until ``dA``; regather's re-gather
  buffer; the re-dispatched tokens) is not retained memory and is not counted, as for every
  strategy.
- **communication** — bytes each rank *receives* per micro-batch (forward +
  backward) under ring algorithms (``regather.core.accounting``): an all-gather of an
  output of ``n`` bytes costs ``n*(t-1)/t``, a reduce-scatter of an input of
  ``n`` bytes ``n*(t-1)/t``, an all-reduce ``2n*(t-1)/t``, an all-to-all over ``p``
  ranks ``n_out*(p-1)/p`` (``n_out`` its output bytes). Per eligible adapter,
  relative to the gather path (``f = (t-1)/t``, ``eg`` = dA gradient bytes):

  ========= ============================== ====================================
  strategy  added                          removed
  ========= ============================== ====================================
  regather  all-gather ``s*b*h*e*f``       —
  lowrank   reduce-scatter ``s*b*r*e*f``,  all-gather ``s*b*h*e*f``,
            all-reduce ``2*r*h*eg*f``      reduce-scatter ``s*b*h*e*f``,
                                           all-reduce ``2*s*b*r*e*f``
  ========= ============================== ====================================

  (Where a qkv/fc1 input needs no gradient — the same rule as above: layer 0's
  qkv with frozen embeddings, layer 0's fc1 with no adapter before it — no path
  reduce-scatters its ``dX``, so lowrank removes one such reduce-scatter less.
  Lowrank's forward all-gather of ``mid`` over the sequence, ``s*b*r``
  elements, replaces the gather path's all-gather of ``mid`` over the rank, of
  the same size; its ``dA`` all-reduce is per micro-batch when done in
  backward, the library default.) Everything megatron-core itself sends is the
  same for every strategy and not part of the "extra".

  Recomputing a dense input sends nothing. An expert fc1 input rebuilt from the router's
  input does send (:func:`expert_comm_changes`), per MoE layer whose expert fc1 recomputes,
  whatever the strategy (experts always run the gather path), as the same mean over the
  EP x ETP group (``w = e``, ``g = p*et``, ``R = T*k*et``, ``f_p, f_e, f_g`` = ``(p-1)/p``,
  ``(et-1)/et``, ``(g-1)/g``):

  ============= ========== ======================================== ==============================
  expert LoRA-A dispatcher added                                    removed (et > 1)
  ============= ========== ======================================== ==============================
  shared,       alltoall   all-to-all ``2*T*k*r*w*f_p`` (the tokens' all-gather ``R*r*w*f_e`` (mid
  before the               route and its reverse, r columns);       over the rank: the route
  dispatch                 et > 1: all-gather ``T*k*et*r*w*f_e``    carries all r columns),
                           (route) + ``r*h*w*f_e`` (LoRA-A over     all-reduce ``2*R*r*w*f_e``
                           expert TP), reduce-scatter the same two  (LoRA-B's dmid: the route's
                           (reverse route, ``dA``)                  reduce-scatter sums it)
                allgather  all-gather ``T*g*r*w*f_g``, reduce-      the same
                           scatter the same; et > 1: all-gather and
                           reduce-scatter ``r*h*w*f_e`` (A, ``dA``)
  per-expert,   alltoall   backward: all-to-all ``T*k*h*w*f_p``;    —
  re-dispatch              et > 1: all-gather ``T*k*et*h*w*f_e``
                allgather  backward: all-gather ``T*g*h*w*f_g``     —
  ============= ========== ======================================== ==============================

  Not counted (not per micro-batch): the first forward of each MoE layer checks the route
  once — one h-wide dispatch of the router's input and an int32 all-reduce of the verdict
  over the group (:mod:`regather.megatron.moe.inputs`).

Model presets (config.json of each model on the Hugging Face Hub, as
recalled; check before relying on them): **Qwen3-8B** h=4096, ffn=12288, 36
layers, 32 heads, 8 kv heads, head_dim 128, vocab 151936; **Qwen3-30B-A3B**
h=2048, 48 layers all MoE, 32 heads, 4 kv heads, head_dim 128 (so attention is
4096 wide, wider than h), 128 experts, moe ffn 768, top-8, no dense MLP and no
shared expert; **GPT-OSS-120B** h=2880, 36 layers all MoE, 64 heads, 8 kv heads,
head_dim 64, 128 experts, moe ffn 2880, top-4, vocab 201088; **Llama3-70B**
h=8192, ffn=28672, 80 layers, 64 heads, 8 kv heads, head_dim 128, vocab 128256.

Assumptions: SP layout ``[s, b, h]`` sharded over ``s``; LoRA on the linears
named in ``--targets``; in MoE layers ``linear_fc1``/``linear_fc2`` are the
experts' (they never re-gather, design.md §5), routing is dropless (no capacity
drop-and-pad), the dispatcher is megatron's alltoall or allgather one, and expert
bytes are the EP x ETP group's mean (above); pipeline stages hold ``layers/pp``
layers; router, attention internals, allocator and workspace memory are not
modelled.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, replace

ELIGIBLE = ("linear_qkv", "linear_fc1")
ALL_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
EXPERT_TARGETS = ("experts.linear_fc1", "experts.linear_fc2")  # keys of the expert rows (MoE layers)
STRATEGIES = ("gather", "regather", "lowrank")
RECOMPUTE = "-recompute"  # suffix: LoRA(recompute_adapter_inputs=True) on that strategy
VARIANTS = tuple(name + RECOMPUTE for name in STRATEGIES)
ALL_STRATEGIES = STRATEGIES + VARIANTS
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
NORM_OF = {"linear_qkv": "input_layernorm", "linear_fc1": "pre_mlp_layernorm"}
EXPERT_LORA = ("shared", "per-expert")  # one LoRA pair for a layer's local experts, or one per expert
DISPATCHERS = ("alltoall", "allgather")  # megatron's dispatchers whose route regather replays


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int | None = None
    head_dim: int | None = None  # default hidden // heads
    ffn: int = 0  # dense MLP width (0: every layer is MoE)
    experts: int = 0
    moe_ffn: int = 0
    topk: int = 0
    vocab: int = 0

    @property
    def attn_width(self) -> int:
        return self.heads * (self.head_dim or self.hidden // self.heads)

    @property
    def moe(self) -> bool:
        return self.experts > 0


PRESETS = {
    "qwen3-8b": Model("Qwen3-8B", hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128,
                      ffn=12288, vocab=151936),
    "qwen3-30b-a3b": Model("Qwen3-30B-A3B", hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128,
                           experts=128, moe_ffn=768, topk=8, vocab=151936),
    "gpt-oss-120b": Model("GPT-OSS-120B", hidden=2880, layers=36, heads=64, kv_heads=8, head_dim=64,
                          experts=128, moe_ffn=2880, topk=4, vocab=201088),
    "llama3-70b": Model("Llama3-70B", hidden=8192, layers=80, heads=64, kv_heads=8, head_dim=128,
                        ffn=28672, vocab=128256),
}


@dataclass(frozen=True)
class Run:
    tp: int = 2
    sp: bool = True
    seq: int = 8192
    micro_batch: int = 1
    in_flight: int = 1  # micro-batches whose activations are alive at once (pipeline schedules)
    pp: int = 1
    dtype: str = "bfloat16"
    grad_dtype: str | None = None  # dtype of LoRA-A's gradient (default: dtype; fp32 with main_grad)
    lora_rank: int = 16
    targets: tuple = ALL_TARGETS
    # this GPU holds the first layer: with frozen embeddings, its qkv input needs no
    # gradient, so no path reduce-scatters that adapter's dX (lowrank removes one RS less),
    # and with recompute_adapter_inputs its input_layernorm keeps nothing to recompute from
    first_stage: bool = True
    # the decoder's input requires grad although the embeddings are frozen (Bridge's
    # maybe_enable_recompute_inputs_grad when activation recompute is on; HF's
    # enable_input_require_grads): layer 0 then behaves like every other layer
    input_requires_grad: bool = False
    # MoE layers (a dense model needs ep = etp = 1)
    ep: int = 1  # expert parallel size
    etp: int = 1  # expert tensor parallel size
    # "shared": one LoRA pair for a layer's local experts (grouped experts, share_expert_adapters=True,
    # Bridge's default); "per-expert": one per expert (SequentialMLP; share_expert_adapters=False)
    expert_lora: str = "shared"
    # LoRA(redispatch_expert_inputs=True): per-expert fc1 inputs dispatched again in backward (effect
    # only with a -recompute strategy)
    redispatch: bool = False
    dispatcher: str = "alltoall"  # megatron's moe_token_dispatcher_type

    @property
    def e(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def eg(self) -> int:
        return DTYPE_BYTES[self.grad_dtype or self.dtype]


def split_strategy(name: str) -> tuple[str, bool]:
    """``"regather-recompute"`` -> ``("regather", True)``; ``"lowrank"`` -> ``("lowrank", False)``."""
    base, recompute = (name[: -len(RECOMPUTE)], True) if name.endswith(RECOMPUTE) else (name, False)
    if base not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; expected one of {ALL_STRATEGIES}")
    return base, recompute


def _ring(nbytes: int, t: int) -> int:
    """Bytes received per rank for a gather output / scatter input of ``nbytes`` (accounting.py)."""
    return nbytes * (t - 1) // t


def check_run(model: Model, run: Run) -> None:
    """A ``ValueError`` naming the values for a layout that cannot exist (sizes that do not divide)."""
    if run.sp and run.seq % run.tp:
        raise ValueError(f"sequence {run.seq} is not divisible by TP {run.tp}")
    if run.expert_lora not in EXPERT_LORA:
        raise ValueError(f"expert_lora={run.expert_lora!r}: expected one of {EXPERT_LORA}")
    if run.dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher={run.dispatcher!r}: expected one of {DISPATCHERS} (the flex dispatcher's "
                         "route cannot be replayed)")
    if run.ep < 1 or run.etp < 1:
        raise ValueError(f"EP {run.ep} and expert TP {run.etp} must be at least 1")
    if not model.moe:
        if (run.ep, run.etp) != (1, 1):
            raise ValueError(f"EP {run.ep} / expert TP {run.etp} on {model.name}, which has no experts")
        return
    if not 1 <= model.topk <= model.experts:
        raise ValueError(f"top-{model.topk} routing over {model.experts} experts")
    if model.experts % run.ep:
        raise ValueError(f"{model.experts} experts do not split over EP {run.ep}")
    if model.moe_ffn % run.etp:
        raise ValueError(f"moe_ffn {model.moe_ffn} is not divisible by expert TP {run.etp}")
    if "linear_fc1" in run.targets and run.lora_rank % run.etp:
        raise ValueError(f"LoRA rank {run.lora_rank} is not divisible by expert TP {run.etp} (expert linear_fc1 "
                         "is column-parallel: its LoRA-A is split by rows over expert TP)")
    if run.tp > 1 and not run.sp:
        raise ValueError(f"TP {run.tp} without sequence parallelism: megatron's MoELayer refuses to train "
                         "a MoE model so")


def layers_here(model: Model, run: Run) -> int:
    if model.layers % run.pp:
        raise ValueError(f"{model.layers} layers do not split into {run.pp} pipeline stages")
    return model.layers // run.pp


def eligible_per_layer(model: Model, run: Run) -> list[str]:
    """Adapters that may keep only their shard (qkv, and fc1 of a dense MLP)."""
    if not run.sp or run.tp <= 1:
        return []
    names = [n for n in ELIGIBLE if n in run.targets]
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


def _needs_grad(model: Model, run: Run) -> list[dict]:
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


_NOTHING_KEPT = "it keeps nothing for its backward (neither its input nor its weights need a gradient)"
# what an expert fc1 adapter says when the router's input needs no gradient (regather.megatron.moe.inputs:
# "the router: " + regather.megatron.dense.producers.kept_between's sentence)
ROUTER_KEEPS_NOTHING = f"the router: {_NOTHING_KEPT}"


def adapter_inputs(model: Model, run: Run, strategy: str) -> list[list[AdapterInput]]:
    """Per layer of this GPU (first layer first), each targeted dense adapter's input, per
    micro-batch. Recompute (``…-recompute``): qkv/fc1 on an eligible regather/lowrank adapter,
    fc2 on every strategy, when the producer keeps a tensor (:func:`producer_inputs_need_grad`);
    the reasons are the ones the adapters give (``regather.decisions``). Experts:
    :func:`expert_inputs`."""
    base, recompute = split_strategy(strategy)
    check_run(model, run)
    s, b, t, e = run.seq, run.micro_batch, run.tp, run.e
    eligible = eligible_per_layer(model, run)
    local = base != "gather"
    layers = []
    for need_grad in _needs_grad(model, run):
        row = []
        for name in ALL_TARGETS:
            if name not in run.targets or (model.moe and name in ("linear_fc1", "linear_fc2")):
                continue
            if name in ("linear_qkv", "linear_fc1"):
                shard = local and name in eligible
                kept = s * b * model.hidden * e // (t if shard else 1)
                if not recompute:
                    row.append(AdapterInput(name, kept))
                elif not shard:
                    path = "gather" if (run.sp and run.tp > 1) else "replicated"
                    row.append(AdapterInput(name, kept, kept_because=(
                        f"the {path} path keeps its input as it is (recompute of a column-parallel "
                        "adapter's input needs regather or lowrank)")))
                elif not need_grad[name]:
                    row.append(AdapterInput(name, kept, kept_because=f"{NORM_OF[name]}: {_NOTHING_KEPT}"))
                else:
                    row.append(AdapterInput(name, 0, recomputed_from=NORM_OF[name]))
            elif name == "linear_proj":
                kept = s * b * model.attn_width // t * e
                row.append(AdapterInput(name, kept, kept_because=(
                    "linear_proj has no recomputable producer (only linear_qkv, linear_fc1 and linear_fc2 do)"
                ) if recompute else None))
            else:  # dense linear_fc2: the activation output [s, b, ffn/t]
                kept = s * b * model.ffn // t * e
                if not recompute:
                    row.append(AdapterInput(name, kept))
                elif not need_grad[name]:
                    row.append(AdapterInput(name, kept, kept_because=f"the MLP activation: {_NOTHING_KEPT}"))
                else:
                    row.append(AdapterInput(name, 0, recomputed_from="the MLP activation"))
        layers.append(row)
    return layers


# -- experts (MoE layers) ---------------------------------------------------------------


def local_tokens(run: Run) -> int:
    """``T``: the tokens of one micro-batch a GPU routes — its sequence shard ``s*b/t`` (SP on;
    ``s*b`` at TP 1)."""
    return run.seq * run.micro_batch // (run.tp if run.sp else 1)


def routed_rows(model: Model, run: Run) -> int:
    """``R = T*k*et``: the routed rows a GPU's experts read per MoE layer and micro-batch, as the
    mean over the EP x ETP group (exact for dropless routing, see the module doc)."""
    return local_tokens(run) * model.topk * run.etp


def expert_adapters_per_layer(model: Model, run: Run) -> int:
    """LoRA pairs per expert linear in one MoE layer on this GPU: 1 shared by the ``experts/ep``
    local experts, or one per local expert."""
    return 1 if run.expert_lora == "shared" else model.experts // run.ep


def expert_layout(model: Model, run: Run) -> dict:
    """What one MoE layer holds on this GPU: local experts, adapters per expert linear targeted,
    local tokens ``T`` and routed rows ``R`` per micro-batch ({} for a dense model)."""
    check_run(model, run)
    if not model.moe:
        return {}
    n = expert_adapters_per_layer(model, run)
    return {"local_experts": model.experts // run.ep, "expert_lora": run.expert_lora,
            "adapters_per_layer": {f"experts.{t}": n for t in ("linear_fc1", "linear_fc2") if t in run.targets},
            "local_tokens": local_tokens(run), "routed_rows": routed_rows(model, run),
            "ep": run.ep, "etp": run.etp, "dispatcher": run.dispatcher}


def expert_fc1_source(shared: bool, redispatch: bool, router_input_needs_grad: bool
                      ) -> tuple[str | None, str | None]:
    """Under ``recompute_adapter_inputs``: ``(producer, None)`` when a MoE layer's expert fc1
    adapters rebuild their input from the router's input, ``(None, reason)`` when they keep it —
    the sentences of :mod:`regather.megatron.moe.inputs`, in the adapters' order: a per-expert LoRA-A
    without ``redispatch_expert_inputs`` first (it gets no producer), then a router whose input
    needs no gradient (it keeps nothing). Checkpoint and configuration refusals (selective
    ``moe`` recompute, the flex dispatcher, fp8, ...) are :mod:`regather.tools.doctor`'s."""
    from regather.megatron.moe.inputs import PREDISPATCH, REDISPATCH, REDISPATCH_OPT_IN

    if not shared and not redispatch:
        return None, REDISPATCH_OPT_IN
    if not router_input_needs_grad:
        return None, ROUTER_KEEPS_NOTHING
    return (PREDISPATCH if shared else REDISPATCH), None


def expert_inputs(model: Model, run: Run, strategy: str) -> list[list[AdapterInput]]:
    """Per MoE layer of this GPU, its expert adapters' inputs per micro-batch, one row per
    targeted expert linear (``adapters`` = the layer's LoRA pairs on it), bytes the mean over
    the EP x ETP group: fc1 ``R*h*e`` (the dispatched tokens), fc2 ``R*(moe_ffn/et)*e``.

    Recompute: fc1 rebuilds its input from the router's input (:func:`expert_fc1_source`: a
    shared LoRA-A before the dispatch, a per-expert one by dispatching again with ``redispatch``)
    when the router's input requires grad; fc2 from what the experts' activation and the probs
    multiply keep when fc1's output requires grad (:mod:`regather.megatron.moe.producers`)."""
    _, recompute = split_strategy(strategy)
    check_run(model, run)
    if not model.moe:
        return []
    rows, e, n = routed_rows(model, run), run.e, expert_adapters_per_layer(model, run)
    shared = run.expert_lora == "shared"
    layers = []
    for need_grad in _needs_grad(model, run):
        row = []
        if "linear_fc1" in run.targets:
            kept = rows * model.hidden * e
            producer, why = (expert_fc1_source(shared, run.redispatch, need_grad["linear_fc1"]) if recompute
                             else (None, None))
            row.append(AdapterInput("experts.linear_fc1", 0 if producer else kept, producer, why, n))
        if "linear_fc2" in run.targets:
            kept = rows * (model.moe_ffn // run.etp) * e
            if not recompute:
                row.append(AdapterInput("experts.linear_fc2", kept, adapters=n))
            elif not need_grad["linear_fc2"]:
                row.append(AdapterInput("experts.linear_fc2", kept, adapters=n,
                                        kept_because=f"the experts' activation: {_NOTHING_KEPT}"))
            else:
                row.append(AdapterInput("experts.linear_fc2", 0, recomputed_from="the experts' activation",
                                        adapters=n))
        layers.append(row)
    return layers


def adapter_input_bytes(model: Model, run: Run, strategy: str) -> dict:
    """Per GPU, by target (all micro-batches in flight): the dense targets' and, in MoE layers,
    ``"experts.linear_fc1"`` / ``"experts.linear_fc2"`` (the EP x ETP group's mean)."""
    per_target: dict[str, int] = {}
    for row in adapter_inputs(model, run, strategy) + expert_inputs(model, run, strategy):
        for a in row:
            per_target[a.target] = per_target.get(a.target, 0) + a.kept_bytes
    return {k: v * run.in_flight for k, v in per_target.items()}


def recompute_summary(model: Model, run: Run, strategy: str) -> dict:
    """How many adapters recompute their input, by target, and why the others keep it (an
    expert row counts each of the layer's LoRA pairs it stands for)."""
    recomputed: dict[str, int] = {}
    kept: dict[str, int] = {}
    for row in adapter_inputs(model, run, strategy) + expert_inputs(model, run, strategy):
        for a in row:
            if a.recomputed_from:
                recomputed[a.target] = recomputed.get(a.target, 0) + a.adapters
            elif a.kept_because:
                key = f"{a.target}: {a.kept_because}"
                kept[key] = kept.get(key, 0) + a.adapters
    order = ALL_TARGETS + EXPERT_TARGETS
    return {"recomputed_by_target": {t: recomputed[t] for t in order if t in recomputed},
            "kept_by_reason": kept}


# -- communication ---------------------------------------------------------------------------


def comm_changes(model: Model, run: Run, strategy: str) -> list[tuple[str, int, str]]:
    """Collectives a strategy adds (+) or removes (-) against the gather path, per micro-batch:
    ``[(kind, signed bytes received per rank, what), ...]`` summed over the eligible adapters
    (:func:`dense_comm_changes`) and, for a ``…-recompute`` variant, over the MoE layers whose
    expert fc1 input comes from the router's input (:func:`expert_comm_changes`)."""
    base, recompute = split_strategy(strategy)
    check_run(model, run)
    return dense_comm_changes(model, run, base) + (expert_comm_changes(model, run, strategy) if recompute else [])


def dense_comm_changes(model: Model, run: Run, strategy: str) -> list[tuple[str, int, str]]:
    """The eligible dense adapters' changes for ``strategy`` (gather, regather or lowrank): the
    module doc's strategy table. Recomputing a dense input sends nothing."""
    n = len(eligible_per_layer(model, run)) * layers_here(model, run)
    s, b, h, r, t, e, eg = run.seq, run.micro_batch, model.hidden, run.lora_rank, run.tp, run.e, run.eg
    if strategy == "gather" or n == 0:
        return []
    x = _ring(s * b * h * e, t)
    if strategy == "regather":
        return [("all_gather", n * x, "backward re-gather of x_local")]
    mid = _ring(s * b * r * e, t)
    # dX exists (and the gather path reduce-scatters it) only where the norm output needs a
    # gradient: not for layer 0's qkv with frozen embeddings, nor for fc1 before any adapter
    eligible = eligible_per_layer(model, run)
    with_dx = sum(need[name] for need in _needs_grad(model, run) for name in eligible)
    return [
        ("all_gather", -n * x, "forward gather of x (not needed)"),
        ("reduce_scatter", -with_dx * x, "backward reduce-scatter of dX (dX is local)"),
        ("all_reduce", -2 * n * mid, "LoRA-B input-grad all-reduce (reduce-scatter sums dmid)"),
        ("reduce_scatter", n * mid, "backward reduce-scatter of dmid over s"),
        ("all_reduce", 2 * n * _ring(r * h * eg, t), "dA all-reduce of the replicated LoRA-A"),
    ]


def predispatch_comm(model: Model, run: Run) -> list[tuple[str, int, str]]:
    """One MoE layer's changes, per micro-batch, when its shared expert LoRA-A runs before the
    dispatch (:mod:`regather.core.strategies.predispatched`), mean over the EP x ETP group (``T``
    local tokens, ``g = p*et``, ``R = T*k*et``, ``w = e``): the ``r``-wide LoRA-A output takes
    the tokens' route and its reverse — alltoall: all-to-all ``2*T*k*r*w*(p-1)/p`` and, at
    et > 1, the route's expert-TP all-gather ``T*k*et*r*w*(et-1)/et`` and its reduce-scatter;
    allgather: all-gather and reduce-scatter ``T*g*r*w*(g-1)/g``. At et > 1 LoRA-A is gathered
    over expert TP (all-gather ``r*h*w*(et-1)/et``, ``dA`` reduce-scattered: the same), and
    ``mid``'s all-gather over the rank (``R*r*w*(et-1)/et``) and LoRA-B's ``dmid`` all-reduce
    (``2*R*r*w*(et-1)/et``) go: the route carries all ``r`` columns and sums ``dmid``."""
    T, k, r, h, w, p, et = local_tokens(run), model.topk, run.lora_rank, model.hidden, run.e, run.ep, run.etp
    if run.dispatcher == "alltoall":
        out = [("all_to_all", 2 * _ring(T * k * r * w, p),
                "shared expert LoRA-A output (r wide) along the tokens' route and back")]
        if et > 1:
            rows = _ring(T * k * et * r * w, et)
            out += [("all_gather", rows, "the route's expert-TP gather of the r-wide rows"),
                    ("reduce_scatter", rows, "the reverse route's expert-TP reduce-scatter of dmid")]
    else:
        g = p * et
        rows = _ring(T * g * r * w, g)
        out = [("all_gather", rows, "shared expert LoRA-A output (r wide) gathered over EP x expert TP (the route)"),
               ("reduce_scatter", rows, "its dmid reduce-scattered back (the reverse route)")]
    if et > 1:
        a, mid = _ring(r * h * w, et), _ring(routed_rows(model, run) * r * w, et)
        out += [("all_gather", a, "shared expert LoRA-A gathered over expert TP"),
                ("reduce_scatter", a, "its dA reduce-scattered over expert TP"),
                ("all_gather", -mid, "expert mid gathered over the rank (not needed: the route carries r columns)"),
                ("all_reduce", -2 * mid, "expert LoRA-B dmid all-reduce over expert TP (the route's reduce-scatter "
                                         "sums it)")]
    return out


def redispatch_comm(model: Model, run: Run) -> list[tuple[str, int, str]]:
    """One MoE layer's changes, per micro-batch, when its per-expert fc1 adapters read the
    router's input dispatched again in backward (:mod:`regather.megatron.moe.inputs`), mean over the
    EP x ETP group: one more dispatch of the ``T`` h-wide tokens — alltoall: all-to-all
    ``T*k*h*w*(p-1)/p`` and, at et > 1, all-gather ``T*k*et*h*w*(et-1)/et``; allgather:
    all-gather ``T*g*h*w*(g-1)/g`` (``g = p*et``)."""
    T, k, h, w, p, et = local_tokens(run), model.topk, model.hidden, run.e, run.ep, run.etp
    if run.dispatcher == "alltoall":
        out = [("all_to_all", _ring(T * k * h * w, p), "backward: the router's input dispatched again "
                                                        "(per-expert LoRA-A)")]
        if et > 1:
            out.append(("all_gather", _ring(T * k * et * h * w, et), "backward: its expert-TP gather"))
        return out
    g = p * et
    return [("all_gather", _ring(T * g * h * w, g), "backward: the router's input gathered again over EP x "
                                                     "expert TP (per-expert LoRA-A)")]


def expert_comm_changes(model: Model, run: Run, strategy: str) -> list[tuple[str, int, str]]:
    """:func:`predispatch_comm` / :func:`redispatch_comm` summed over the MoE layers of this GPU
    whose expert fc1 input comes from the router's input under ``strategy`` (empty without
    recompute). The first forward's one-time route check is not per micro-batch: not counted."""
    from regather.megatron.moe.inputs import PREDISPATCH, REDISPATCH

    sources = [a.recomputed_from for row in expert_inputs(model, run, strategy) for a in row
               if a.target == "experts.linear_fc1"]
    out = []
    for per_layer, source in ((predispatch_comm, PREDISPATCH), (redispatch_comm, REDISPATCH)):
        layers = sources.count(source)
        if layers:
            out += [(kind, layers * n, what) for kind, n, what in per_layer(model, run) if n]
    return out


def extra_comm_bytes(model: Model, run: Run, strategy: str) -> dict:
    """Net bytes received per rank per micro-batch beyond the gather path, by collective kind."""
    out: dict[str, int] = {}
    for kind, n, _ in comm_changes(model, run, strategy):
        out[kind] = out.get(kind, 0) + n
    return out


def _saved(model: Model, run: Run, strategy: str) -> int:
    return sum(adapter_input_bytes(model, run, "gather").values()) - sum(
        adapter_input_bytes(model, run, strategy).values())


def estimate(model: Model, run: Run, strategies=ALL_STRATEGIES) -> dict:
    """Per strategy: adapter-input bytes (dense and expert adapters), saved vs gather, extra comm
    (net by kind, and the bytes of the collectives it adds). ``…-recompute`` rows also give
    the saving for both states of the decoder input (frozen embeddings: layer 0's qkv keeps
    its shard; an input that requires grad: it recomputes too) and what recomputes."""
    out = {}
    for name in strategies:
        parts = adapter_input_bytes(model, run, name)
        changes = comm_changes(model, run, name)
        comm = extra_comm_bytes(model, run, name)
        row = {
            "adapter_input_bytes": sum(parts.values()),
            "adapter_input_by_target": parts,
            "saved_vs_gather": _saved(model, run, name),
            "extra_comm_bytes": comm,
            "extra_comm_total": sum(comm.values()),
            "added_comm_bytes": sum(n for _, n, _ in changes if n > 0),
        }
        if split_strategy(name)[1]:
            row["saved_vs_gather_frozen_input"] = _saved(model, replace(run, input_requires_grad=False), name)
            row["saved_vs_gather_input_requires_grad"] = _saved(model, replace(run, input_requires_grad=True), name)
            row.update(recompute_summary(model, run, name))
        out[name] = row
    return out


# -- command line -------------------------------------------------------------------


# The reference's measured peak-memory drops with sequence_parallel_input_regather=True
# (/work/shared/reference: Qwen3-8B TP2 seq 8192; the MoE rows state TP and EP, not their
# sequence length: 8192 here, as the issue asks), in bytes.
REFERENCE = {
    "qwen3-8b": {"tp": 2, "ep": 1, "seq": 8192, "seq_stated": True, "saved": 4_731_000_000,
                 "note": "TP2, seq 8192"},
    "qwen3-30b-a3b": {"tp": 4, "ep": 4, "seq": 8192, "seq_stated": False, "saved": 1_569_000_000,
                      "note": "TP4/EP4, seq not stated"},
    "gpt-oss-120b": {"tp": 2, "ep": 8, "seq": 8192, "seq_stated": False, "saved": 814_000_000,
                     "note": "TP2/EP8, seq not stated"},
}


def reference_for(preset: str, model: Model, run: Run) -> dict | None:
    """The reference's measurement for ``preset`` when this run has its layout (TP and EP; the
    sequence length too where the reference states it), else None (and for custom sizes)."""
    ref = REFERENCE.get(preset)
    if ref is None or model.name.endswith("(custom)") or (ref["tp"], ref["ep"]) != (run.tp, run.ep):
        return None
    if ref["seq_stated"] and ref["seq"] != run.seq:
        return None
    return ref


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB ({n / 2**30:.3f} GiB)"


def _short(reason: str) -> str:
    return reason.split(" (", 1)[0]


def _expert_lines(model: Model, run: Run) -> list[str]:
    layout = expert_layout(model, run)
    if not layout:
        return []
    adapters = ", ".join(f"{k.split('.')[1]} {v}" for k, v in layout["adapters_per_layer"].items()) or "none"
    return [f"experts: EP={run.ep} ETP={run.etp} {run.dispatcher} dispatcher, {layout['local_experts']} local "
            f"experts per layer, LoRA {run.expert_lora} (adapters per layer: {adapters})"
            + (", redispatch_expert_inputs" if run.redispatch else ""),
            f"routed rows per GPU, layer and micro-batch: R = T*k*etp = {layout['local_tokens']}*{model.topk}*"
            f"{run.etp} = {layout['routed_rows']} (mean over the EP x ETP group; exact for dropless routing)"]


def format_report(model: Model, run: Run, result: dict, reference: dict | None = None) -> str:
    eligible = eligible_per_layer(model, run)
    lines = [
        f"{model.name}: h={model.hidden}, {model.layers} layers ({layers_here(model, run)} on this GPU), "
        f"{model.heads} heads / {model.kv_heads or model.heads} kv, "
        + (f"{model.experts} experts x {model.moe_ffn} top-{model.topk}" if model.moe else f"ffn {model.ffn}"),
        f"run: TP={run.tp} SP={'on' if run.sp else 'off'} seq={run.seq} micro-batch={run.micro_batch} "
        f"in-flight={run.in_flight} PP={run.pp} {run.dtype} LoRA r={run.lora_rank} on {', '.join(run.targets)}",
        *_expert_lines(model, run),
        f"re-gather-eligible adapters per layer: {', '.join(eligible) or 'none'}",
        "decoder input: " + ("requires grad" if run.input_requires_grad else
                             "a later pipeline stage's (requires grad)" if not run.first_stage else
                             "frozen embeddings (needs no grad; --input-requires-grad: as with Bridge's "
                             "maybe_enable_recompute_inputs_grad / HF's enable_input_require_grads)"),
    ]
    if reference:
        lines.append(f"reference measured (peak-memory drop, sequence_parallel_input_regather=True, "
                     f"{reference['note']}): {_gb(reference['saved'])}")
    lines.append("")
    for name, row in result.items():
        lines.append(f"[{name}]")
        lines.append(f"  adapter-input bytes per GPU : {_gb(row['adapter_input_bytes'])}")
        experts = {k: v for k, v in row["adapter_input_by_target"].items() if k in EXPERT_TARGETS}
        if experts:
            parts = ", ".join(f"{k.split('.')[1]} {v / 1e9:.3f} GB" for k, v in experts.items())
            lines.append(f"    of which expert adapters  : {_gb(sum(experts.values()))}: {parts}")
        lines.append(f"  saved vs gather             : {_gb(row['saved_vs_gather'])}")
        if "saved_vs_gather_frozen_input" in row:
            frozen, grad = row["saved_vs_gather_frozen_input"], row["saved_vs_gather_input_requires_grad"]
            if frozen != grad:
                this = "input requires grad" if row["saved_vs_gather"] == grad else "frozen embeddings"
                lines.append(f"    frozen embeddings        : {_gb(frozen)}"
                             f"{'  <- this run' if this == 'frozen embeddings' else ''}")
                lines.append(f"    input requires grad      : {_gb(grad)}"
                             f"{'  <- this run' if this != 'frozen embeddings' else ''}")
            done = ", ".join(f"{k} {v}" for k, v in row["recomputed_by_target"].items()) or "none"
            lines.append(f"  inputs recomputed           : {done}")
            for why, n in row["kept_by_reason"].items():
                lines.append(f"    kept: {n} x {_short(why)}")
        comm = row["extra_comm_bytes"]
        if comm:
            kinds = ", ".join(f"{k} {v / 2**20:+,.1f} MiB" for k, v in comm.items())
            lines.append(f"  extra comm per micro-batch  : {row['extra_comm_total'] / 2**20:+,.1f} MiB net ({kinds});"
                         f" new collectives {row['added_comm_bytes'] / 2**20:,.1f} MiB")
        else:
            lines.append("  extra comm per micro-batch  : 0")
    return "\n".join(lines)


def _targets(value: str) -> tuple:
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [n for n in names if n not in ALL_TARGETS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown targets {bad}; expected some of {', '.join(ALL_TARGETS)}")
    return names


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "estimate", help="analytic LoRA-A input memory and extra communication per strategy",
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default="qwen3-8b", help="preset (custom sizes override)")
    for flag in ("hidden", "ffn", "layers", "heads", "kv-heads", "head-dim", "experts", "moe-ffn", "topk"):
        p.add_argument(f"--{flag}", type=int, default=None)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--no-sp", dest="sp", action="store_false", help="sequence parallelism off")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--in-flight", type=int, default=1, help="micro-batches alive at once")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (layers per GPU = layers/pp)")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE)")
    p.add_argument("--etp", type=int, default=1, help="expert tensor parallel size (MoE)")
    p.add_argument("--expert-lora", choices=EXPERT_LORA, default="shared",
                   help="shared: one LoRA pair for a layer's local experts (grouped experts, share_expert_adapters="
                        "True, Bridge's default); per-expert: one per expert (SequentialMLP, or "
                        "share_expert_adapters=False)")
    p.add_argument("--redispatch-expert-inputs", dest="redispatch", action="store_true",
                   help="LoRA(redispatch_expert_inputs=True): per-expert fc1 inputs are dispatched again in "
                        "backward (with a -recompute strategy)")
    p.add_argument("--dispatcher", choices=DISPATCHERS, default="alltoall", help="moe_token_dispatcher_type")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16")
    p.add_argument("--grad-dtype", choices=sorted(DTYPE_BYTES), default=None,
                   help="LoRA-A gradient dtype for lowrank's dA all-reduce (default: --dtype; "
                        "float32 with gradient-accumulation fusion)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--targets", type=_targets, default=",".join(ALL_TARGETS))
    p.add_argument("--strategies", default=",".join(ALL_STRATEGIES),
                   help="some of " + ", ".join(ALL_STRATEGIES) + " (-recompute: recompute_adapter_inputs=True)")
    p.add_argument("--input-requires-grad", action="store_true",
                   help="the decoder input requires grad (Bridge's maybe_enable_recompute_inputs_grad, HF's "
                        "enable_input_require_grads): layer 0's linear_qkv recomputes too")
    p.add_argument("--later-stage", dest="first_stage", action="store_false",
                   help="this GPU is a later pipeline stage (its input comes from p2p and requires grad)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=main)


def model_from_args(args) -> Model:
    model = PRESETS[args.model]
    custom = {k: getattr(args, k) for k in ("hidden", "ffn", "layers", "heads", "kv_heads", "head_dim",
                                            "experts", "moe_ffn", "topk") if getattr(args, k) is not None}
    return replace(model, name=model.name + (" (custom)" if custom else ""), **custom)


def main(args) -> int:
    import json

    model = model_from_args(args)
    run = Run(tp=args.tp, sp=args.sp, seq=args.seq, micro_batch=args.micro_batch, in_flight=args.in_flight,
              pp=args.pp, dtype=args.dtype, grad_dtype=args.grad_dtype, lora_rank=args.lora_rank,
              targets=tuple(args.targets) if not isinstance(args.targets, str) else _targets(args.targets),
              first_stage=args.first_stage, input_requires_grad=args.input_requires_grad,
              ep=args.ep, etp=args.etp, expert_lora=args.expert_lora, redispatch=args.redispatch,
              dispatcher=args.dispatcher)
    strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    unknown = [s for s in strategies if s not in ALL_STRATEGIES]
    if unknown:
        raise SystemExit(f"regather estimate: unknown strategies {unknown}; expected some of {ALL_STRATEGIES}")
    try:
        result = estimate(model, run, strategies)
    except ValueError as exc:  # sizes that do not divide: say which
        raise SystemExit(f"regather estimate: {exc}") from None
    ref = reference_for(args.model, model, run)
    if args.json:
        print(json.dumps({"model": asdict(model), "run": asdict(run), "experts": expert_layout(model, run),
                          "strategies": result, "reference_saved": ref}, indent=1))
    else:
        print(format_report(model, run, result, ref))
    return 0
