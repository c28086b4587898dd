"""``regather doctor``'s summary: what the run saves per adapter kind, and why the rest saves nothing.

The adapters' decisions are grouped by kind (``linear_qkv`` ... ``experts.linear_fc2``) and by what they
decided (:func:`regather.tools.doctor.findings.describe`), each group with its layers, its count and the
bytes it saves (:func:`regather.tools.doctor.savings.savings`). The total is set beside ``regather
estimate``'s for the same strategy and arguments: equal where every decision is one estimate models,
otherwise the difference is named (adapters that fall back here: CUDA graphs, activation checkpoints,
offloading, ...). Every adapter's own line is behind ``--verbose``.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping

from regather.megatron.reasons import ALL_TARGETS
from regather.tools.cmdline import WIDTH
from regather.tools.doctor.findings import describe, fix_for
from regather.tools.doctor.savings import expert_estimate, expert_layer_bytes, gb, is_expert, moe_layer, savings
from regather.tools.doctor.setup import Setup

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _layers(paths) -> str:
    """``0``, ``1-35``, ``0, 2, 4``: the layers of these adapters' paths, as ranges."""
    nums = sorted({int(_LAYER.search(p).group(1)) for p in paths})
    runs, start = [], None
    for i, n in enumerate(nums):
        start = n if start is None else start
        if i + 1 == len(nums) or nums[i + 1] != n + 1:
            runs.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(runs)


def estimate_variant(setup: Setup) -> str:
    """The ``regather estimate`` strategy this setup asks for (``regather-recompute`` ...)."""
    from regather.tools.estimate import RECOMPUTE

    return setup.strategy + (RECOMPUTE if setup.recompute_adapter_inputs else "")


def groups(setup: Setup, decisions: Mapping[str, Mapping]) -> list[dict]:
    """Per adapter kind and decision: ``kind``, ``decision`` (its text), ``adapters``, ``layers`` (where a
    kind decides more than one way), ``saved`` bytes and ``fix`` (or None), in the order of the targets."""
    s = savings(setup, decisions)
    expert_per_layer = expert_layer_bytes(setup) if setup.moe and any(
        d.get("recompute") for p, d in decisions.items() if is_expert(setup, p)) else {}
    grouped: dict[tuple, list] = {}
    for path, d in decisions.items():
        name = path.rsplit(".", 1)[-1]
        kind = f"experts.{name}" if is_expert(setup, path) else name
        grouped.setdefault((kind, describe(d)), []).append(path)
    kinds = ALL_TARGETS + tuple(f"experts.{n}" for n in ("linear_fc1", "linear_fc2"))
    order = {k: i for i, k in enumerate(kinds)}
    per_kind: dict[str, int] = {}
    for kind, _ in grouped:
        per_kind[kind] = per_kind.get(kind, 0) + 1
    out = []
    for (kind, decision), paths in sorted(grouped.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1])):
        d = decisions[paths[0]]
        if kind.startswith("experts."):
            layers = {moe_layer(p) for p in paths}
            saved = len(layers) * expert_per_layer.get(kind.split(".", 1)[1], 0) if d.get("recompute") else 0
        else:
            saved = sum(s["per_adapter"][p] for p in paths)
        out.append({"kind": kind, "decision": decision, "adapters": len(paths), "saved": saved, "fix": fix_for(d),
                    "layers": _layers(paths) if per_kind[kind] > 1 else ""})  # a kind split: which layers
    return out


def summary(setup: Setup, decisions: Mapping[str, Mapping]) -> dict:
    """:func:`savings`, the :func:`groups`, and ``regather estimate``'s saving for the same strategy and
    arguments (``estimate``: ``{"strategy", "saved"}``, or ``{"strategy", "refused"}``)."""
    from regather.tools.estimate import saved_vs_gather

    s = savings(setup, decisions)
    if s["refused"]:
        raise ValueError(s["refused"])
    variant = estimate_variant(setup)
    try:
        est = {"strategy": variant, "saved": saved_vs_gather(*expert_estimate(setup), variant)}
    except ValueError as exc:
        est = {"strategy": variant, "refused": str(exc)}
    out = {"gather": s["gather"], "kept": s["kept"], "saved": s["saved"], "by_kind": s["by_kind"],
           "experts_note": s["experts_note"], "groups": groups(setup, decisions), "estimate": est}
    if setup.spec == "te" and setup.recompute_adapter_inputs:
        out["te_release"] = te_release(setup)
    out["peak"] = peak_by_strategy(setup)
    return out


#: the strategies doctor sets side by side for LoRA's kept, peak and per-GPU total
PEAK_STRATEGIES = ("gather", "regather", "lowrank")


def peak_by_strategy(setup: Setup) -> dict:
    """Per strategy (with ``-recompute`` where the setup asks for it): ``regather estimate``'s kept bytes, peak over
    the frozen model and per-GPU total for this setup (``{"refused": reason}`` where estimate refuses the layout)."""
    from regather.tools.estimate import RECOMPUTE, estimate

    names = tuple(n + (RECOMPUTE if setup.recompute_adapter_inputs else "") for n in PEAK_STRATEGIES)
    try:
        rows = estimate(*expert_estimate(setup), names, gpu_gib=setup.gpu_memory)
    except ValueError as exc:
        return {"refused": str(exc)}
    return {name: {"kept": r["lora_kept_bytes"], "peak_over_frozen": r["peak"]["peak_over_frozen"],
                   "lean": r["peak"]["lean"], "checkpoint_alive": r["peak"]["checkpoint_alive"],
                   "other_output_path": r["peak_other_output_path"]["peak_over_frozen"], "total": r["gpu"]["total"],
                   "gpu_bytes": r["gpu"]["gpu_bytes"], "fits": r["gpu"]["fits"]} for name, r in rows.items()}


