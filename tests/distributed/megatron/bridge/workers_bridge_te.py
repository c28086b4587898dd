"""Rank worker for tests/distributed/megatron/bridge/test_bridge_te.py: Megatron Bridge's own LoRA and
regather's on the tiny GPT built on megatron's TE spec over the TE model (tests.harness.te_model),
TP=2 + SP, fp32, each TE behaviour; the decoder input's gradient against the same model in float64."""

from __future__ import annotations

import torch
import workers_bridge as W

from regather.tools.cpu.models import gpt_batch

VARIANTS = {  # name -> (which LoRA, its keywords)
    "bridge/gather": ("bridge", dict(sequence_parallel_input_regather=False)),  # Bridge's default
    "bridge/regather": ("bridge", dict(sequence_parallel_input_regather=True)),
    "rb/gather": ("rb", {}),  # regather.bridge.LoRA's default
    "rb/regather": ("rb", dict(sequence_parallel_input_regather=True)),
    "rb/lowrank": ("rb", dict(sequence_parallel_input_strategy="lowrank")),
}


def te_base(dtype=torch.float32):
    from tests.harness.te_model import build_te_gpt

    return build_te_gpt(W.SHAPE, W.TP, sequence_parallel=True, dtype=dtype, seed=W.SEED)


def adapted(which: str, dtype=torch.float32, **kw):
    import regather.megatron.bridge as rb

    cls = W.bridge_peft().LoRA if which == "bridge" else rb.LoRA
    torch.manual_seed(W.SEED + 7)
    peft = cls(target_modules=list(W.TARGETS), dim=W.DIM, alpha=W.ALPHA, lora_B_init_method="normal", **kw)
    return peft([te_base(dtype)], training=True)[0]


def flags_seen(model) -> list:
    """The ``(return_layernorm_output, return_layernorm_output_gathered)`` every fused TE linear of
    ``model`` runs with (recorded by a forward pre-hook, filled by the next forwards)."""
    seen: list = []
    for m in model.modules():
        if type(m).__name__ == "TELayerNormColumnParallelLinear":
            m.register_forward_pre_hook(
                lambda mod, args: seen.append((mod.return_layernorm_output, mod.return_layernorm_output_gathered)))
    return seen


def te_worker(rank: int, world_size: int) -> dict:
    from tests.harness.bridge_env import bridge_sees_te_model
    from tests.harness.te_model import TE_2_3, TE_2_8, te_behaviour

    batch = gpt_batch(W.SHAPE, W.MICRO_BATCH, seed=3)
    out: dict = {"rank": rank}
    for behaviour in (TE_2_3, TE_2_8):  # the gathered output's gradient: added, dropped (2.4 - 2.7 as 2.8+)
        name = behaviour.name
        with te_behaviour(behaviour), bridge_sees_te_model(behaviour.version):
            models = {v: adapted(which, **kw) for v, (which, kw) in VARIANTS.items()}
            reference = models["bridge/gather"]
            for model in models.values():
                if model is not reference:
                    W.copy_adapters(reference, model)
            fp64 = adapted("rb", dtype=torch.float64)
            W.copy_adapters(reference, fp64)
            seen = {v: flags_seen(m) for v, m in models.items()}
            out[name] = {"input_grad": {v: W.input_grad(m, batch) for v, m in models.items()},
                         "fp64": W.input_grad(fp64, batch),
                         "flags": {v: sorted(set(f)) for v, f in seen.items()},
                         "decisions": {v: W.decisions(m) for v, m in models.items() if v.startswith("rb/")}}
    return out
