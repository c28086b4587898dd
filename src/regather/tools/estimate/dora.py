"""``regather estimate --peft dora``: what DoRA keeps beyond LoRA, per adapter (regather.DoRA; docs/design.md §3.9).

DoRA's magnitude gradient ``dm = Σ_tokens dy ⊙ z / ||V||`` reads the pre-magnitude output
``z = W0 x + s·B A x``. Megatron Bridge's DoRA and regather's (by default) keep it from forward to backward,
one per adapter and micro-batch, in the base's output layout; with ``recompute_dora_output=True``
(``--dora-output rebuild``) regather keeps none and rebuilds it in backward, one row chunk at a time (one
more base GEMM per adapter). Per adapter (``e`` activation bytes, ``t`` TP size, ``o`` the base's output
features):

===================== ================================= =============================
adapter               z kept (``--dora-output keep``)   ``--dora-output rebuild``
===================== ================================= =============================
linear_qkv            ``s*b*(heads + 2*kv)*d/t*e``       0
dense linear_fc1      ``s*b*ffn_out/t*e`` (gated: 2 ffn) 0
linear_proj, fc2      ``s/t*b*h*e`` under SP             0
                      (``s*b*h*e`` SP off or TP1)
===================== ================================= =============================

plus, on every adapter and either way, the magnitude's scale ``m / n`` and norm ``n`` (``2*o_local*e``,
``o_local`` = ``o/t`` on a column base, ``o`` on a row base: the magnitude's own size). The same on every
strategy (the gather path is Bridge's expression, which keeps ``z``, the scale and the norm too). The
magnitude itself is a parameter, not counted. DoRA adapts dense linears only: a MoE model's expert fc1 /
fc2 are refused (as :class:`regather.DoRA` refuses them).
"""

from __future__ import annotations

from regather.megatron.reasons import ALL_TARGETS
from regather.tools.estimate.config import Model, Run, check_run, layers_here

PEFTS = ("lora", "dora")
DORA_OUTPUTS = ("keep", "rebuild")


def output_features(model: Model, name: str) -> int:
    """The base's output features ``o`` (all ranks) of ``name``."""
    head_dim = model.head_dim or model.hidden // model.heads
    if name == "linear_qkv":
        return (model.heads + 2 * (model.kv_heads or model.heads)) * head_dim
    if name == "linear_fc1":
        return model.ffn * (2 if model.gated_mlp else 1)
    return model.hidden  # linear_proj, linear_fc2


def dora_output_bytes(model: Model, run: Run) -> dict[str, int]:
    """Per GPU, by target (all micro-batches in flight): the ``z`` DoRA keeps (module doc); empty for LoRA."""
    if run.peft not in PEFTS or run.dora_output not in DORA_OUTPUTS:
        raise ValueError(f"peft {run.peft!r}, dora output {run.dora_output!r}: expected one of {PEFTS}, "
                         f"{DORA_OUTPUTS}")
    if run.peft != "dora":
        return {}
    check_run(model, run)
    experts = [n for n in run.targets if model.moe and n in ("linear_fc1", "linear_fc2")]
    if experts:
        raise ValueError(f"DoRA adapts dense linears only; {model.name}'s {', '.join(experts)} are expert linears "
                         "(leave them out of the targets)")
    s, b, t, e = run.seq, run.micro_batch, run.tp, run.e
    out = {}
    for name in ALL_TARGETS:
        if name not in run.targets:
            continue
        o = output_features(model, name)
        column = name in ("linear_qkv", "linear_fc1")
        if run.dora_output == "rebuild":
            per = 0
        elif column:
            per = s * b * o // t * e
        else:  # row-parallel: this rank's sequence shard under SP, the whole output otherwise
            per = s * b * o * e // (t if run.sp and t > 1 else 1)
        per += 2 * (o // t if column else o) * e  # the scale and the norm
        out[name] = per * layers_here(model, run) * run.in_flight
    return out