def peak_lines(setup: Setup, peaks: dict) -> list[str]:
    """The per-strategy kept / peak / total lines (modelled), wrapped."""
    from regather.tools.estimate.report import gb

    if "refused" in peaks:
        return [f"LoRA's peak and the per-GPU total: not estimated ({peaks['refused']})"]
    head = (f"LoRA over the frozen model per GPU (modelled: regather estimate's for the same arguments; kept after the "
            f"forward / peak over frozen / per-GPU total against {setup.gpu_memory:g} GiB):")
    out = textwrap.wrap(head, WIDTH, subsequent_indent="    ", break_long_words=False, break_on_hyphens=False)
    if setup.recompute_granularity == "full":
        out += textwrap.wrap("full activation recompute: nothing inside a checkpointed layer is kept after the forward "
                             "(LoRA's inputs included); its adapters take the gather path in the recomputed forward, "
                             "alive until that layer's backward is done", WIDTH, initial_indent="  ",
                             subsequent_indent="      ", break_long_words=False, break_on_hyphens=False)
    for name, p in peaks.items():
        path = "lean" if p["lean"] else "classic, Bridge 0.6.2's" if name.startswith("gather") else "classic"
        inside = f", {gb(p['checkpoint_alive'])} in a checkpointed layer's backward" if p["checkpoint_alive"] else ""
        text = (f"{name} ({path} output path): kept {gb(p['kept'])}{inside}; peak {gb(p['peak_over_frozen'])} "
                f"({'classic' if p['lean'] else 'lean'}: {gb(p['other_output_path'])}); total "
                f"{p['total'] / 2**30:.2f} GiB, " + ("fits" if p["fits"] else "does NOT fit"))
        out += textwrap.wrap(text, WIDTH, initial_indent="  ", subsequent_indent="      ", break_long_words=False,
                             break_on_hyphens=False)
    return out


def te_release(setup: Setup) -> dict:
    """On the TE spec with recompute: the Transformer Engine version the release is decided for (``--te-version``,
    else the installed one, else the newest read: ``assumed``) and the run's rule's answer (``refused``: its
    reason, or None where qkv / fc1 release the ``ln_out`` TE keeps for them)."""
    from regather.tools.doctor.rules import te_release_reason
    from regather.tools.estimate.spec import TE_VERSION_DEFAULT

    return {"version": setup.te_version or TE_VERSION_DEFAULT, "assumed": setup.te_version is None,
            "refused": te_release_reason(setup)}


def lines(setup: Setup, summ: dict) -> list[str]:
    """The summary as the command prints it (wrapped at :data:`WIDTH`)."""
    after = " after the forward" if setup.recompute_granularity else ""
    out = textwrap.wrap(f"LoRA-A inputs per GPU (modelled): the gather path keeps {gb(summ['gather'])}{after}; this "
                        f"run saves {gb(summ['saved'])}", WIDTH, subsequent_indent="    ", break_long_words=False,
                        break_on_hyphens=False)
    est = summ["estimate"]
    if "refused" in est:
        out.append(f"  (regather estimate refuses this layout: {est['refused']})")
    elif est["saved"] == summ["saved"]:
        out.append(f"  = regather estimate's '{est['strategy']}' row with the same arguments")
    else:
        out.append(f"  regather estimate's '{est['strategy']}' row says {gb(est['saved'])}: estimate models no CUDA "
                   "graphs, activation checkpoints or offloading; the adapters below that save nothing fall back here")
    te = summ.get("te_release")
    if te:
        version = te["version"] + (" (none given or installed: the newest read, assumed; --te-version)"
                                   if te["assumed"] else "")
        outcome = ("qkv / fc1 keep the ln_out TE keeps for them (their lines say why)" if te["refused"] else
                   "qkv / fc1 release the ln_out TE keeps for them where they rebuild their input")
        out += textwrap.wrap(f"Transformer Engine {version}: {outcome}", WIDTH, initial_indent="  ",
                             subsequent_indent="      ", break_long_words=False, break_on_hyphens=False)
    for g in summ["groups"]:
        saves = f"saves {gb(g['saved'])}" if g["saved"] else "saves nothing"
        layers = f", layer{'s' if g['adapters'] > 1 else ''} {g['layers']}" if g["layers"] else ""
        text = f"{g['kind']} x{g['adapters']}{layers}: {g['decision']} -> {saves}"
        out += textwrap.wrap(text, WIDTH, initial_indent="  ", subsequent_indent="      ", break_long_words=False,
                             break_on_hyphens=False)
        if g["fix"]:
            out += textwrap.wrap(f"fix: {g['fix']}", WIDTH, initial_indent="      ", subsequent_indent="        ",
                                 break_long_words=False, break_on_hyphens=False)
    if summ["experts_note"]:
        out += textwrap.wrap(f"experts: {summ['experts_note']}", WIDTH, initial_indent="  ",
                             subsequent_indent="      ", break_long_words=False, break_on_hyphens=False)
    if "peak" in summ:
        out += peak_lines(setup, summ["peak"])
    return out
