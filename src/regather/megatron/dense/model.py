"""A LoRA-wrapped megatron model: its adapters, their decisions, and the model-level checks.

- :func:`adapters` / :func:`decisions` / :func:`set_strategy` — every adapter by the path of
  the linear it wraps, what each would do now (``regather.decisions(model)``), a strategy switch;
- :func:`finish_wrapping` — after every wrap: the sequence-length check and one fallback log
  per model (:mod:`regather.core.fallback_log`);
- :func:`install_shape_checks` — opt-in: every wrapped linear's input checked across its TP
  group before the base layer runs (:mod:`regather.core.debug`).
"""

from __future__ import annotations

import torch
from torch import nn

from regather.core import debug, fallback_log
from regather.core.decision import Decision
from regather.core.strategies import Strategy
from regather.megatron.dense.adapter import ParallelLinearAdapter
from regather.megatron.dense.wrapper import LoRALinear


def finish_wrapping(model: nn.Module) -> None:
    """After every wrap: the sequence-length check, and one fallback log for the model's adapters
    (each distinct reason logged once with a count, :mod:`regather.core.fallback_log`)."""
    _install_sequence_check(model)
    fallback_log.attach(model, adapters(model).values())


def adapters(model: nn.Module) -> dict[str, ParallelLinearAdapter]:
    """Every LoRA adapter of ``model``, by the path of the linear it wraps (``CanonicalLoRA``'s
    q/k/v and gate/up adapters by their Bridge target names: ``…self_attention.linear_q``)."""
    out = {}
    for path, m in model.named_modules():
        if isinstance(m, LoRALinear):
            out.update(m.named_adapters(path))
    return out


def decisions(model: nn.Module) -> dict[str, Decision]:
    """What each adapter would do if called now (strategy used and the reason), with what the
    last forward found about rebuilding its input (a norm keeping nothing at layer 0)."""
    return {path: a.decide(learned=True) for path, a in adapters(model).items()}


def set_strategy(model: nn.Module, strategy: Strategy | str) -> None:
    """Switch every adapter of ``model`` to ``strategy`` (numerics unchanged for regather)."""
    strategy = Strategy.parse(strategy)
    for a in adapters(model).values():
        a.strategy = strategy
        a.reset_fallback_log()


def _install_sequence_check(model: nn.Module) -> None:
    """Name the sizes when a sequence cannot be split over the TP ranks (SP on)."""
    config = getattr(model, "config", None)
    tp = getattr(config, "tensor_model_parallel_size", 1)
    if not getattr(config, "sequence_parallel", False) or tp <= 1 or getattr(model, "_regather_seq_check", None):
        return

    def check(module, args, kwargs):
        tokens = args[0] if args else kwargs.get("input_ids")
        if isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and tokens.shape[1] % tp:
            raise ValueError(
                f"sequence length {tokens.shape[1]} is not divisible by the tensor-parallel size {tp} "
                "(sequence parallelism splits the sequence across the TP ranks)"
            )

    model._regather_seq_check = model.register_forward_pre_hook(check, with_kwargs=True)


def install_shape_checks(model: torch.nn.Module) -> list:
    """Check every LoRA-wrapped linear's input across its TP group before the base layer runs.

    Returns the hook handles (``handle.remove()`` turns a check off).
    """
    handles = []
    for path, module in model.named_modules():
        if isinstance(module, LoRALinear):  # CanonicalLoRA's wrappers hold several adapters, one group
            group = next(iter(module.named_adapters(path).values())).tp_group

            def hook(mod, args, _group=group, _path=path):
                if args and isinstance(args[0], torch.Tensor):
                    debug.check_same_shape(args[0], _group, f"LoRA linear {_path!r}")

            handles.append(module.register_forward_pre_hook(hook))
    return handles
