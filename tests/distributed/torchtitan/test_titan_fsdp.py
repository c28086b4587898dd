"""regather's torchtitan front end through torchtitan's own ``parallelize_llama`` (TP via
``Module.parallelize``, then FSDP2 ``fully_shard`` per block and root) at dp_shard 2 x TP2 on 4
gloo ranks (one spawn, workers_titan.fsdp_suite): the same bytes as at TP2 alone and the loss
and every LoRA gradient bit-identical to torchtitan's LoRA in the same layout. Bytes count the
parameters FSDP2 swaps in per block as parameters (alive when saved), not as activations.
"""

import pytest

from regather.tools.cpu import torchtitan_models

if torchtitan_models.missing():
    pytest.skip(torchtitan_models.missing(), allow_module_level=True)

import torch
import workers_titan as W

from regather.tools.cpu.dist import run_ranks

KIB = 1024
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def suite():
    return run_ranks(W.fsdp_suite, 4, timeout=180)


def test_fsdp2_by_tp_bit_identical_and_same_bytes(suite):
    for rank, res in enumerate(suite):
        frozen, ref = res["frozen"]["saved"], res["torchtitan"]
        assert (frozen, ref["saved"]) == (4018.5 * KIB, 5890.5 * KIB), rank
        assert res["regather"]["saved"] == 5378.5 * KIB
        assert res["regather+recompute"]["saved"] - frozen == 80 * KIB
        for name in ("regather", "regather+recompute"):
            got = res[name]
            torch.testing.assert_close(got["loss"], ref["loss"], rtol=0, atol=0)
            for n, g in ref["grads"].items():
                torch.testing.assert_close(got["grads"][n], g, rtol=0, atol=0, msg=lambda m: f"{rank} {name} {n}: {m}")
