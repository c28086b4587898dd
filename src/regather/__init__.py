"""regather: memory-lean LoRA adapters under tensor + sequence parallelism.

- :class:`LoRA` — the PEFT config for megatron-core; ``LoRA(sequence_parallel_input_regather=True)(model)``
- :class:`CanonicalLoRA` — the same with one adapter per q/k/v and gate/up (Hugging Face's layout)
- :class:`DoRA` — weight-decomposed LoRA (Megatron Bridge's other PEFT scheme) on the same adapters
- :class:`ParallelLinearAdapter` — one adapter beside a megatron parallel linear
- :func:`adapters`, :func:`decisions`, :func:`set_strategy` — a model's adapters, which strategy
  each runs and why, a strategy switch (whichever front end built them)
- :func:`merge`, :func:`unmerge`, :func:`merged`, :func:`delta_weight` — fold a megatron model's
  adapters into its base weights and back (:mod:`regather.megatron.merge`)

The package is layered (docs/design.md §11): :mod:`regather.core` (torch only: the LoRA-A paths,
collectives, scratch buffers, byte accounting, the recompute machinery) and :mod:`regather.ops`
(kernels) under two front ends, :mod:`regather.megatron` and :mod:`regather.torchtitan`; then
:mod:`regather.hf` (Hugging Face PEFT interop) and :mod:`regather.tools` (the ``regather`` command
and what it runs on CPU ranks, :mod:`regather.tools.cpu`). The names below are loaded on first use,
so ``import regather.core`` loads no front end. The package's entry points besides these names:
:mod:`regather.bridge` (Megatron Bridge's ``LoRA``), :mod:`regather.hf`, :mod:`regather.torchtitan`
and the command (``python -m regather``, :mod:`regather.__main__`).
"""

from __future__ import annotations

import importlib

__version__ = "0.2.0"

# public name -> the module that defines it
_PUBLIC = {
    "LoRA": "regather.megatron.lora",
    "CanonicalLoRA": "regather.megatron.canonical",
    "DoRA": "regather.megatron.dora",
    "LoRALinear": "regather.megatron.dense.wrapper",
    "ParallelLinearAdapter": "regather.megatron.dense.adapter",
    "Decision": "regather.core.decision",
    "Strategy": "regather.core.strategies",
    # merging is Megatron's (regather.merge was a module of these four names up to 0.2.0)
    "merge": "regather.megatron.merge",
    "unmerge": "regather.megatron.merge",
    "merged": "regather.megatron.merge",
    "delta_weight": "regather.megatron.merge",
}

__all__ = [*_PUBLIC, "adapters", "decisions", "set_strategy"]


def _front_ends():
    """The front ends imported in this process (each registers itself on import,
    :mod:`regather.core.frontends`): a model can only hold adapters of those."""
    from regather.core import frontends

    return list(frontends.registered().values())


def adapters(model) -> dict:
    """Every LoRA adapter of ``model`` by its path, whichever front end built it (megatron-core's
    :func:`regather.megatron.dense.model.adapters`, torchtitan's :func:`regather.torchtitan.adapters`)."""
    out = {}
    for front_end in _front_ends():
        out.update(front_end.adapters(model))
    return out


def decisions(model) -> dict:
    """What each adapter of ``model`` would do if called now — the strategy it runs and why, and
    whether its input is rebuilt — whichever front end built it."""
    out = {}
    for front_end in _front_ends():
        out.update(front_end.decisions(model))
    return out


def set_strategy(model, strategy) -> None:
    """Switch every adapter of ``model`` to ``strategy`` ("gather" | "regather" | "lowrank")."""
    for front_end in _front_ends():
        front_end.set_strategy(model, strategy)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'regather' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
