"""Megatron's training machinery, TP=2 x PP=2 on 4 gloo ranks (1F1B schedule): the matrix of
``integration_cases`` against the gather path."""

import pytest
from integration_checks import TopologyTests

pytestmark = pytest.mark.distributed


class TestTP2PP2(TopologyTests):
    TOPOLOGY = "tp2_pp2"
