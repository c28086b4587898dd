"""The LoRA-A paths of regather.core on plain tensors and a gloo group, no framework imported.

Each path runs on a sequence shard laid out ``[s, b, h]`` (sequence dim 0, megatron) and
``[b, s, h]`` (dim 1, PyTorch-native tensor parallelism), from the same input, weights and
output gradient:

- regather (plain and early: anchor + deferred dA) computes the gather path's GEMMs on the same
  operands, so mid, the input gradient and dA are bit-identical (``torch.equal``);
- lowrank sums the same products in another order (dA over two sequence halves, then an
  all-reduce): it is bounded against a one-device fp64 reference at 16x the gather path's own
  error against it, a multiple of what fp32 rounding of the same GEMMs gives;
- with the input rebuilt from what the norm keeps (a recompute source) every path keeps the
  results of the path without it bit for bit and saves fewer bytes.
"""

import pytest
import torch
from tests.harness.numerics import check_rounding
from workers_core import fp64_reference, lora_a_paths

from regather.tools.cpu.dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

RUNS = [(dim, rc) for dim in (0, 1) for rc in (False, True)]


@pytest.fixture(scope="module")
def results():
    """One spawn per layout and source: every path's results per rank."""
    return {(dim, rc): run_ranks(lora_a_paths, 2, dim, rc, timeout=120) for dim, rc in RUNS}


@pytest.mark.parametrize("dim,rc", RUNS)
@pytest.mark.parametrize("kind", ["regather", "regather-early"])
def test_regather_is_the_gather_path_bit_for_bit(results, dim, rc, kind):
    for rank, res in enumerate(results[(dim, rc)]):
        for key in ("mid", "dx", "dA"):
            assert torch.equal(res[kind][key], res["gather"][key]), (rank, dim, rc, kind, key)
        assert res[kind]["in_flight"] == 0  # every scratch lease went back to the pool


@pytest.mark.parametrize("dim,rc", RUNS)
def test_lowrank_within_a_multiple_of_fp32_error(results, dim, rc):
    ref = fp64_reference(2, dim)
    for rank, res in enumerate(results[(dim, rc)]):
        gather_err = (res["gather"]["mid"].double() - ref["mid"]).abs().max().item()
        err = (res["lowrank"]["mid"].double() - ref["mid"]).abs().max().item()
        # same GEMM on the same rows for mid: lowrank's is the gather path's own rounding
        assert err <= 16 * max(gather_err, torch.finfo(torch.float32).eps * ref["mid"].abs().max().item())
        # dA: the full replicated LoRA-A's gradient, summed over the ranks' halves once (not t times)
        dA = res["lowrank"]["dA"].double()
        scale = ref["dA"].abs().max().item()
        assert (dA - ref["dA"]).abs().max().item() <= 16 * torch.finfo(torch.float32).eps * scale * ref["dA"].shape[1]
        # the rank's rows of the full dA are the sharded gather path's dA, to rounding: another
        # summation order, so both against the fp64 rows, within 3x the gather path's own error + 4
        # ulps (tests.harness.numerics; an element-wise rtol=1e-5 of the gather path's was
        # measured up to 0.3 of its bound on small entries; a wrong or unsummed row is O(1))
        rows = slice(rank * 2, rank * 2 + 2)
        check_rounding(dA[rows], res["gather"]["dA"], ref["dA"][rows], f"rank {rank} dA rows", dtype=torch.float32)


@pytest.mark.parametrize("dim", [0, 1])
def test_recompute_changes_nothing_and_saves_the_shard(results, dim):
    for rank, (kept, rebuilt) in enumerate(zip(results[(dim, False)], results[(dim, True)])):
        for kind in ("regather", "regather-early", "lowrank"):
            for key in ("mid", "dx", "dA"):
                assert torch.equal(rebuilt[kind][key], kept[kind][key]), (rank, dim, kind, key)
            # kept: the norm's input (which the norm keeps) + the shard; rebuilt: the norm's input only
            shard = 4 * 3 * 16 * 4  # s_local * b * h * fp32
            assert kept[kind]["saved"] - rebuilt[kind]["saved"] == shard, (rank, kind)
        # the gather path keeps the gathered input: t = 2 shards more than regather
        assert kept["gather"]["saved"] - kept["regather"]["saved"] == shard


@pytest.mark.parametrize("dim", [0, 1])
def test_shared_gather_is_separate_gathers_bit_for_bit(results, dim):
    for res in results[(dim, False)]:
        assert res["shared"] is True
