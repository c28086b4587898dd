"""regather.core.comm over a sequence dim other than 0, against DTensor's redistributions.

PyTorch-native tensor parallelism shards ``[b, s, h]`` on dim 1. Where ``b = 1`` the rank blocks
are row blocks and the collective writes in place; for ``b > 1`` they are not, and comm gathers
the blocks stacked and copies them in place, as ``torch.distributed.tensor`` does — so the
results are DTensor's ``Shard(dim) -> Replicate`` and ``Partial -> Shard(dim)``, bit for bit.
"""

import pytest
from workers_core import collectives_on_dims

from regather.tools.cpu.dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def test_gather_and_reduce_scatter_are_dtensors_on_every_dim():
    for rank, res in enumerate(run_ranks(collectives_on_dims, 2, timeout=90)):
        for b in (1, 3):
            for dim in (0, 1):
                got = res[(b, dim)]
                assert got["gather"] and got["scatter"], (rank, b, dim, got)
        assert res[(3, 1)]["shapes"] == ((3, 8, 5), (3, 4, 5))
        assert res["gather_seq_grad_True"] and res["gather_seq_grad_False"], rank
        assert res["errors"] == [
            "all_gather_seq: sequence dim 3 is out of range for a 3-D input (3, 4, 5)",
            "reduce_scatter_seq: dimension 1 of (2, 3) (3) is not divisible by the group size 2",
        ]
