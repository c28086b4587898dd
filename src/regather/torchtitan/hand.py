"""LoRA for a model parallelized by hand with ``torch.distributed.tensor.parallel``.

After ``parallelize_module(block, mesh, {"norm": SequenceParallel(), "w1": ColwiseParallel(
input_layouts=Shard(1)), "w3": ..., "w2": RowwiseParallel(output_layouts=Shard(1))})``::

    from regather.torchtitan import apply_lora
    apply_lora(model, ["w1", "w2", "w3"], rank=8, alpha=16.0, sequence_parallel_input_strategy="regather")

Each target ``nn.Linear`` becomes a regather LoRA linear in place (its class is swapped, as
FSDP2 does): children ``lora_a`` / ``lora_b`` with torchtitan's initialisation (LoRA-A
Kaiming-uniform, LoRA-B zeros) and torchtitan's placements on the base weight's mesh
(column-parallel base: LoRA-A replicated, LoRA-B ``Shard(0)``; row-parallel: LoRA-A
``Shard(1)``, LoRA-B replicated) — so parameter names and checkpoints are torchtitan's
(``….lora_a.weight``, ``….lora_b.weight``). Every other parameter of the model is frozen (after
parallelizing: ``SequenceParallel`` re-registers a norm's parameters as trainable).

``ColwiseParallel`` gathers in each linear's own input hook, so each column-parallel adapter
pairs with its own linear's gather (``w1`` and ``w3`` keep one shard: the norm's output, shared).
The norm's output must reach the linear as a DTensor (``SequenceParallel(use_local_output=False)``,
the default). Apply after ``parallelize_module``: applied before, ``distribute_module`` would shard
the LoRA children like the base (Megatron's layout, not torchtitan's).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from regather.torchtitan import compat
from regather.torchtitan.adapter import LoRAAdapter, regather_class
from regather.torchtitan.model import attach
from regather.torchtitan.options import check_lora, options

_classes: dict = {}


def _hand_class(base_cls: type) -> type:
    if base_cls not in _classes:
        _classes[base_cls] = regather_class(base_cls, base_cls.forward)
    return _classes[base_cls]


def _lora_linear(in_features: int, out_features: int, zeros: bool, like: nn.Parameter, placement) -> nn.Linear:
    linear = nn.Linear(in_features, out_features, bias=False, device=like.device, dtype=like.dtype)
    if zeros:
        nn.init.zeros_(linear.weight)
    if isinstance(like, DTensor):  # replicated from rank 0 / scattered like the base
        linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), like.device_mesh, [placement]))
    return linear


def apply_lora(model: nn.Module, target_modules: list[str] | None = None, *, rank: int = 8, alpha: float = 16.0,
               sequence_parallel_input_regather: bool = False, sequence_parallel_input_strategy: str | None = None,
               early_regather: bool = True, recompute_adapter_inputs: bool = False) -> nn.Module:
    """LoRA on every ``nn.Linear`` of ``model`` whose last path segment is in ``target_modules``
    (``None``: every one), in place; fields as :class:`regather.torchtitan.LoRAConverter.Config`.
    Everything is checked before the model changes."""
    check_lora("apply_lora", rank, alpha, target_modules)
    opts = options("apply_lora", sequence_parallel_input_regather=sequence_parallel_input_regather,
                   sequence_parallel_input_strategy=sequence_parallel_input_strategy,
                   early_regather=early_regather, recompute_adapter_inputs=recompute_adapter_inputs)
    chosen = [(path, m) for path, m in model.named_modules()
              if type(m) is nn.Linear and (target_modules is None or path.rsplit(".", 1)[-1] in target_modules)]
    matched = {path.rsplit(".", 1)[-1] for path, _ in chosen}
    unmatched = sorted(set(target_modules or ()) - matched)
    if unmatched or not chosen:
        raise ValueError(f"apply_lora(target_modules={target_modules!r}): no nn.Linear named {unmatched or 'at all'} "
                         "in the model (already adapted, or another class)")
    for _, linear in chosen:
        weight = linear.weight
        column = isinstance(weight, DTensor) and tuple(weight.placements) == (Shard(0),)
        a_place, b_place = (Replicate(), Shard(0)) if column else (Shard(1), Replicate())
        lora_a = _lora_linear(linear.in_features, rank, False, weight, a_place)
        lora_b = _lora_linear(rank, linear.out_features, True, weight, b_place)
        linear.__class__ = _hand_class(nn.Linear)
        linear.lora_a, linear.lora_b = lora_a, lora_b
        compat.set_lora_scaling(linear, alpha / rank)
        linear.init_regather(opts)
    lora = {id(p) for m in model.modules() if isinstance(m, LoRAAdapter)
            for p in (m.lora_a.weight, m.lora_b.weight)}
    for p in model.parameters():
        p.requires_grad_(id(p) in lora)
    return attach(model, by_hand=True)
