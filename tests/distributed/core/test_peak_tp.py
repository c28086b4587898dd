"""regather.core.peak on two gloo ranks: a row-parallel LoRA-B on this rank's rows, its weight gathered
(bit for bit the classic output and input gradient; LoRA-B's weight gradient under SP summed in other
parts: the fp64 rule), and the input junction (bit for bit autograd's sum, in place)."""

import pytest
from tests.harness.numerics import check_rounding
from workers_peak_tp import OUT, B, S, junction_cases, row_cases

from regather.tools.cpu.dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setenv("REGATHER_MIN_CHUNK_BYTES", "1024")  # several chunks of these small tensors


def test_row_lora_b_on_this_ranks_rows(small_chunks):
    for rank, r in enumerate(run_ranks(row_cases, 2, timeout=120)):
        for sp in (True, False):
            classic, lean, ref = r[(sp, "classic")], r[(sp, "lean")], r[(sp, "fp64")]
            assert lean["in_place"]
            for key in ("y", "d_partial"):
                assert lean[key].equal(classic[key]), (rank, sp, key)
            if sp:  # dB: every rank's tokens summed apart, then reduce-scattered (another order)
                check_rounding(lean["dB"], classic["dB"], ref["dB"], f"rank {rank} dB")
            else:  # without SP the classic backward, bit for bit
                assert lean["dB"].equal(classic["dB"]), (rank, "dB")
            # the same inputs made in both regions: the classic one holds LoRA-B's columns gathered for the
            # whole sequence, [s, b, o], and its output and scaled copy; lean one chunk of its output
            classic_peak, lean_peak = r[(sp, "classic", "peak")], r[(sp, "lean", "peak")]
            print(f"rank {rank} SP {sp}: peak classic {classic_peak} B, lean {lean_peak} B")
            assert classic_peak - lean_peak >= S * B * OUT * 4, (rank, sp, classic_peak, lean_peak)


def test_junction_adds_lora_input_gradient_in_place(small_chunks):
    for rank, r in enumerate(run_ranks(junction_cases, 2, timeout=120)):
        for replicated in (False, True):
            autograd, junction = r[(replicated, False)], r[(replicated, True)]
            for key in ("dx", "dA"):  # at TP2 the chunked all-reduce sums the same two terms
                assert junction[key].equal(autograd[key]), (rank, replicated, key)
