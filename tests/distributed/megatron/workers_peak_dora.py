"""Rank bodies for test_peak_dora.py: DoRA's bytes over the frozen linear, as test_peak.py measures LoRA's.

One frozen base (workers_peak_linear's: column-parallel ``o = 8h`` as fc1, row-parallel ``h_in = 8h`` as fc2, local
spec and the TE model, TP2 + SP, fp32), ``regather.DoRA`` with each variant of :data:`VARIANTS`, with and
without ``recompute_adapter_inputs``; the allocator's bytes alive after the forward (kept) and at the step's
highest point (peak), the smallest of a few steps (:func:`workers_peak_linear.step_bytes`).

The output gradient reaches the linear as a real model's does: fresh from the next op's backward, held by
nobody else (``(y * dy).sum()``'s backward makes it), so DoRA may scale it in place
(:func:`regather.core.peak.magnitude.exclusive`). ``y.backward(dy)`` with the caller holding ``dy`` would make
it copy (``+W``), as it must; the frozen linear is measured the same way.
"""

from __future__ import annotations

import torch.distributed as dist
from workers_peak_linear import R, adapted, frozen_base, input_batch, step_bytes

#: variant -> (strategy, lean_transients, recompute_dora_output)
VARIANTS = {
    "classic": ("gather", None, False),  # Megatron Bridge's DoRA expression (its bytes: z kept, full transients)
    "gather-lean": ("gather", True, False),
    "regather": ("regather", None, False),
    "lowrank": ("lowrank", None, False),
    "gather-rebuild": ("gather", None, True),
    "regather-rebuild": ("regather", None, True),
    "lowrank-rebuild": ("lowrank", None, True),
}


def run(rank, world, spec: str) -> dict:
    """``(kind, variant, recompute) -> (kept, peak)`` and ``(kind, "frozen")``; the decisions."""
    from tests.harness.te_model import te_behaviour

    from regather import DoRA
    from regather.tools.cpu.models import init_model_parallel

    init_model_parallel(world)
    group, out = dist.group.WORLD, {"bytes": {}, "decisions": {}}
    with te_behaviour("te2.8-2.20"):
        for kind in ("column", "row"):
            name = "linear_fc1" if kind == "column" else "linear_fc2"
            x, dy = input_batch(kind, rank, world)
            out["bytes"][(kind, "frozen")] = step_bytes(frozen_base(spec, kind, group), x, dy, through_loss=True)
            for variant, (strategy, lean, rebuild) in VARIANTS.items():
                for recompute in (False, True):
                    wrapper = adapted(spec, kind, group, name, DoRA(
                        target_modules=[name], dim=R, alpha=2 * R, lora_B_init_method="normal",
                        sequence_parallel_input_strategy=strategy, lean_transients=lean,
                        recompute_dora_output=rebuild, recompute_adapter_inputs=recompute))
                    key = (kind, variant, recompute)
                    out["bytes"][key] = step_bytes(wrapper, x, dy, through_loss=True)
                    out["decisions"][key] = str(wrapper.adapter.last_decision)
    return out
