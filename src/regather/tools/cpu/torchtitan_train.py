"""torchtitan's LoRA and regather's variants trained side by side on one process group: what
``regather bench --torchtitan`` measures on each rank.

Variant names (:func:`regather.torchtitan.options.variant_fields`): ``torchtitan`` (torchtitan 0.3.0's
own ``LoRAConverter``, the baseline: its "gather"), ``<strategy>`` for regather's converter with
``sequence_parallel_input_strategy=<strategy>`` (``gather``, ``regather``, ``lowrank``), and the
options as suffixes, in this order: ``-plain`` (``early_regather=False``) and ``-recompute``
(``recompute_adapter_inputs=True``) — ``regather-plain``, ``regather-recompute``, ``lowrank-recompute``.

:func:`compare_titan` builds one model per variant from the same parameter values (each from its
name), then trains them on the same batches, step ``i`` running each variant once in an order
rotated by ``i``, each after a barrier; a step is torchtitan's ``train_step`` on one micro-batch:
forward, loss, backward, ``clip_grad_norm_`` and its AdamW ``OptimizersContainer``. Step 0 is
counted: the storages autograd saves in the forward (by label: regather's adapters and, through
:func:`~regather.tools.cpu.torchtitan_models.label_adapter_inputs`, torchtitan's label what LoRA-A
saves ``adapter_input:<kind>``), and the collective bytes of forward, backward and the optimizer
step (``CollectiveBytes(functional=True)``: DTensor's functional collectives too). The frozen model
(no adapter) is counted once, not trained.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from regather.core.accounting import CollectiveBytes
from regather.tools.cpu import torchtitan_models as M
from regather.torchtitan.options import BASELINE, VARIANTS, base_variant, variant_fields

__all__ = ["BASELINE", "VARIANTS", "TitanRun", "base_variant", "clip_and_step", "compare_titan", "optimizers",
           "variant_fields"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: uncounted steps before step 0 whose allocator bytes count (the smallest of them and step 0's):
#: a gloo worker that frees a collective's tensors unseen can only add bytes (regather.core.allocated)
WARM_COUNTS = 3


@dataclass(frozen=True)
class TitanRun:
    """One comparison: the model and its batches, the layout, the LoRA, the steps."""

    shape: M.TinyLlama3 = M.DEFAULT
    tp: int = 2
    dtype: str = "float32"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    targets: tuple = tuple(M.TARGETS)
    steps: int = 4
    lr: float = 8e-4
    max_norm: float = 1.0  # torchtitan's default clip
    seed: int = 1234
    ac: str = "none"        # torchtitan's activation checkpointing: none, selective (SelectiveAC), full (FullAC)
    compile: bool = False   # torchtitan's apply_compile: each block, fullgraph=True, inductor

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def build(self, name: str | None, pd):
        """The model of variant ``name`` (None: the frozen model, no adapter)."""
        kw = dict(rank=self.lora_rank, alpha=float(self.lora_alpha), target_modules=list(self.targets))
        conv = M.converter(None, **dict(kw, target_modules=[])) if name is None else \
            M.converter(variant_fields(name), **kw)
        model = M.build(M.model_config(conv, shape=self.shape), pd, parallelize=self.parallelize(pd),
                        dtype=self.torch_dtype)
        M.label_adapter_inputs(model)
        return model

    def parallelize(self, pd):
        """torchtitan's ``Module.parallelize``, then its activation checkpointing or compile as asked
        (the trainer's order), or None (``build``'s default) for neither."""
        if self.ac == "none" and not self.compile:
            return None

        def parallelize(model):
            model.parallelize(pd)
            if self.ac != "none":
                from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

                (SelectiveAC if self.ac == "selective" else FullAC).Config().build().apply(model)
            if self.compile:
                from torchtitan.config import CompileConfig
                from torchtitan.distributed.compile import apply_compile

                apply_compile(model, compile_config=CompileConfig(enable=True, backend="inductor"), parallel_dims=pd)
            return model

        return parallelize


def optimizers(model, lr: float):
    """torchtitan's AdamW ``OptimizersContainer`` over the model's trainable parameters."""
    from torchtitan.components.optimizer import default_adamw

    return default_adamw(lr=lr).build(model_parts=[model])


def clip_and_step(model, opts, max_norm: float = 1.0) -> None:
    """The optimizer part of torchtitan's ``train_step``: ``clip_grad_norm_`` (where a partial LoRA-A
    gradient is reduced, as torchtitan's own is), then the optimizers' step."""
    import torchtitan.distributed.utils as dist_utils

    dist_utils.clip_grad_norm_(list(model.parameters()), max_norm, foreach=True, pp_mesh=None,
                               ep_enabled=False)
    opts.step()


def _scalar(loss: torch.Tensor) -> float:
    return float(loss.full_tensor() if isinstance(loss, DTensor) else loss)


def _counted(model, opts, run: TitanRun, step: int) -> tuple[float, dict]:
    if run.compile:  # compiled blocks: the allocator's bytes alone (torchtitan_models.step)
        loss, _, comm = M.step(model, count="allocator", dtype=run.torch_dtype, shape=run.shape,
                               seed=run.seed + step)
        clip_and_step(model, opts, run.max_norm)
        return _scalar(loss), {"saved_bytes": None, "saved_bytes_by_label": {}, "allocated_bytes": comm["alive"],
                               "comm_bytes": {}, "comm_calls": {}}
    loss, saved, comm = M.step(model, dtype=run.torch_dtype, shape=run.shape, seed=run.seed + step)
    with CollectiveBytes(functional=True) as opt:
        clip_and_step(model, opts, run.max_norm)
    return _scalar(loss), {
        "saved_bytes": saved.total, "saved_bytes_by_label": saved.by_label(), "allocated_bytes": comm["alive"],
        "comm_bytes": {"forward": comm["fwd_bytes"], "backward": comm["bwd_bytes"], "optimizer": dict(opt.bytes)},
        "comm_calls": {"forward": comm["fwd"], "backward": comm["bwd"], "optimizer": dict(opt.calls)},
    }


def _timed(model, opts, run: TitanRun, step: int) -> float:
    loss, _, _ = M.step(model, count=False, dtype=run.torch_dtype, shape=run.shape, seed=run.seed + step)
    clip_and_step(model, opts, run.max_norm)
    return _scalar(loss)


def _warm(model, run: TitanRun) -> int:
    """Uncounted steps before step 0 (compiling the blocks first under ``--compile``): the
    smallest of :data:`WARM_COUNTS` steps' allocator bytes alive at the end of the forward;
    gradients reset."""
    if run.compile:
        M.step(model, count=False, dtype=run.torch_dtype, shape=run.shape, seed=run.seed)
    alive = []
    for _ in range(WARM_COUNTS):
        _, _, comm = M.step(model, count="allocator" if run.compile else "all", dtype=run.torch_dtype,
                            shape=run.shape, seed=run.seed)
        alive.append(comm["alive"])
    for p in model.parameters():
        p.grad = None
    return min(alive)


def step_bytes(model, run: TitanRun, steps: int = 2) -> dict | None:
    """The allocator's bytes of one forward + backward (:func:`~regather.tools.cpu.torchtitan_models.step_peak`),
    the smallest of ``steps`` steps, gradients reset; None under ``--compile`` (compiled blocks refuse the count's
    dispatch mode)."""
    if run.compile:
        return None
    counts = [M.step_peak(model, dtype=run.torch_dtype, shape=run.shape, seed=run.seed) for _ in range(steps)]
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.grad = None
    return {"kept": min(c["kept"] for c in counts), "peak": min(c["peak"] for c in counts),
            "lora_grad_bytes": sum(p.to_local().numel() * p.element_size() if isinstance(p, DTensor)
                                   else p.numel() * p.element_size() for p in trainable)}


def compare_titan(rank: int, world_size: int, run: TitanRun, variants: Sequence[str],
                  progress: Callable[[str, int, float], None] | None = None) -> dict:
    """Train one model per variant side by side; return ``{variant: result}`` and ``"frozen"``'s
    counted bytes. A result: ``loss`` and ``step_time`` per step, step 0's counts (``saved_bytes``,
    ``saved_bytes_by_label``, ``comm_bytes`` / ``comm_calls`` by phase and kind), the last step's
    trainable gradients as full tensors (``grads``), and regather's ``decisions``."""
    from regather.torchtitan import decisions

    pd = M.parallel_dims(tp=run.tp)
    frozen = run.build(None, pd)
    # the allocator's bytes are the smallest of WARM_COUNTS uncounted steps' and step 0's: under a
    # checkpoint or a compiled graph the first step holds one-off buffers (the compiler's own), and
    # a gloo worker still holding a finished collective can only add bytes (regather.core.allocated;
    # under --compile the collectives' tensors cannot be held on the profiling thread, so this is
    # the only guard there)
    if run.compile:
        import torch._dynamo

        # every variant's blocks compile in this one process: Dynamo's per-frame limit (8) is not enough
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * (len(variants) + 1))
    warm_alive = {"frozen": _warm(frozen, run)}  # an uncounted step's allocator bytes
    _, saved, comm = M.step(frozen, count="allocator" if run.compile else "all", dtype=run.torch_dtype,
                            shape=run.shape, seed=run.seed)
    out = {"frozen": {"saved_bytes": saved.total if saved else None,
                      "saved_bytes_by_label": saved.by_label() if saved else {},
                      "allocated_bytes": min(comm["alive"], warm_alive["frozen"]),
                      "step_bytes": step_bytes(frozen, run)}}
    del frozen
    models = {name: run.build(name, pd) for name in variants}
    opts = {name: optimizers(model, run.lr) for name, model in models.items()}
    for name, model in models.items():
        warm_alive[name] = _warm(model, run)
    for name in variants:
        out[name] = {"loss": [], "step_time": []}
    for step in range(run.steps):
        k = step % len(variants)
        for name in list(variants[k:]) + list(variants[:k]):
            model, res = models[name], out[name]
            opts[name].zero_grad()
            dist.barrier()
            t0 = time.perf_counter()
            if step == 0:
                loss, counts = _counted(model, opts[name], run, step)
                counts["allocated_bytes"] = min(counts["allocated_bytes"], warm_alive[name])
                res.update(counts)
            else:
                loss = _timed(model, opts[name], run, step)
            dt = time.perf_counter() - t0
            res["step_time"].append(dt)
            res["loss"].append(loss)
            if step == run.steps - 1:
                res["grads"] = {n: g.detach().float().clone() for n, g in M.lora_grads(model).items()}
            if progress is not None:
                progress(name, step, dt)
    for name in variants:  # after training, as the dense bench (regather.tools.cpu.train.compare_strategies)
        out[name]["step_bytes"] = step_bytes(models[name], run)
        out[name]["decisions"] = {path: str(d) for path, d in decisions(models[name]).items()}
    return out
