"""``regather doctor``'s adapter findings (each decision, with its fix) and :func:`diagnose`, every finding at once."""

from __future__ import annotations

from collections.abc import Mapping

from regather.core.recompute.reasons import NOTHING_KEPT
from regather.megatron.reasons import ELIGIBLE_BASES
from regather.tools.doctor.dora import dora_findings
from regather.tools.doctor.environment import env_findings
from regather.tools.doctor.rules import analytic_decisions
from regather.tools.doctor.savings import redispatch_finding, saving_finding
from regather.tools.doctor.setup import Finding, Setup
from regather.tools.doctor.te_gradient import te_gradient_finding

# fallbacks by design: info, not warning. "sequence parallelism is off": the run's setting, which
# the run-level finding regather-no-effect states once (not one warning per adapter)
_BY_DESIGN = ("base layer", "module is in eval mode", "autograd is disabled", "running inside",
              "sequence parallelism is off")
# reasons to keep an input under recompute_adapter_inputs that point at something to change
_UNEXPECTED_KEPT = ("dropout is applied", "the adapter input is not", "CPU activation", "selective recompute",
                    "no producer attached")


def _natural(path: str):
    """Sort key that puts layers.2 before layers.10."""
    return [int(p) if p.isdigit() else p for p in path.split(".")]


def describe(d: Mapping) -> str:
    """A decision dict as ``str(regather.megatron.dense.adapter.Decision)`` writes it."""
    text = d["used"]
    if d["used"] != d["requested"]:
        text += f" (asked {d['requested']}: {d['reason']})"
    if d.get("recompute"):
        text += f", input recomputed from {d['recompute']}"
    elif d.get("recompute_reason"):
        text += f", input kept (recompute asked: {d['recompute_reason']})"
    return text


def level_and_fix(d: Mapping) -> tuple[str, str | None]:
    """An adapter decision's finding level (``warning`` for a fallback that is not by design) and fix."""
    kept = d.get("recompute_reason")
    if d["reason"] is None and kept is None:
        return "info", None
    expected = d["reason"] is None or d["reason"].startswith(_BY_DESIGN) or "expert" in d["reason"]
    fix = None if expected else _fix_for_reason(d["reason"])
    if kept is not None:
        kept_expected = not kept.startswith(_UNEXPECTED_KEPT) and "bit for bit" not in kept
        expected = expected and kept_expected
        fix = fix or _fix_for_kept(kept)
    return ("info" if expected else "warning"), fix


def fix_for(d: Mapping) -> str | None:
    """What to change so that this adapter saves (None where nothing is to change)."""
    return level_and_fix(d)[1]


def adapter_findings(setup: Setup, decisions: Mapping[str, Mapping]) -> list[Finding]:
    out = []
    for path in sorted(decisions, key=_natural):
        d = decisions[path]
        kept = d.get("recompute_reason")
        if d["reason"] is None and kept is None:
            out.append(Finding("adapter", "info", f"{path}: {describe(d)}"))
            continue
        level, fix = level_and_fix(d)
        if d["reason"] is None:
            message = f"{path}: {describe(d)}"
        else:
            message = f"{path}: asked {d['requested']}, uses {d['used']}: {d['reason']}" + (
                f"; input kept (recompute asked: {kept})" if kept else
                f"; input recomputed from {d['recompute']}" if d.get("recompute") else "")
        if d.get("recompute_reason_from_rules"):
            message += f" [from the rules: {d['recompute_reason_from_rules']}]"
        out.append(Finding("adapter", level, message, fix))
    column = [p for p in decisions if p.rsplit(".", 1)[-1] in ELIGIBLE_BASES]
    if setup.strategy == "gather" and setup.sp and setup.tp > 1 and column and not setup.moe:
        out.append(Finding(
            "regather-off", "warning",
            f"LoRA + SP keeps the full gathered LoRA-A input of {len(column)} column-parallel adapter(s) "
            "until backward (strategy 'gather')",
            "LoRA(sequence_parallel_input_regather=True) (or strategy='regather'); check the fallbacks below",
        ))
    if setup.strategy != "gather" and (not setup.sp or setup.tp <= 1):
        out.append(Finding(
            "regather-no-effect", "info",
            f"strategy {setup.strategy!r} has no effect with sequence_parallel={setup.sp}, TP={setup.tp}",
            None,
        ))
    return out


def _fix_for_reason(reason: str) -> str | None:
    if "recompute" in reason:
        return "drop 'mlp' from recompute_modules, or use selective recompute of core_attn instead of full"
    if "CUDA graphs" in reason:
        return "CUDA graphs capture the adapter's collectives; re-gather runs only without them"
    if "offloading" in reason:
        return "turn CPU activation offloading off for re-gather to apply"
    if "frozen" in reason:
        return "make LoRA-A trainable"
    return None


def _fix_for_kept(reason: str) -> str | None:
    if "redispatch_expert_inputs=True" in reason:
        return "LoRA(redispatch_expert_inputs=True) (--redispatch-expert-inputs): see the redispatch-available finding"
    if NOTHING_KEPT in reason:
        return ("recomputable only when the decoder input requires grad (Bridge's "
                "maybe_enable_recompute_inputs_grad with activation recompute, HF's enable_input_require_grads; "
                "--input-requires-grad shows it)")
    if reason.startswith("selective recompute covers 'layernorm'"):
        return "drop 'layernorm' from recompute_modules: the norm's input is then kept and the adapter recomputes from it"
    if "dropout_position='pre'" in reason:
        return "dropout_position='post' (or dropout=0) lets the adapter input be recomputed"
    return None


def diagnose(env: Mapping[str, str], setup: Setup, decisions: Mapping[str, Mapping] | None = None
             ) -> list[Finding]:
    """Every finding for ``env`` and ``setup`` (decisions: analytic unless given)."""
    if decisions is None:
        decisions = analytic_decisions(setup)
    redispatch = redispatch_finding(setup, decisions)
    te = te_gradient_finding(setup)
    return (env_findings(env, setup) + ([te] if te else []) + adapter_findings(setup, decisions)
            + ([redispatch] if redispatch else []) + [saving_finding(setup, decisions)] + dora_findings(setup))
