"""Megatron's training machinery, TP=2 on 2 gloo ranks (no pipelining): the matrix of
``integration_cases`` against the gather path."""

import pytest
from integration_checks import TopologyTests

pytestmark = pytest.mark.distributed


class TestTP2(TopologyTests):
    TOPOLOGY = "tp2"
