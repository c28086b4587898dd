"""A reason is logged once per model, whatever numbers it carries; the numbers stay visible. (And
SavedBytes counts a storage saved at a freed storage's address apart: numbers come from counting.)

A :class:`~regather.core.decision.Reason` is one sentence for every adapter and layer it applies
to, and carries what was measured (a difference, a rank) as its ``detail``: the fallback log keys
on the sentence and puts the details in the record's attributes; ``str(decision)`` shows both.
"""

import logging
import pickle

from regather.core.decision import Decision, Reason, described
from regather.core.fallback_log import FallbackLog
from regather.core.strategies import Strategy

SENTENCE = "recomputing the norm does not reproduce the adapter input bit for bit; the input is kept"


def test_one_line_per_sentence_whatever_the_details(caplog):
    log = FallbackLog()
    with caplog.at_level(logging.INFO, logger="regather"):
        for layer, diff in enumerate((1.0000001192092896, 2.5e-07, 3.0)):
            log.report("recompute_adapter_inputs requested, keeping the input",
                       Reason(SENTENCE, detail=f"max |diff| {diff}"), f"layers.{layer}.qkv", logging.WARNING)
        log.flush()
        log.report("recompute_adapter_inputs requested, keeping the input",
                   Reason(SENTENCE, detail="max |diff| 9.0"), "layers.3.qkv", logging.WARNING)
        log.flush()  # already logged: no second line
    records = [r for r in caplog.records if hasattr(r, "regather_reason")]
    assert len(records) == 1
    (record,) = records
    assert record.regather_reason == SENTENCE and type(record.regather_reason) is str
    assert record.regather_adapters == ("layers.0.qkv", "layers.1.qkv", "layers.2.qkv")
    assert record.regather_details == {"layers.0.qkv": "max |diff| 1.0000001192092896",
                                       "layers.1.qkv": "max |diff| 2.5e-07", "layers.2.qkv": "max |diff| 3.0"}
    assert "max |diff|" not in record.getMessage()


def test_decisions_show_the_detail_and_survive_pickling():
    reason = Reason(SENTENCE, detail="max |diff| 0.5")
    d = Decision(Strategy.REGATHER, Strategy.REGATHER, None, recompute_reason=reason)
    assert str(d) == f"regather, input kept (recompute asked: {SENTENCE} (max |diff| 0.5))"
    back = pickle.loads(pickle.dumps(d))
    assert back == d and back.recompute_reason.detail == "max |diff| 0.5"
    assert reason == SENTENCE and hash(reason) == hash(SENTENCE)  # compares as its sentence
    assert described("plain sentence") == "plain sentence"


def test_saved_bytes_counts_a_storage_at_a_reused_address_apart():
    """A storage saved and freed inside the block (a graph branch nothing keeps) leaves its address
    to a later allocation; a tensor saved there later is another storage and counts too. Two
    storages over one Python buffer have the same address, as a reused allocation would."""
    import torch

    from regather.core.accounting import SavedBytes

    buf = bytearray(64 * 4)
    w = torch.ones(64, requires_grad=True)
    with SavedBytes(exclude=[w]) as saved:
        first = torch.frombuffer(buf, dtype=torch.float32)
        branch = first * w  # saves `first` (256 B) for w's gradient
        address = first.untyped_storage().data_ptr()
        del branch, first  # the branch is dropped: its saved storage is freed
        second = torch.frombuffer(buf, dtype=torch.float32)
        assert second.untyped_storage().data_ptr() == address
        kept = second * w
    assert saved.total == 2 * 64 * 4
    assert kept.requires_grad
