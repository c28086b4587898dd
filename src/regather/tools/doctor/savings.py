"""``regather doctor``'s byte findings: what re-gathering and recompute save, and what re-dispatch would free.

The saving uses :func:`regather.tools.estimate.adapter_input_bytes` (``s*b*h*e`` on
the gather path against ``s*b*h*e/t`` when re-gathering, i.e.
``s*b*h*e*(t-1)/t`` per adapter and micro-batch in flight), counted only for
the adapters whose decision is not the gather path; plus, per recomputing adapter,
its ``x_local`` (qkv/fc1) or its input ``s*b*ffn/t*e`` (fc2); plus, per MoE layer whose
expert fc1 / fc2 adapters recompute, :func:`regather.tools.estimate.expert_inputs`' exact bytes
(``R*h*e`` / ``R*(moe_ffn/ETP)*e``, ``R = T*k*ETP`` routed rows: the mean over the EP x ETP group).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from regather.megatron.reasons import ELIGIBLE_BASES, REDISPATCH_OPT_IN, REPLAYED_DISPATCHERS
from regather.tools.doctor.rules import analytic_decisions
from regather.tools.doctor.setup import Finding, Setup
from regather.tools.shapes import DTYPE_BYTES, ModelShape, RunShape, shape_fields

# where doctor says its byte counts come from (its output names the function: keep the text)
_ESTIMATE = "regather.tools.estimate"


def expert_estimate(setup: Setup):
    """``(Model, Run)`` for :mod:`regather.tools.estimate` from this setup's shapes (a flex dispatcher:
    the alltoall one, for bytes, which do not depend on it)."""
    from regather.tools import estimate as est

    model = est.Model(name="doctor", **shape_fields(ModelShape, setup))
    if model.dispatcher not in REPLAYED_DISPATCHERS:
        model = dataclasses.replace(model, dispatcher="alltoall")
    return model, est.Run(**shape_fields(RunShape, setup))


def _dense_estimate(setup: Setup, target: str):
    """``(Model, Run)`` of one dense layer with one adapter on ``target``."""
    model, run = expert_estimate(setup)
    return (dataclasses.replace(model, layers=1, num_experts=0),
            dataclasses.replace(run, targets=(target,), pp=1, ep=1, etp=1, input_requires_grad=False))


def per_adapter_saving(setup: Setup, target: str = "linear_qkv") -> tuple[int, str]:
    """Bytes one re-gathering adapter saves per GPU (all micro-batches in flight), and how it was computed."""
    try:
        from regather.tools import estimate as est
    except ImportError:
        est = None
    t, e = setup.tp, DTYPE_BYTES[setup.dtype]
    if est is not None:
        model, run = _dense_estimate(setup, target)
        saved = est.adapter_input_bytes(model, run, "gather")[target] - est.adapter_input_bytes(
            model, run, "regather")[target]
        return saved, f"{_ESTIMATE}.adapter_input_bytes (gather minus regather)"
    saved = setup.seq * setup.micro_batch * setup.hidden * e * (t - 1) // t * setup.in_flight
    return saved, f"s*b*h*e*(t-1)/t per adapter and micro-batch in flight ({_ESTIMATE} not available)"


def _bytes_of(setup: Setup, target: str, strategy: str) -> int:
    """One adapter's kept input bytes per GPU (all micro-batches in flight) under ``strategy``."""
    from regather.tools import estimate as est

    return est.adapter_input_bytes(*_dense_estimate(setup, target), strategy).get(target, 0)


def is_expert(setup: Setup, path: str) -> bool:
    """An expert linear's adapter (a MoE layer's fc1/fc2, not a shared expert's)."""
    return setup.moe and path.rsplit(".", 1)[-1] in ("linear_fc1", "linear_fc2") and ".shared_experts." not in path


def _moe_layer(path: str) -> str:
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
    return {_moe_layer(p) for p, d in decisions.items()
            if d.get("recompute") and is_expert(setup, p) and p.endswith(name)}


def _expert_saving(setup: Setup, decisions: Mapping[str, Mapping]) -> tuple[int, str]:
    """Bytes the recomputing expert adapters free, per MoE layer and linear, and how."""
    from regather.tools.estimate import routed_rows

    layers = {n: len(_recomputing_expert_layers(setup, decisions, n)) for n in ("linear_fc1", "linear_fc2")}
    if not any(layers.values()):
        return 0, ""
    try:
        per, rows = expert_layer_bytes(setup), routed_rows(*expert_estimate(setup))
    except ValueError as exc:  # a layout estimate refuses: say so instead of guessing
        return 0, (f"; expert fc1 inputs recomputed in {layers['linear_fc1']} MoE layer(s) and fc2 inputs in "
                   f"{layers['linear_fc2']}, not counted: {exc}")
    total = sum(n * per.get(name, 0) for name, n in layers.items())
    return total, (f" + {layers['linear_fc1']} MoE layer(s) of expert fc1 inputs x {per.get('linear_fc1', 0):,} bytes "
                   f"(R*h*e) + {layers['linear_fc2']} of expert fc2 inputs x {per.get('linear_fc2', 0):,} bytes "
                   f"(R*moe_ffn/ETP*e), R = T*k*ETP = {rows} routed rows per GPU (mean over the EP x ETP group)")


def saving_finding(setup: Setup, decisions: Mapping[str, Mapping]) -> Finding:
    """Re-gathering adapters save x_full - x_local each; with recompute_adapter_inputs, a
    recomputing qkv/fc1 adapter saves its x_local too (x_full in all), a recomputing fc2
    adapter its input ``s*b*ffn/t*e``, and each MoE layer whose expert adapters recompute its
    expert inputs (:func:`expert_layer_bytes`) — regather.tools.estimate's bytes."""
    local = [p for p, d in decisions.items() if d["used"] != "gather"]
    per, how = per_adapter_saving(setup)
    total = per * len(local)
    text = (f"estimated LoRA-A input memory saved per GPU: {{total}} = {len(local)} re-gathering adapter(s) x "
            f"{per:,} bytes")
    recomputing = [p for p, d in decisions.items() if d.get("recompute") and not is_expert(setup, p)]
    col = [p for p in recomputing if p.rsplit(".", 1)[-1] in ELIGIBLE_BASES]
    fc2 = [p for p in recomputing if p.rsplit(".", 1)[-1] == "linear_fc2"]
    if setup.recompute_adapter_inputs:
        x_local = _bytes_of(setup, "linear_qkv", "regather")
        fc2_in = _bytes_of(setup, "linear_fc2", "gather")
        total += len(col) * x_local + len(fc2) * fc2_in
        kept = sum(1 for d in decisions.values() if d.get("recompute_reason"))
        text += (f" + {len(col)} recomputed qkv/fc1 input(s) x {x_local:,} bytes (x_local) + {len(fc2)} recomputed "
                 f"fc2 input(s) x {fc2_in:,} bytes (s*b*ffn/t*e)")
        experts, expert_text = _expert_saving(setup, decisions)
        total += experts
        text += f"{expert_text}; {kept} adapter(s) keep their input"
    text = text.replace("{total}", f"{total:,} bytes ({total / 2**30:.3f} GiB)")
    return Finding(
        "saving", "info",
        f"{text} [{how}; s={setup.seq}, b={setup.micro_batch}, h={setup.hidden}, ffn={setup.ffn}, t={setup.tp}, "
        f"{setup.dtype}, {setup.in_flight} micro-batch(es) in flight]",
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
