"""Helpers for running regather (and megatron-core) on CPU with gloo.

Nothing in the library proper depends on this package; tests, the demo and the
benchmark use it to run real megatron-core models on machines without a GPU.
"""

from regather.testing.megatron_cpu import enable_megatron_cpu

__all__ = ["enable_megatron_cpu"]
