"""regather: memory-lean LoRA adapters for Megatron-core under tensor + sequence parallelism.

- :class:`LoRA` — the PEFT config; ``LoRA(sequence_parallel_input_regather=True)(model)``
- :class:`CanonicalLoRA` — the same with one adapter per q/k/v and gate/up (Hugging Face's layout)
- :class:`ParallelLinearAdapter` — one adapter beside a megatron parallel linear
- :func:`decisions` — which strategy each adapter runs, and why
"""

__version__ = "0.2.0"

from regather.adapter import Decision, ParallelLinearAdapter
from regather.lora import LoRA, LoRALinear, adapters, decisions, set_strategy
from regather.canonical import CanonicalLoRA
from regather.strategies import Strategy

__all__ = [
    "LoRA",
    "CanonicalLoRA",
    "LoRALinear",
    "ParallelLinearAdapter",
    "Decision",
    "Strategy",
    "adapters",
    "decisions",
    "set_strategy",
]
