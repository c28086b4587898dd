"""The CPU patches for megatron-core are idempotent and do what docs/design.md §6 says."""

import torch

from regather.tools.cpu.megatron_cpu import enable_megatron_cpu


def test_patches_are_idempotent_and_cpu_only():
    assert not torch.cuda.is_available()
    assert enable_megatron_cpu() is True
    assert enable_megatron_cpu() is True
    assert torch.cuda.current_device() == "cpu"


def test_rng_tracker_forks_cpu_state_reproducibly():
    enable_megatron_cpu()
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.CudaRNGStatesTracker()
    tracker.add("a", 123)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched
    with tracker.fork("a"):
        second = torch.rand(3)
    assert not torch.equal(first, second)  # the tracked stream advanced
    torch.manual_seed(123)
    assert torch.equal(first, torch.rand(3))


def test_torch_norm_accepts_sequence_parallel_and_tags_params():
    enable_megatron_cpu()
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                               tensor_model_parallel_size=2, sequence_parallel=True)
    norm = WrappedTorchNorm(config, 8)
    assert isinstance(norm, torch.nn.LayerNorm)
    assert all(p.sequence_parallel for p in norm.parameters())
    assert config.sequence_parallel  # the caller's config is not modified
