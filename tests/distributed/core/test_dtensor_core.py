"""The core pieces a PyTorch-native tensor-parallel front end needs (regather.torchtitan), on plain
tensors, DTensor and a gloo group:

- one early-regather anchor for the N adapters fed by one gathered input, with one backward gather
  shared per forward: mid, dX and every dA bit-identical to the gather path, on dim 0 and dim 1;
- byte accounting on DTensor activations (an AsyncCollectiveTensor counts as its buffer),
  parameters excluded when they are saved (a weight registered during the forward, as FSDP2 does),
  and DTensor's functional collectives counted with ``CollectiveBytes(functional=True)``;
- a norm producer's capture on a DTensor norm whose input is an AsyncCollectiveTensor.
"""

import pytest
import torch
from workers_dtensor import anchored_members, dtensor_accounting

from regather.tools.cpu.dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


@pytest.mark.parametrize("dim", [0, 1])
def test_one_anchor_for_n_adapters_is_the_gather_path_bit_for_bit(dim):
    for rank, res in enumerate(run_ranks(anchored_members, 2, dim, timeout=90)):
        ref, got = res["gather"], res["anchored"]
        for i in range(3):
            assert torch.equal(got["mid"][i], ref["mid"][i]), (rank, i)
            assert torch.equal(got["dA"][i], ref["dA"][i]), (rank, i)
        assert torch.equal(got["dx"], ref["dx"]), rank
        # the two regather members share one backward gather; the gather path gathers none
        assert (ref["gathers"], got["gathers"]) == (0, 1), rank
        assert res["in_flight"] == 0, rank


def test_dtensor_bytes_and_a_producer_on_an_async_collective_tensor():
    for rank, res in enumerate(run_ranks(dtensor_accounting, 2, timeout=90)):
        assert res["act"] == "AsyncCollectiveTensor"
        gathered = res["gathered_bytes"]
        # the gathered input once (its AsyncCollectiveTensor's buffer), the replicated weight never
        assert res["saved_False"] == res["saved_True"] == gathered, rank
        # DTensor's redistribution calls no torch.distributed function: only the mode sees it
        assert res["comm_False"] == {}, rank
        assert res["comm_True"] == {"all_gather": gathered // 2}, rank
        assert res["swapped"] == 2 * 16 * 4, rank  # the input only: the weight was a parameter then
        assert res["captured"] == dict(plain="Tensor", same_storage=True, rebuilt=True), rank
