"""regather: memory-lean LoRA adapters for Megatron-core under tensor + sequence parallelism."""

__version__ = "0.1.0"
