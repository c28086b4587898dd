"""``regather estimate``'s expert terms: what a MoE layer's expert adapters keep, and what rebuilding their inputs sends.

**Expert rows** (MoE layers: ``k`` = top-k, ``p`` = EP, ``et`` = expert TP, ``f_moe`` =
``moe_ffn``), per layer and micro-batch, the same for every strategy (experts never re-gather):

======================= ===================== =============================
adapter                 gather                regather / lowrank
======================= ===================== =============================
expert fc1 (per layer)  ``R*h*e``             same (experts never re-gather)
expert fc2 (per layer)  ``R*f_moe/et*e``      same
======================= ===================== =============================

A GPU routes ``T = s*b/t`` local tokens per micro-batch (its sequence shard;
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

**Recompute** (``<strategy>-recompute``): which expert adapters rebuild their input (0 bytes):

======================= ============================================================
adapter                 recomputes when
======================= ============================================================
expert fc2              every strategy, when fc1's output requires grad (the experts'
                        activation x probs, SequentialMLP or TEGroupedMLP)
expert fc1, shared      every strategy, when the router's input requires grad: LoRA-A
LoRA-A                  runs before the dispatch (``regather.megatron.reasons.PREDISPATCH``)
expert fc1, per-expert  every strategy, with ``redispatch`` (``LoRA(redispatch_expert_
LoRA-A                  inputs=True)``) and when the router's input requires grad: it is
                        dispatched again in backward (``regather.megatron.reasons.REDISPATCH``);
                        without the opt-in: kept (``regather.megatron.reasons.REDISPATCH_OPT_IN``)
======================= ============================================================

The router's input is ``pre_mlp_layernorm``'s output, which requires grad exactly when the
norm's input does (the fc1 entry of
:func:`~regather.tools.estimate.config.producer_inputs_need_grad`); when it does not, the router
keeps nothing and layer 0's expert fc1 adapters keep their input (``ROUTER_KEEPS_NOTHING``).

**Communication.** An expert fc1 input rebuilt from the router's input sends
(:func:`expert_comm_changes`), per MoE layer whose expert fc1 recomputes, whatever the strategy
(experts always run the gather path), as the same mean over the EP x ETP group (``w = e``,
``g = p*et``, ``R = T*k*et``, ``f_p, f_e, f_g`` = ``(p-1)/p``, ``(et-1)/et``, ``(g-1)/g``):

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
"""

from __future__ import annotations

from dataclasses import replace

from regather.core.recompute.reasons import NOTHING_KEPT
from regather.megatron.reasons import PREDISPATCH, REDISPATCH, REDISPATCH_OPT_IN, ROUTER_KEEPS_NOTHING
from regather.tools.estimate.config import (
    AdapterInput,
    Model,
    Run,
    check_run,
    checkpointed_layers,
    checkpointed_target,
    expert_lora,
    needs_grad,
    recompute_modules,
    ring,
    split_strategy,
)
from regather.tools.shapes import experts_share_lora

EXPERTS_ACTIVATION = "the experts' activation"  # the producer of an expert fc2 input


def local_tokens(run: Run) -> int:
    """``T``: the tokens of one micro-batch a GPU routes — its sequence shard ``s*b/t`` (SP on;
    ``s*b`` at TP 1)."""
    return run.local_seq * run.micro_batch // (run.tp if run.sp else 1)


def routed_rows(model: Model, run: Run) -> int:
    """``R = T*k*et``: the routed rows a GPU's experts read per MoE layer and micro-batch, as the
    mean over the EP x ETP group (exact for dropless routing, see the module doc)."""
    return local_tokens(run) * model.topk * run.etp


def expert_adapters_per_layer(model: Model, run: Run) -> int:
    """LoRA pairs per expert linear in one MoE layer on this GPU: 1 shared by the ``experts/ep``
    local experts, or one per local expert."""
    return 1 if experts_share_lora(model, run) else model.num_experts // run.ep


def expert_layout(model: Model, run: Run) -> dict:
    """What one MoE layer holds on this GPU: local experts, adapters per expert linear targeted,
    local tokens ``T`` and routed rows ``R`` per micro-batch ({} for a dense model)."""
    check_run(model, run)
    if not model.moe:
        return {}
    n = expert_adapters_per_layer(model, run)
    return {"local_experts": model.num_experts // run.ep, "expert_lora": expert_lora(model, run),
            "adapters_per_layer": {f"experts.{t}": n for t in ("linear_fc1", "linear_fc2") if t in run.targets},
            "local_tokens": local_tokens(run), "routed_rows": routed_rows(model, run),
            "ep": run.ep, "etp": run.etp, "dispatcher": model.dispatcher}


