"""Megatron's training machinery, TP=2 x DP=2 on 4 gloo ranks (no pipelining): the matrix of
``integration_cases`` against the gather path, DP replicas reading the same LoRA weights,
and the distributed optimizer's overlapped param all-gather against the synchronous one."""

import pytest
from integration_checks import ParamGatherTests, TopologyTests

pytestmark = pytest.mark.distributed


class TestTP2DP2(TopologyTests, ParamGatherTests):
    TOPOLOGY = "tp2_dp2"
