"""Rank bodies for tests/distributed/torchtitan/test_titan_ac.py, test_titan_ac_compile.py and test_titan_spmd.py: torchtitan's
llama3 debugmodel (2 layers, TP2 + SP, 2 gloo ranks) under its SelectiveAC, its FullAC and its
apply_compile (per block, fullgraph=True), alone and together, torchtitan's LoRA against
regather's; bytes as the allocator sees them.

A setting names what runs (:data:`SETTINGS`); :func:`setting_suite` runs it on a backend, either
as the older tests do (``Module.parallelize`` and the AC / compile calls, no FSDP) or through
torchtitan's own ``parallelize_llama`` with FSDP2 (``fsdp=True``: how the trainer runs, and on
``spmd_types`` the only way its replicated weights' gradients are reduced)."""

from __future__ import annotations

import torch

from regather.tools.cpu import torchtitan_models as H

RUNS = {
    "gather": dict(sequence_parallel_input_strategy="gather"),
    "regather": dict(sequence_parallel_input_strategy="regather"),
    "regather-late": dict(sequence_parallel_input_strategy="regather", early_regather=False),
    "lowrank": dict(sequence_parallel_input_strategy="lowrank"),
    "gather-recompute": dict(sequence_parallel_input_strategy="gather", recompute_adapter_inputs=True),
    "regather-recompute": dict(sequence_parallel_input_strategy="regather", recompute_adapter_inputs=True),
    "lowrank-recompute": dict(sequence_parallel_input_strategy="lowrank", recompute_adapter_inputs=True),
}
#: setting -> (activation checkpointing, compile backend or None, float dtype)
SETTINGS = {
    "none": ("none", None, torch.float32),
    "selective": ("selective", None, torch.float32),
    "full": ("full", None, torch.float32),
    "fp64": ("none", None, torch.float64),         # eager, float64: the rounding reference
    "compile": ("none", "inductor", torch.float32),
    "aot_eager": ("none", "aot_eager", torch.float32),
    "compile+full": ("full", "inductor", torch.float32),        # llama3 405B's: FullAC, compile
    "compile+selective": ("selective", "inductor", torch.float32),  # the 8B mxfp8 / nvfp4 configs'
}
REPEATS = 5  # bytes: the smallest of this many steps (a gloo work object may free its block late)


def _step(model, dtype=torch.float32):
    """Forward (allocator bytes alive at its end), loss, backward; the gradients reset first."""
    for p in model.parameters():
        p.grad = None
    loss, _, counted = H.step(model, count="allocator", dtype=dtype)
    return counted["alive"], loss


def bit_identical(got: dict, want: dict) -> None:
    """Two runs' loss and LoRA gradients, bit for bit."""
    assert torch.equal(got["loss"], want["loss"])
    assert got["grads"].keys() == want["grads"].keys()
    for n, g in want["grads"].items():
        assert torch.equal(got["grads"][n], g), n


def measure(model, dtype=torch.float32) -> dict:
    from regather.torchtitan import decisions

    steps = [_step(model, dtype) for _ in range(REPEATS)]
    return dict(alive=min(b for b, _ in steps), loss=steps[0][1], grads=H.lora_grads(model),
                decisions={p: str(d) for p, d in decisions(model).items()},
                trainable=sorted(n for n, p in model.named_parameters() if p.requires_grad))


def _converter(name: str | None):
    if name == "frozen":
        return H.converter(None, target_modules=[])
    return H.converter(None if name == "torchtitan" else RUNS[name])


def _parallelize(pd, setting: str, fsdp: bool):
    ac, backend, _ = SETTINGS[setting]
    if fsdp:
        return H.parallelize_llama(pd, ac=ac, compile_backend=backend)
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.compile import apply_compile

    def parallelize(model):
        model.parallelize(pd)
        if ac != "none":
            (SelectiveAC if ac == "selective" else FullAC).Config().build().apply(model)
        if backend is not None:
            apply_compile(model, compile_config=CompileConfig(enable=True, backend=backend), parallel_dims=pd)
        return model

    return parallelize


