"""``regather bench``'s command line: what it refuses before any rank starts (no ranks spawned here)."""

import pytest

from regather.megatron.canonical import CANONICAL_TARGETS
from regather.tools.bench.runner import DEFAULT_TARGETS, BenchSpec, target_problems


def test_default_targets_pass():
    assert target_problems(DEFAULT_TARGETS) == []
    assert target_problems(CANONICAL_TARGETS, canonical=True) == []
    assert BenchSpec().problems() == []


def test_canonical_refuses_a_fused_linear_with_canonical_loras_own_words():
    from regather.megatron.canonical import CanonicalLoRA

    with pytest.raises(ValueError) as raised:
        CanonicalLoRA(target_modules=["linear_qkv"])
    assert target_problems(("linear_qkv",), canonical=True) == [f"--canonical --targets: {raised.value}"]
    assert BenchSpec(canonical=True, targets=("linear_fc1",)).problems()


def test_a_canonical_name_on_the_fused_gpt_names_both_lists():
    (problem,) = target_problems(("linear_q", "linear_proj"))
    assert "['linear_q']" in problem and "with --canonical" in problem
    (problem,) = target_problems(("linear_q",), hint=False)
    assert "--canonical" not in problem
