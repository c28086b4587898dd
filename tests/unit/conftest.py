import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def single_rank_group(tmp_path):
    """A real one-rank gloo group (megatron mappings need a group even at TP=1)."""
    from regather.testing import enable_megatron_cpu

    enable_megatron_cpu()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