def setting_suite(rank, world_size, setting: str, names: list[str], backend: str = "partial_dtensor",
                  fsdp: bool = False) -> dict:  # TP2, and FSDP2 over the other ranks (dp_shard = world / 2)
    """``names`` (``frozen``, ``torchtitan`` or a key of RUNS) under ``setting`` (:data:`SETTINGS`:
    torchtitan's SelectiveAC / FullAC with their default configs, apply_compile with inductor or
    aot_eager, both, or float64 eager) on the SPMD ``backend``."""
    pd = H.parallel_dims(backend=backend, dp_shard=world_size // 2 if fsdp else 1)
    _, compiled, dtype = SETTINGS[setting]
    out = {}
    for name in names:
        if compiled:  # each model's blocks are compiled anew (one process, many models)
            torch._dynamo.reset()
        model = H.build(H.model_config(_converter(name)), pd, parallelize=_parallelize(pd, setting, fsdp), dtype=dtype)
        out[name] = measure(model, dtype)
    return out


SUITE = {
    "selective": ["frozen", "torchtitan", "gather", "regather", "lowrank", "regather-recompute"],
    "full": ["frozen", "torchtitan", "regather", "lowrank", "regather-recompute"],
    "fp64": ["torchtitan"],
    "compile": ["frozen", "torchtitan", "gather", "regather", "lowrank", "regather-recompute"],
    "aot_eager": ["frozen", "torchtitan", "regather", "lowrank", "regather-recompute"],
}


def ac_compile_suite(rank, world_size, settings=tuple(SUITE)) -> dict:
    """The ``settings`` of SUITE (all by default) in one spawn, in SUITE's order (the compiled ones last)."""
    return {setting: setting_suite(rank, world_size, setting, names) for setting, names in SUITE.items()
            if setting in settings}


#: torchtitan's default backend through its parallelize_llama with FSDP2 (test_titan_spmd.py):
#: every strategy eager (their options, late re-gather and gather + recompute, are backend-free and
#: run on partial_dtensor in test_titan_llama3.py); under AC and compile the ones the tables show;
#: compile + AC (llama3 405B's FullAC, the 8B low-precision configs' SelectiveAC) with torchtitan's
#: LoRA and the recipe
SPMD_SUITE = {
    "none": ["frozen", "torchtitan", "gather", "regather", "regather-recompute", "lowrank", "lowrank-recompute"],
    "fp64": ["torchtitan"],
    "selective": ["frozen", "torchtitan", "gather", "regather", "lowrank", "regather-recompute"],
    "full": ["frozen", "torchtitan", "regather", "lowrank", "regather-recompute"],
    "compile": ["frozen", "torchtitan", "regather", "lowrank", "regather-recompute"],
    "compile+full": ["torchtitan", "regather-recompute"],
    "compile+selective": ["torchtitan", "regather-recompute"],
}
#: the spawns, by cost (tests/harness/spawn_groups.py): eager, then each compiled group
SPMD_GROUPS = [["none", "fp64", "selective", "full"], ["compile"], ["compile+full", "compile+selective"]]


def spmd_group_suite(rank, world_size, settings, backend: str = "spmd_types", frozen: bool = False) -> dict:
    """The settings of one group of SPMD_SUITE on ``backend`` with FSDP2 (``frozen``: with the
    frozen model where the tests leave it out, for the tables); ``fp64`` (the rounding
    reference: the same model and values in float64) on partial_dtensor without FSDP2, whose
    mixed-precision policy casts to float32 (torchtitan's dtypes stop there)."""
    out = {}
    for s in settings:
        fp64 = s == "fp64"
        names = (["frozen"] if frozen and "frozen" not in SPMD_SUITE[s] and not fp64 else []) + SPMD_SUITE[s]
        out[s] = setting_suite(rank, world_size, s, names, backend="partial_dtensor" if fp64 else backend, fsdp=not fp64)
    return out
