"""regather.tools.cpu.quiet's log filter on torch's own records (the warnings filters are exercised
end to end by tests/distributed/tools/test_bench_repeat.py)."""

import logging

import pytest

from regather.tools.cpu.quiet import LOG_FILTERS, filter_warnings


def test_torchs_deprecated_partitioner_call_is_dropped_other_records_kept(caplog):
    name, text = LOG_FILTERS[0]
    filter_warnings()
    filter_warnings()  # idempotent: one drop per logger
    logger = logging.getLogger(name)
    assert sum(getattr(f, "text", None) == text for f in logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=name):
        logger.warning("is_opaque_value is deprecated, use is_custom_class_obj instead")
        logger.warning("something about the user's run")
    assert [r.getMessage() for r in caplog.records] == ["something about the user's run"]


def test_the_real_torch_record_where_torch_has_it(caplog):
    """torch 2.14's ``is_opaque_value`` (its partitioner calls it under torch.compile) logs the
    deprecation at each call (2.13's does not log)."""
    opaque = pytest.importorskip("torch._library.opaque_object")
    if not hasattr(opaque, "is_opaque_value"):
        pytest.skip("this torch has no torch._library.opaque_object.is_opaque_value")
    filter_warnings()
    with caplog.at_level(logging.WARNING, logger=LOG_FILTERS[0][0]):
        opaque.is_opaque_value(object())
    assert not [r for r in caplog.records if "is_opaque_value" in r.getMessage()]
