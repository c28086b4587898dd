"""Rank workers for tests/distributed/megatron/bridge/test_bridge_moe.py: Megatron Bridge 0.6.2's LoRA and
``regather.bridge.LoRA`` side by side on the tiny MoE GPT of tests/distributed/megatron/moe/test_moe.py
(megatron's MoELayer, SequentialMLP experts), trained from the same full weights, and expert
adapter checkpoints crossing between the two.

The MoE training body (``Case``, ``train``: full weights, batches per DP rank, megatron-DDP-style
gradient reduction) is tests/distributed/megatron/moe/workers_moe.py's (tests/conftest.py puts every test
folder on ``sys.path``; spawned ranks inherit the parent's path).
"""

from __future__ import annotations

import os
from dataclasses import replace

from workers_moe import TARGETS, Case, train

from regather.tools.cpu.moe_models import GlobalLayout, TinyMoE, build_moe_gpt, full_weights

# variant -> (which LoRA, regather flag, regather.bridge's other fields)
SIDES = {"bridge": ("bridge", False, {}), "bridge-regather": ("bridge", True, {}),
         "rb-gather": ("regather.bridge", False, {}), "rb-regather": ("regather.bridge", True, {}),
         # the classic output (Bridge's bits; regather's regather path is lean by default)
         "rb-regather-classic": ("regather.bridge", True, {"lean_transients": False}),
         # every expert input rebuilt from what the MoE layer keeps (issue 16)
         "rb-regather-rc-rd": ("regather.bridge", True, {"recompute_adapter_inputs": True,
                                                         "redispatch_expert_inputs": True})}


def _transform(which: str, regather: bool, dim: int, **extra):
    kw = dict(target_modules=list(TARGETS), dim=dim, alpha=2 * dim, lora_B_init_method="xavier",
              sequence_parallel_input_regather=regather, **extra)
    from tests.harness.bridge_env import import_bridge_peft

    peft = import_bridge_peft()  # Bridge's PEFT package with the CPU shims (regather.bridge needs it too)
    if which == "bridge":
        lora = peft.LoRA(**kw)
        return lambda model, training=True: lora([model], training=training)[0]
    from regather.bridge import LoRA

    return LoRA(**kw)


def wrap(case: Case, variant: str):
    which, regather, extra = SIDES[variant]
    return _transform(which, regather, case.dim, **extra)


def side_by_side(rank: int, world: int, cases: dict) -> dict:
    """Every side of every case (all on ``world`` ranks), and the sides in ``case.fp64`` trained in float64
    under "fp64" (the reference of other summation orders, tests.harness.numerics)."""
    out = {}
    for name, case in cases.items():
        out[name] = {v: train(case, v, wrap=wrap) for v in case.variants}
        if case.fp64:
            out[name]["fp64"] = {v: train(replace(case, dtype="float64"), v, wrap=wrap) for v in case.fp64}
    return out


def reference(rank: int, world: int, cases: dict) -> dict:
    """Each case on one rank (TP = EP = ETP = 1) through regather.bridge.LoRA's gather path, and the
    same run in float64 under "fp64" (the reference of the layouts' other summation orders,
    tests.harness.numerics)."""
    out = {}
    for name, case in cases.items():
        out[name] = train(case.reference(), "rb-gather", wrap=wrap)
        out[name]["fp64"] = train(replace(case.reference(), dtype="float64"), "rb-gather", wrap=wrap)
    return out


# -- checkpoints crossing between Bridge's expert adapters and regather's -------------------------------

CKPT_SHAPE = TinyMoE(gated=True)


def _base(seed: int, tp=2, ep=2, etp=1):
    return build_moe_gpt(CKPT_SHAPE, tp, ep, etp, seed=1234 + seed)


def _built(which: str, seed: int):
    model = _transform(which, which != "bridge", 8)(_base(seed), training=True)
    layout = GlobalLayout(model, CKPT_SHAPE)
    layout.load(model, full_weights(layout.global_shapes(), seed=seed))
    return model, layout


def _pieces(model, layout):
    return layout.scatter({n: p.detach().clone() for n, p in model.named_parameters()})


def cross_load(rank: int, world: int, root: str) -> dict:
    """Each side saves its full model the way it saves (``{"model": ...}``, Bridge through its own
    ``_generate_model_state_dict``) and the other loads it its way: regather.bridge strictly
    (``load_state_dict(strict=True)``), Bridge the base into the unwrapped model (strict), then its
    own ``load_peft_adapter_checkpoint`` after wrapping (tests/distributed/megatron/bridge/test_bridge_dist_checkpoints.py)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from tests.harness.bridge_env import import_bridge_checkpointing, import_bridge_peft
    from tests.harness.megatron_ckpt import enable_dist_checkpointing_cpu

    enable_dist_checkpointing_cpu()
    import_bridge_peft()
    bridge_ckpt = import_bridge_checkpointing()
    import megatron.bridge.peft.utils as bridge_utils

    def save(sharded, path):
        if rank == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(sharded, path)
        dist.barrier()

    def load(model, path):
        return dist_checkpointing.load({"model": model.sharded_state_dict()}, path)["model"]

    out = {}
    # Bridge saves, regather.bridge loads
    path = os.path.join(root, "bridge")
    model, layout = _built("bridge", seed=0)
    save(bridge_ckpt._generate_model_state_dict([model]), path)
    saved = _pieces(model, layout)
    del model
    model, layout = _built("regather.bridge", seed=1)
    result = model.load_state_dict(load(model, path), strict=True)
    out[("bridge", "regather.bridge")] = {"saved": saved, "loaded": _pieces(model, layout),
                                          "unexpected": list(result.unexpected_keys), "missing": list(result.missing_keys)}
    del model
    # regather.bridge saves, Bridge loads
    path = os.path.join(root, "regather")
    model, layout = _built("regather.bridge", seed=0)
    save({"model": model.sharded_state_dict()}, path)
    saved = _pieces(model, layout)
    del model
    base = _base(seed=1)
    result = base.load_state_dict(load(base, path), strict=True)
    peft = _transform("bridge", False, 8)
    target = peft(base, training=True)
    bridge_utils.load_peft_adapter_checkpoint([target], path, import_bridge_peft().LoRA(
        target_modules=list(TARGETS), dim=8, alpha=16), fully_parallel_load=False)
    out[("regather.bridge", "bridge")] = {"saved": saved, "loaded": _pieces(target, GlobalLayout(target, CKPT_SHAPE)),
                                          "unexpected": list(result.unexpected_keys), "missing": list(result.missing_keys)}
    return out
