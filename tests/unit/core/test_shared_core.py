"""What both front ends take from core: the moment's reasons, a reason's log level, the first
rebuild's bit-for-bit check, and the typed outcome of a producer's capture.

In-process, torch only: the checkpoint test runs under real ``torch.utils.checkpoint`` passes.
"""

import logging
import pickle

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from regather.core.decision import Decision, Reason, expected, level_of, surprising, with_detail
from regather.core.moment import EVAL, FROZEN_A, NO_GRAD, RunState, in_activation_checkpoint, moment_reason
from regather.core.recompute.producers import NormProducer
from regather.core.recompute.sources import Kept, Recomputed
from regather.core.recompute.verify import first_rebuild, mismatch
from regather.core.strategies import Strategy

IN_CKPT = expected("inside a checkpoint")


def _state(**changes) -> RunState:
    base = dict(training=True, grad_enabled=True, in_recompute=False, lora_a_trainable=True)
    return RunState(**dict(base, **changes))


@pytest.mark.parametrize("changes,want", [
    (dict(training=False, grad_enabled=False), EVAL),  # the first rule that fails
    (dict(grad_enabled=False, in_recompute=True), NO_GRAD),
    (dict(in_recompute=True, lora_a_trainable=False), IN_CKPT),
    (dict(lora_a_trainable=False), FROZEN_A),
    ({}, None),
])
def test_moment_reason_in_order(changes, want):
    assert moment_reason(_state(**changes), IN_CKPT) == want


def test_moment_levels_are_fields_not_wording():
    assert level_of(EVAL) == level_of(NO_GRAD) == level_of(IN_CKPT) == logging.INFO
    assert level_of(FROZEN_A) == logging.WARNING  # no level of its own: the default
    assert level_of(FROZEN_A, logging.INFO) == logging.INFO
    assert level_of("module is in eval mode") == logging.WARNING  # the same words, no field: not INFO
    assert level_of(surprising("differs", detail="max |diff| 1.0"), logging.INFO) == logging.WARNING


def test_reason_level_survives_pickle_and_detail():
    reason = with_detail(expected("kept"), "in the last forward")
    assert (reason.detail, reason.level) == ("in the last forward", logging.INFO)
    decision = Decision(Strategy.REGATHER, Strategy.REGATHER, None, recompute_reason=reason)
    back = pickle.loads(pickle.dumps(decision))
    assert back == decision and back.recompute_reason.level == logging.INFO
    assert repr(Reason("x")) == "Reason('x', detail=None)"


def test_in_activation_checkpoint_in_both_passes():
    seen = []

    def block(x):
        seen.append(in_activation_checkpoint())
        return x.sin()

    x = torch.randn(4, requires_grad=True)
    assert not in_activation_checkpoint()
    checkpoint(block, x, use_reentrant=False).sum().backward()  # forward, then its recompute
    checkpoint(block, x, use_reentrant=True).sum().backward()
    assert seen == [True, True, False, True]  # reentrant: its first forward runs under no_grad, outside


def test_mismatch_names_what_differs():
    a = torch.tensor([1.0, 2.0])
    assert mismatch(a.clone(), a) is None
    assert mismatch(a + torch.tensor([0.0, 0.5]), a) == "max |diff| 0.5"
    assert mismatch(a[:1], a) == "shape (1,) vs (2,)"
    assert mismatch(a.double(), a) == "dtype torch.float64 vs torch.float32"


def test_capture_is_typed_and_first_rebuild_is_bit_for_bit():
    norm = torch.nn.LayerNorm(8)
    producer = NormProducer(norm, "the norm")
    inp = torch.randn(3, 8, requires_grad=True)
    y = norm(inp)
    captured = producer.capture(y)
    assert isinstance(captured, Recomputed) and captured.producer is producer
    assert first_rebuild(producer, captured.tensors, y) is None
    assert producer.capture(y) == Kept("the adapter input is not the norm's output of this forward")  # consumed
    producer.remove()
