"""``regather bench``'s command line: what it refuses before any rank starts (no ranks spawned here)."""

import io

import pytest

from regather.megatron.canonical import CANONICAL_TARGETS
from regather.tools.bench.runner import DEFAULT_TARGETS, BenchSpec, progress_printer, target_problems


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


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _run_progress(tty: bool) -> str:
    names = ["gather", "regather-plain-recompute"]
    stream = _Stream(tty)
    progress = progress_printer(0, names, 20, False, stream=stream)
    for step in range(20):
        for name in names:
            progress(name, step, 0.01)
    return stream.getvalue()


def test_progress_rewrites_one_line_on_a_terminal_only():
    """A log gets ten plain lines (a tenth of the steps each), not one 5 KB line of carriage returns;
    the names are padded to the longest so the columns line up."""
    logged = _run_progress(tty=False)
    assert "\r" not in logged and len(logged.splitlines()) == 10
    assert all(" gather                   " in line or "regather-plain-recompute " in line for line in logged.splitlines())
    shown = _run_progress(tty=True)
    assert shown.count("\r") == 40 and shown.endswith("\n") and shown.count("\n") == 1
