"""Megatron's training machinery, TP=2 x PP=2 with a virtual pipeline (2 chunks per stage,
interleaved 1F1B) on 4 gloo ranks: the matrix of ``integration_cases`` against the gather
path. gloo's batched isend/irecv mixes tensors up here, so ``batch_p2p_comm`` is off
(docs/design.md §8; ``TrainSpec.batch_p2p_comm``)."""

import pytest
from integration_checks import TopologyTests

pytestmark = pytest.mark.distributed


class TestTP2PP2VPP2(TopologyTests):
    TOPOLOGY = "tp2_pp2_vpp2"
