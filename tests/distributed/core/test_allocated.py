"""regather.core.allocated.AllocatedBytes on two gloo ranks: a settled region counts the blocks that
outlive it, whichever thread drops a collective's tensors last (the module doc says why that races)."""

import pytest
from workers_allocated import SHAPE, settled_regions

from regather.tools.cpu.dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

PAIRS = 8


def test_settled_regions_count_what_outlives_them():
    for rank, r in enumerate(run_ranks(settled_regions, 2, PAIRS, timeout=120)):
        # the smaller of two settled regions: a worker descheduled across the drains can only add bytes
        assert r["dying"] == [0] * PAIRS, (rank, r)
        kept = 2 * SHAPE[0] * SHAPE[1] * SHAPE[2] * 4  # one gathered output, fp32
        assert r["kept"] == [kept] * PAIRS, (rank, r)
        print(f"rank {rank}: unsettled regions with phantom bytes: {r['unsettled_with_phantoms']} of {PAIRS}")