def expert_fc1_source(shared: bool, redispatch: bool, router_input_needs_grad: bool
                      ) -> tuple[str | None, str | None]:
    """Under ``recompute_adapter_inputs``: ``(producer, None)`` when a MoE layer's expert fc1
    adapters rebuild their input from the router's input, ``(None, reason)`` when they keep it —
    the sentences of :mod:`regather.megatron.moe.inputs`, in the adapters' order: a per-expert LoRA-A
    without ``redispatch_expert_inputs`` first (it gets no producer), then a router whose input
    needs no gradient (it keeps nothing). Checkpoint and configuration refusals (selective
    ``moe`` recompute, the flex dispatcher, fp8, ...) are :mod:`regather.tools.doctor`'s."""
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
    shared = experts_share_lora(model, run)
    layers = []
    for need_grad in needs_grad(model, run):
        row = []
        if "linear_fc1" in run.targets:
            kept = rows * model.hidden * e
            producer, why = (expert_fc1_source(shared, run.redispatch_expert_inputs, need_grad["linear_fc1"])
                             if recompute else (None, None))
            row.append(AdapterInput("experts.linear_fc1", 0 if producer else kept, producer, why, n))
        if "linear_fc2" in run.targets:
            kept = rows * (model.moe_ffn // run.etp) * e
            if not recompute:
                row.append(AdapterInput("experts.linear_fc2", kept, adapters=n))
            elif not need_grad["linear_fc2"]:
                row.append(AdapterInput("experts.linear_fc2", kept, adapters=n,
                                        kept_because=f"{EXPERTS_ACTIVATION}: {NOTHING_KEPT}"))
            else:
                row.append(AdapterInput("experts.linear_fc2", 0, recomputed_from=EXPERTS_ACTIVATION, adapters=n))
        # LoRA-B's rank-r input, [R, r] for the layer's routed rows (every strategy: experts take the dispatched
        # path); inside a checkpoint (full recompute, selective "moe") nothing is kept after the forward
        row = [replace(a, mid_bytes=rows * run.lora_rank * e) for a in row]
        layers.append(row)
    full = checkpointed_layers(model, run)
    if not any(full) and "moe" not in recompute_modules(run):
        return layers
    plain = replace(run, recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                    recompute_modules=())
    gather = expert_inputs(model, plain, "gather")
    return [[AdapterInput(a.target, 0, adapters=a.adapters, checkpointed_bytes=g.kept_bytes + g.mid_bytes)
             if checkpointed_target(model, run, full[i], a.target) else a for a, g in zip(row, gather[i])]
            for i, row in enumerate(layers)]


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
    if model.dispatcher == "alltoall":
        out = [("all_to_all", 2 * ring(T * k * r * w, p),
                "shared expert LoRA-A output (r wide) along the tokens' route and back")]
        if et > 1:
            rows = ring(T * k * et * r * w, et)
            out += [("all_gather", rows, "the route's expert-TP gather of the r-wide rows"),
                    ("reduce_scatter", rows, "the reverse route's expert-TP reduce-scatter of dmid")]
    else:
        g = p * et
        rows = ring(T * g * r * w, g)
        out = [("all_gather", rows, "shared expert LoRA-A output (r wide) gathered over EP x expert TP (the route)"),
               ("reduce_scatter", rows, "its dmid reduce-scattered back (the reverse route)")]
    if et > 1:
        a, mid = ring(r * h * w, et), ring(routed_rows(model, run) * r * w, et)
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
    if model.dispatcher == "alltoall":
        out = [("all_to_all", ring(T * k * h * w, p), "backward: the router's input dispatched again "
                                                       "(per-expert LoRA-A)")]
        if et > 1:
            out.append(("all_gather", ring(T * k * et * h * w, et), "backward: its expert-TP gather"))
        return out
    g = p * et
    return [("all_gather", ring(T * g * h * w, g), "backward: the router's input gathered again over EP x "
                                                    "expert TP (per-expert LoRA-A)")]


def expert_comm_changes(model: Model, run: Run, strategy: str) -> list[tuple[str, int, str]]:
    """:func:`predispatch_comm` / :func:`redispatch_comm` summed over the MoE layers of this GPU
    whose expert fc1 input comes from the router's input under ``strategy`` (empty without
    recompute). The first forward's one-time route check is not per micro-batch: not counted."""
    sources = [a.recomputed_from for row in expert_inputs(model, run, strategy) for a in row
               if a.target == "experts.linear_fc1"]
    out = []
    for per_layer, source in ((predispatch_comm, PREDISPATCH), (redispatch_comm, REDISPATCH)):
        layers = sources.count(source)
        if layers:
            out += [(kind, layers * n, what) for kind, n, what in per_layer(model, run) if n]
    return out
