"""Rank bodies for tests/distributed/torchtitan/test_titan_ac_compile.py: torchtitan's llama3 debugmodel (2 layers,
TP2 + SP, 2 gloo ranks) under its SelectiveAC, its FullAC and its apply_compile (per block,
fullgraph=True), torchtitan's LoRA against regather's; bytes as the allocator sees them."""

from __future__ import annotations

import gc

import torch

from regather.core.allocated import AllocatedBytes
from regather.tools.cpu import torchtitan_models as H

RUNS = {
    "gather": dict(sequence_parallel_input_strategy="gather"),
    "regather": dict(sequence_parallel_input_strategy="regather"),
    "lowrank": dict(sequence_parallel_input_strategy="lowrank"),
    "regather-recompute": dict(sequence_parallel_input_strategy="regather", recompute_adapter_inputs=True),
}
REPEATS = 5  # bytes: the smallest of this many steps (a gloo work object may free its block late)


def _step(model, dtype=torch.float32):
    """Forward (allocator bytes alive at its end), loss, backward; the gradients reset first."""
    for p in model.parameters():
        p.grad = None
    gc.collect()
    hook = model.tok_embeddings.register_forward_hook(lambda m, a, out: out.detach().to(dtype).requires_grad_(True))
    inp, labels = H.tokens()
    try:
        with AllocatedBytes(settle_collectives=True) as alloc:
            pred = model(inp, H.positions())
    finally:
        hook.remove()
    loss = H.loss_of(pred, labels)
    loss.backward()
    return alloc.alive, loss.detach()


def measure(model, dtype=torch.float32) -> dict:
    from regather.torchtitan import decisions

    steps = [_step(model, dtype) for _ in range(REPEATS)]
    return dict(alive=min(b for b, _ in steps), loss=steps[0][1], grads=H.lora_grads(model),
                decisions={p: str(d) for p, d in decisions(model).items()})


def _converter(name: str | None):
    if name == "frozen":
        return H.converter(None, target_modules=[])
    return H.converter(None if name == "torchtitan" else RUNS[name])


def setting_suite(rank, world_size, setting: str, names: list[str]) -> dict:
    """``names`` (``frozen``, ``torchtitan`` or a key of RUNS) under ``setting``: ``selective`` /
    ``full`` (torchtitan's SelectiveAC / FullAC with their default configs), ``compile``
    (apply_compile with inductor), ``aot_eager`` (the same, AOT autograd without Inductor) or ``fp64`` (eager, float64: the rounding reference)."""
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.compile import apply_compile

    pd = H.parallel_dims()

    def parallelize(model):
        model.parallelize(pd)
        if setting == "selective":
            SelectiveAC.Config().build().apply(model)
        elif setting == "full":
            FullAC.Config().build().apply(model)
        elif setting in ("compile", "aot_eager"):
            backend = "inductor" if setting == "compile" else "aot_eager"
            apply_compile(model, compile_config=CompileConfig(enable=True, backend=backend), parallel_dims=pd)
        return model

    dtype = torch.float64 if setting == "fp64" else torch.float32
    out = {}
    for name in names:
        if setting in ("compile", "aot_eager"):  # each model's blocks are compiled anew (one process, many models)
            torch._dynamo.reset()
        out[name] = measure(H.build(H.model_config(_converter(name)), pd, parallelize=parallelize, dtype=dtype), dtype)
    return out


SUITE = {
    "selective": ["frozen", "torchtitan", "gather", "regather", "lowrank", "regather-recompute"],
    "full": ["frozen", "torchtitan", "regather", "lowrank", "regather-recompute"],
    "fp64": ["torchtitan"],
    "compile": ["frozen", "torchtitan", "gather", "regather", "lowrank", "regather-recompute"],
    "aot_eager": ["frozen", "torchtitan", "regather", "lowrank", "regather-recompute"],
}


def ac_compile_suite(rank, world_size) -> dict:
    """Every setting of SUITE in one spawn (the compiled ones last: they are the slow part)."""
    return {setting: setting_suite(rank, world_size, setting, names) for setting, names in SUITE.items()}
