"""Property-based parity: hypothesis draws adapter shapes, dtypes, LoRA rank, dropout and
micro-batch counts; every strategy runs them against the gather path on two gloo ranks
(regather bit-exact; lowrank fp32 relative error <= 1e-6). One hypothesis example is a list
of cases, so the ranks are spawned once per example, not once per case."""

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from workers_reliability import property_cases

from regather.tools.cpu.dist import run_ranks

T = 2
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

case = st.fixed_dictionaries({
    "s_local": st.integers(1, 4),
    "b": st.integers(1, 3),
    "h": st.sampled_from([8, 16, 24, 64]),
    "o": st.sampled_from([2, 8, 30, 64]),
    "r": st.sampled_from([2, 4, 8, 16]),
    "dtype": st.sampled_from(["float32", "bfloat16"]),
    "dropout": st.sampled_from([0.0, 0.1, 0.5]),
    "dropout_position": st.sampled_from(["pre", "post"]),
    "micro_batches": st.integers(1, 2),
    "seed": st.integers(0, 2**16),
})


@settings(max_examples=2, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(cases=st.lists(case, min_size=12, max_size=12))
def test_regather_matches_gather_for_drawn_cases(cases):
    failures = run_ranks(property_cases, T, cases, timeout=240)
    for rank, fails in enumerate(failures):
        assert not fails, f"rank {rank}:\n" + "\n".join(fails)
