"""``regather doctor``'s byte findings: what this run's adapters keep for LoRA-A against the gather path, and
what re-dispatch would free.

The bytes are :mod:`regather.tools.estimate`'s, adapter by adapter: for each adapter the doctor's decision
picks the estimate row of the strategy it uses (``-recompute`` where its input is rebuilt) in its layer
(:func:`regather.tools.estimate.adapter_inputs`, on the setup's spec: ``te`` or ``local``), against the gather
path's row; a MoE layer whose expert fc1 / fc2 adapters recompute frees
:func:`regather.tools.estimate.expert_inputs`' exact bytes (``R*h*e`` / ``R*(moe_ffn/ETP)*e``, ``R = T*k*ETP``
routed rows: the mean over the EP x ETP group). Where every decision is the one estimate models, the total is
``regather estimate``'s ``saved vs gather`` for the same strategy and arguments, byte for byte (tested).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from regather.megatron.reasons import REDISPATCH_OPT_IN, REPLAYED_DISPATCHERS
from regather.tools.doctor.rules import analytic_decisions
from regather.tools.doctor.setup import Finding, Setup
from regather.tools.shapes import ModelShape, RunShape, shape_fields

# where doctor says its byte counts come from (its output names the function: keep the text)
_ESTIMATE = "regather.tools.estimate"
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def expert_estimate(setup: Setup):
    """``(Model, Run)`` for :mod:`regather.tools.estimate` from this setup's shapes, spec and attention
    (a flex dispatcher: the alltoall one, for bytes, which do not depend on it)."""
    from regather.tools import estimate as est

    model = est.Model(name=setup.model_name, **shape_fields(ModelShape, setup),
                      gated_mlp=setup.activation == "swiglu", qk_norm=setup.qk_norm)
    if model.dispatcher not in REPLAYED_DISPATCHERS:
        model = dataclasses.replace(model, dispatcher="alltoall")
    from regather.tools.estimate.options import BRIDGE_FULL_RECOMPUTE

    full = setup.recompute_granularity == "full"  # a Setup that names no method / layer count: Bridge's
    return model, est.Run(**shape_fields(RunShape, setup), spec=setup.spec,
                          attention_keeps_output=setup.attention_keeps_output, te_version=setup.te_version,
                          cp=setup.cp, recompute_granularity=setup.recompute_granularity,
                          recompute_method=setup.recompute_method or (BRIDGE_FULL_RECOMPUTE[0] if full else None),
                          recompute_num_layers=setup.recompute_num_layers or (
                              BRIDGE_FULL_RECOMPUTE[1] if full else None),
                          recompute_modules=tuple(setup.recompute_modules))


def _variant(d: Mapping) -> str:
    """The estimate row an adapter's decision reads: the strategy it uses, ``-recompute`` when its input
    is rebuilt."""
    from regather.tools.estimate import RECOMPUTE

    return d["used"] + (RECOMPUTE if d.get("recompute") else "")


def dense_bytes(setup: Setup, decisions: Mapping[str, Mapping]) -> dict[str, tuple[int, int]]:
    """Per dense adapter (not an expert's): ``(bytes the gather path keeps, bytes this decision keeps)``
    for LoRA-A per GPU, all micro-batches in flight (:func:`regather.tools.estimate.adapter_inputs`)."""
    from regather.tools.estimate import adapter_inputs

    model, run = expert_estimate(setup)
    rows: dict[str, list] = {}

    def kept(variant: str, layer: int, target: str) -> int:
        if variant not in rows:
            rows[variant] = adapter_inputs(model, run, variant)
        return next((a.kept_bytes for a in rows[variant][layer] if a.target == target), 0) * setup.in_flight

    out = {}
    for path, d in decisions.items():
        if is_expert(setup, path):
            continue
        layer, target = int(_LAYER.search(path).group(1)), path.rsplit(".", 1)[-1]
        out[path] = kept("gather", layer, target), kept(_variant(d), layer, target)
    return out


def is_expert(setup: Setup, path: str) -> bool:
    """An expert linear's adapter (a MoE layer's fc1/fc2, not a shared expert's)."""
    return setup.moe and path.rsplit(".", 1)[-1] in ("linear_fc1", "linear_fc2") and ".shared_experts." not in path


def moe_layer(path: str) -> str:
    """The MoE layer an expert adapter's path belongs to (SequentialMLP's experts share it)."""
    return re.sub(r"\.local_experts\.\d+", "", path).rsplit(".", 1)[0]


def expert_layer_bytes(setup: Setup) -> dict[str, int]:
    """One MoE layer's expert adapter inputs per GPU, by linear, all micro-batches in flight
    (:func:`regather.tools.estimate.expert_inputs` on the gather path: fc1 ``R*h*e``, fc2
    ``R*(moe_ffn/ETP)*e``, ``R = T*k*ETP`` routed rows, the EP x ETP group's mean)."""
    from regather.tools import estimate as est

    model, run = expert_estimate(setup)
    (row,) = est.expert_inputs(dataclasses.replace(model, layers=1), dataclasses.replace(run, pp=1), "gather")
    return {a.target.split(".", 1)[1]: a.kept_bytes * setup.in_flight for a in row}


def _recomputing_expert_layers(setup: Setup, decisions: Mapping[str, Mapping], name: str) -> set:
    return {moe_layer(p) for p, d in decisions.items()
            if d.get("recompute") and is_expert(setup, p) and p.endswith(name)}


def _expert_saving(setup: Setup, decisions: Mapping[str, Mapping]) -> tuple[dict[str, int], str]:
    """Bytes the recomputing expert adapters free, by linear (``linear_fc1`` / ``linear_fc2``: per MoE layer
    whose adapters recompute, :func:`expert_layer_bytes`), and how."""
    from regather.tools.estimate import routed_rows

    layers = {n: len(_recomputing_expert_layers(setup, decisions, n)) for n in ("linear_fc1", "linear_fc2")}
    if not any(layers.values()):
        return {}, ""
    try:
        per, rows = expert_layer_bytes(setup), routed_rows(*expert_estimate(setup))
    except ValueError as exc:  # a layout estimate refuses: say so instead of guessing
        return {}, (f"expert fc1 inputs recomputed in {layers['linear_fc1']} MoE layer(s) and fc2 inputs in "
                    f"{layers['linear_fc2']}, not counted: {exc}")
    freed = {name: n * per.get(name, 0) for name, n in layers.items()}
    return freed, (f"{layers['linear_fc1']} MoE layer(s) of expert fc1 inputs x {per.get('linear_fc1', 0):,} bytes "
                   f"(R*h*e) + {layers['linear_fc2']} of expert fc2 inputs x {per.get('linear_fc2', 0):,} bytes "
                   f"(R*moe_ffn/ETP*e), R = T*k*ETP = {rows} routed rows per GPU (mean over the EP x ETP group)")


def savings(setup: Setup, decisions: Mapping[str, Mapping]) -> dict:
    """What this run's adapters keep for LoRA-A per GPU against the gather path: ``gather`` and ``kept``
    bytes in all, ``by_kind`` (``{kind: {"adapters", "gather", "saved"}}``, kinds ``linear_qkv`` ...
    and ``experts.linear_fc1`` / ``experts.linear_fc2``), ``per_adapter`` (dense adapters: path ->
    saved bytes) and ``experts_note`` (how the expert bytes were counted, or why they were not)."""
    from regather.tools.estimate import adapter_input_bytes

    by_kind: dict[str, dict] = {}
    per_adapter = {}
    try:
        dense = dense_bytes(setup, decisions)
    except ValueError as exc:  # a layout estimate refuses (the command refuses it before): say so, count nothing
        return {"gather": 0, "kept": 0, "saved": 0, "by_kind": {}, "per_adapter": {}, "experts_note": "",
                "refused": str(exc)}
    for path, (gather, kept) in dense.items():
        kind = by_kind.setdefault(path.rsplit(".", 1)[-1], {"adapters": 0, "gather": 0, "saved": 0})
        kind["adapters"] += 1
        kind["gather"] += gather
        kind["saved"] += gather - kept
        per_adapter[path] = gather - kept
    note = ""
    if setup.moe:
        try:
            gathered = adapter_input_bytes(*expert_estimate(setup), "gather")
        except ValueError as exc:  # a layout estimate refuses: say so instead of guessing
            gathered, note = {}, f"expert inputs not counted: {exc}"
        freed, how = _expert_saving(setup, decisions) if gathered else (0, "")
        note = note or how
        for kind in ("experts.linear_fc1", "experts.linear_fc2"):
            if kind in gathered:
                name = kind.split(".", 1)[1]
                paths = [p for p in decisions if is_expert(setup, p) and p.endswith(name)]
                by_kind[kind] = {"adapters": len(paths), "gather": gathered[kind], "saved": freed.get(name, 0)}
    gather = sum(k["gather"] for k in by_kind.values())
    saved = sum(k["saved"] for k in by_kind.values())
    return {"gather": gather, "kept": gather - saved, "saved": saved, "by_kind": by_kind, "per_adapter": per_adapter,
            "experts_note": note, "refused": None}


def gb(n: int) -> str:
    """Bytes as ``regather estimate`` prints them (decimal GB and GiB); under 10 MB (the tiny GPT's) as bytes
    and KiB, which GB would round to 0."""
    from regather.tools.estimate.report import gb as estimate_gb

    return estimate_gb(n) if abs(n) >= 10**7 else f"{n:,} bytes ({n / 1024:,.2f} KiB)"


def saving_finding(setup: Setup, decisions: Mapping[str, Mapping]) -> Finding:
    """The bytes :func:`savings` counts, by adapter kind, with how they were counted."""
    s = savings(setup, decisions)
    if s["refused"]:
        return Finding("saving", "info", f"LoRA-A input bytes not estimated: {s['refused']}")
    kinds = ", ".join(f"{kind} {k['saved']:,} ({k['adapters']} adapter(s))" for kind, k in s["by_kind"].items()
                      if k["saved"])
    big = f" = {gb(s['saved'])}" if s["saved"] >= 10**7 else ""
    text = (f"estimated LoRA-A input memory saved per GPU: {s['saved']:,} bytes{big}, of "
            f"{s['gather']:,} bytes the gather path keeps" + (f"; by kind: {kinds}" if kinds else "")
            + (f"; {s['experts_note']}" if s["experts_note"] else ""))
    if setup.recompute_adapter_inputs:
        kept = sum(1 for d in decisions.values() if d.get("recompute_reason"))
        text += f"; {kept} adapter(s) keep their input"
    return Finding(
        "saving", "info",
        f"{text} [{_ESTIMATE}.adapter_inputs per adapter, {setup.spec} spec; s={setup.seq}, b={setup.micro_batch}, "
        f"h={setup.hidden}, ffn={setup.ffn}, t={setup.tp}, {setup.dtype}, {setup.in_flight} micro-batch(es) in flight]",
    )


def redispatch_finding(setup: Setup, decisions: Mapping[str, Mapping]) -> Finding | None:
    """Per-expert expert fc1 adapters that keep the dispatched tokens under recompute only because
    ``LoRA(redispatch_expert_inputs=True)`` is off (with it on, the rules recompute them): what
    re-dispatch frees (:func:`expert_layer_bytes`, fc1) and sends — one more dispatch of the
    tokens per MoE layer in backward (:func:`regather.tools.estimate.redispatch_comm`)."""
    if not (setup.moe and setup.recompute_adapter_inputs) or setup.redispatch_expert_inputs:
        return None
    from regather.tools.estimate import redispatch_comm

    blocked = [p for p, d in decisions.items() if d.get("recompute_reason") == REDISPATCH_OPT_IN]
    if not blocked:
        return None
    opted_in = dataclasses.replace(setup, redispatch_expert_inputs=True)
    layers = _recomputing_expert_layers(opted_in, {p: d for p, d in analytic_decisions(opted_in).items()
                                                   if p in blocked}, "linear_fc1")
    if not layers:
        return None
    head = (f"{len(blocked)} per-expert linear_fc1 adapter(s) in {len(layers)} MoE layer(s) keep the dispatched "
            "tokens under recompute_adapter_inputs only because re-dispatch is off")
    try:
        freed = len(layers) * expert_layer_bytes(setup)["linear_fc1"]
        sends = [(kind, len(layers) * n) for kind, n, _ in redispatch_comm(*expert_estimate(opted_in)) if n]
    except ValueError as exc:
        message = f"{head} (bytes not estimated: {exc})"
    else:
        cost = ", ".join(f"{kind} {n:,}" for kind, n in sends) or "nothing crosses ranks at EP = ETP = 1"
        message = (f"{head}: re-dispatch would free {freed:,} bytes per GPU ({len(layers)} x R*h*e, all "
                   f"micro-batches in flight) for one more dispatch of the tokens per MoE layer in backward, "
                   f"{sum(n for _, n in sends):,} bytes received per GPU and micro-batch ({cost}; "
                   f"{_ESTIMATE}, mean over the EP x ETP group)")
    return Finding("redispatch-available", "info", message,
                   "LoRA(redispatch_expert_inputs=True) (doctor: --redispatch-expert-inputs); grouped experts with "
                   "share_expert_adapters=True need no re-dispatch (their shared LoRA-A runs before the dispatch)")
