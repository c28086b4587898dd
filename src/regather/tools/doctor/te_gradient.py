"""``regather doctor``'s Transformer Engine rule: a LoRA that asks TE for its *gathered* LayerNorm
output under sequence parallelism, on a TE that drops that output's gradient.

Read in TE's source (``transformer_engine/pytorch/module/layernorm_linear.py``; docs/bridge.md):
up to v2.3 ``_LayerNormLinear.backward`` added the gradient of a returned gathered ``ln_out`` to its
dgrad before the sequence reduce-scatter (v2.3:695-696); commit ce0b46c4d, first in v2.4, removed it,
and from v2.4 on the only read of that gradient is for the *local* output (v2.18:1105-1106). Megatron
Bridge's own ``LoRA`` asks for the gathered output on its default SP path
(``return_layernorm_output_gathered = not sequence_parallel_input_regather``, ``peft/utils.py``), so
on TE >= 2.4 LoRA's share of the input gradient never reaches the norm and the layers below it
(LoRA's own weight gradients are right, and LoRA-B starts at zero: nothing looks wrong at first).
regather takes the local output on every strategy.

=============== ======= ===================================================================
code            level   when
=============== ======= ===================================================================
te-ln-grad      error   Bridge's LoRA (``--bridge-lora``) without its re-gather option, SP on,
                        TP > 1, TE >= 2.4 (``--te-version``, else the installed one)
te-ln-grad      warning the same, the TE version unknown (not installed here, none given)
=============== ======= ===================================================================
"""

from __future__ import annotations

from regather.megatron.dense.te_rule import version_tuple
from regather.tools.doctor.setup import Finding, Setup

#: the first TE version whose backward drops the gathered LayerNorm output's gradient
DROPS_FROM = (2, 4)
CODE = "te-ln-grad"
FIX = ("use regather.bridge.LoRA (it takes TE's local LayerNorm output on every strategy), or Bridge's "
       "LoRA(sequence_parallel_input_regather=True)")


def asks_gathered(setup: Setup) -> bool:
    """Whether the run's LoRA asks TE for its gathered LayerNorm output: Bridge's own LoRA under SP
    (TP > 1) without ``sequence_parallel_input_regather`` (``--strategy regather``); Bridge's DoRA under SP
    always (it has no re-gather option). regather's never does."""
    dora = getattr(setup, "peft", "lora") == "dora"
    return setup.bridge_lora and setup.sp and setup.tp > 1 and (dora or setup.strategy != "regather")


def te_gradient_finding(setup: Setup) -> Finding | None:
    """The ``te-ln-grad`` finding for ``setup`` (module doc), or None."""
    if not asks_gathered(setup):
        return None
    dora = getattr(setup, "peft", "lora") == "dora"
    what = (f"Megatron Bridge's {'DoRA' if dora else 'LoRA'} asks TELayerNormColumnParallelLinear for its gathered "
            f"LayerNorm output (sequence parallelism, TP={setup.tp}{'; DoRA has no re-gather option' if dora else ''})")
    fix = "use regather.bridge.DoRA (it takes TE's local LayerNorm output on every strategy)" if dora else FIX
    version = version_tuple(setup.te_version) if setup.te_version else None
    if version is None:
        return Finding(CODE, "warning", f"{what}; Transformer Engine from 2.4 on drops that output's gradient "
                       f"(LoRA's share of the input gradient is lost), and the TE version is unknown here "
                       f"(--te-version)", fix)
    if version < DROPS_FROM:
        return None
    return Finding(CODE, "error", f"{what}, and Transformer Engine {setup.te_version} drops that output's gradient "
                   "(since 2.4): LoRA's share of the input gradient never reaches the norm and the layers below",
                   fix)
