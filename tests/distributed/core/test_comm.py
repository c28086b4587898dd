"""regather.core.comm on two gloo ranks: sync and async forms agree, bad sizes are named."""

import pytest
import torch
from workers_comm import exercise_comm

from regather.tools.cpu.dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def test_collectives_sync_and_async():
    results = run_ranks(exercise_comm, 2, timeout=90)
    expected_gather = torch.cat([torch.arange(6.).view(3, 2), torch.arange(6.).view(3, 2) + 10])
    for _rank, r in enumerate(results):
        assert torch.equal(r["gather_sync"], expected_gather)
        assert torch.equal(r["gather_async"], expected_gather)
        assert torch.equal(r["scatter_sync"], torch.full((2, 3), 3.0))
        assert torch.equal(r["scatter_async"], torch.full((2, 3), 3.0))
        assert torch.equal(r["all_reduce"], torch.full((5,), 3.0))
        assert r["errors"] == [
            "all_gather_seq: output buffer (5, 2) torch.float32 does not match input (3, 2) "
            "torch.float32 gathered over 2 ranks on dim 0 (6, 2)",
            "reduce_scatter_seq: dimension 0 of (3, 2) (3) is not divisible by the group size 2",
            "all_reduce_: the tensor must be contiguous (it is reduced in place)",
        ]
