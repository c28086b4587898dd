"""regather: memory-lean LoRA adapters under tensor + sequence parallelism.

- :class:`LoRA` — the PEFT config for megatron-core; ``LoRA(sequence_parallel_input_regather=True)(model)``
- :class:`CanonicalLoRA` — the same with one adapter per q/k/v and gate/up (Hugging Face's layout)
- :class:`ParallelLinearAdapter` — one adapter beside a megatron parallel linear
- :func:`decisions` — which strategy each adapter runs, and why

The package is layered (docs/design.md §11): :mod:`regather.core` (torch only: the LoRA-A paths,
collectives, scratch buffers, byte accounting, the recompute machinery) and :mod:`regather.ops`
(kernels) under two front ends, :mod:`regather.megatron` and :mod:`regather.torchtitan`; then
:mod:`regather.hf` (Hugging Face PEFT interop), :mod:`regather.testing` (the CPU harness) and
:mod:`regather.tools` (the ``regather`` command). The names below are loaded on first use, so
``import regather.core`` loads no front end.
"""

from __future__ import annotations

import importlib

__version__ = "0.2.0"

# public name -> the module that defines it
_PUBLIC = {
    "LoRA": "regather.megatron.lora",
    "CanonicalLoRA": "regather.megatron.canonical",
    "LoRALinear": "regather.megatron.dense.wrapper",
    "ParallelLinearAdapter": "regather.megatron.dense.adapter",
    "Decision": "regather.megatron.dense.adapter",
    "Strategy": "regather.core.strategies",
    "adapters": "regather.megatron.dense.model",
    "decisions": "regather.megatron.dense.model",
    "set_strategy": "regather.megatron.dense.model",
}

__all__ = list(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'regather' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
