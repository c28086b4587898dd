"""``regather doctor --peft dora``: DoRA's own findings (docs/design.md §3.9; regather.DoRA).

=============== ======= ===================================================================================
code            level   when
=============== ======= ===================================================================================
dora-output     info    what the magnitude keeps per GPU (``regather estimate``'s
                        :func:`~regather.tools.estimate.dora.dora_output_bytes`): the pre-magnitude output
                        ``z`` per adapter (as Megatron Bridge's DoRA), or nothing with
                        ``--recompute-dora-output`` (one more base GEMM per adapter in backward)
dora-row-norm   warning Megatron Bridge's own DoRA (``--bridge-lora``) on a row-parallel target at TP > 1:
                        each rank's slice norm (the function depends on the TP size) and the row magnitude's
                        gradient left as each rank's part (its TP replicas drift)
dora-experts    error   DoRA on expert linears (a MoE model's fc1 / fc2): DoRA adapts dense linears only
=============== ======= ===================================================================================

Under sequence parallelism Bridge's DoRA also asks Transformer Engine for its gathered LayerNorm output, with no
re-gather option: :mod:`.te_gradient`'s ``te-ln-grad``.
"""

from __future__ import annotations

from regather.tools.doctor.setup import Finding, Setup

ROW_TARGETS = ("linear_proj", "linear_fc2")
FIX = "use regather.bridge.DoRA (the row norm over the whole row, every strategy, TE's local LayerNorm output)"


def dora_findings(setup: Setup) -> list[Finding]:
    if setup.peft != "dora":
        return []
    experts = [t for t in setup.targets if setup.moe and t in ("linear_fc1", "linear_fc2")]
    if experts:
        return [Finding("dora-experts", "error", f"DoRA on {', '.join(experts)}: on {setup.model_name} these are "
                        "expert linears, which DoRA does not adapt", "leave the experts out of target_modules")]
    from regather.tools import estimate as est
    from regather.tools.doctor.savings import expert_estimate

    model, run = expert_estimate(setup)
    model = est.Model(**{**model.__dict__, "gated_mlp": setup.activation == "swiglu"})
    rebuild = setup.recompute_dora_output and not setup.bridge_lora
    kept = est.dora_output_bytes(model, est.Run(**{**run.__dict__, "peft": "dora",
                                                        "dora_output": "rebuild" if rebuild else "keep"}))
    total = sum(kept.values())
    if rebuild:
        text = (f"DoRA keeps no pre-magnitude output (recompute_dora_output: rebuilt in backward, one row chunk at a "
                f"time; one more base GEMM per adapter), only its scale and norm: {total:,} bytes per GPU")
        fix = None
    else:
        text = (f"DoRA keeps its pre-magnitude output z (and its scale and norm) for the magnitude's gradient: "
                f"{total:,} bytes per GPU ("
                + ", ".join(f"{k} {v:,}" for k, v in kept.items()) + ")")
        fix = ("regather.bridge.DoRA / regather.DoRA(recompute_dora_output=True) keeps none" if setup.bridge_lora
               else "DoRA(recompute_dora_output=True) keeps none (one more base GEMM per adapter)")
    out = [Finding("dora-output", "info", f"{text} [{setup.spec} spec; s={setup.seq}, b={setup.micro_batch}, "
                   f"t={setup.tp}, {setup.dtype}]", fix)]
    rows = [t for t in setup.targets if t in ROW_TARGETS]
    if setup.bridge_lora and setup.tp > 1 and rows:
        out.append(Finding(
            "dora-row-norm", "warning",
            f"Megatron Bridge's DoRA on {', '.join(rows)} at TP={setup.tp} takes each rank's slice norm "
            "||W0_i + s B A_i|| (no sum over TP: the model depends on the TP size it was trained at)"
            + (" and leaves the row magnitude's gradient as each rank's part of the sum (its TP replicas drift)"
               if setup.sp else ""), FIX))
    return out
