"""Checkpoints across Megatron Bridge 0.6.2 and regather: state dicts (workers_bridge_ckpt).

A Bridge LoRA ``state_dict()`` loads into regather's model with ``strict=True`` under every
strategy and gives Bridge's outputs and gradients; regather writes back exactly Bridge's state
dict; a regather checkpoint loads into Bridge's model along the path Bridge itself uses (base
into the unwrapped model, adapters through ``adapter_key_filter`` with ``strict=False``)."""

import pytest
import workers_bridge as W
import workers_bridge_ckpt as C
from tests.harness.bridge_env import INSTALL_HINT, bridge_available

from regather.tools.cpu.dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.skipif(not bridge_available(), reason=INSTALL_HINT),
              pytest.mark.timeout(600)]

N_ADAPTERS = 4 * W.SHAPE.num_layers


@pytest.fixture(scope="module")
def runs():
    return run_ranks(C.state_dict_worker, W.TP, timeout=240)


def _wrapped_base_keys(keys):
    return [k for k in keys if ".adapter." not in k and k.rsplit(".", 2)[-2] in W.TARGETS]


def test_bridge_state_dict_layout(runs):
    for res in runs:
        keys = res["bridge_keys"]
        assert not any(".to_wrap." in k for k in keys)  # Bridge's wrapper writes the base unwrapped
        assert len(res["bridge_extra_state"]) == 2 * N_ADAPTERS  # linear_in/out are megatron linears


def test_bridge_does_not_strict_load_its_own_state_dict(runs):
    """Evidence for how Bridge loads (module doc of workers_bridge_ckpt): its wrapper has no
    load hook, so a strict load of its own state dict fails, and a lenient one skips every
    wrapped base weight (they come from the pretrained checkpoint, loaded before wrapping)."""
    for res in runs:
        assert res["bridge_self_strict"].startswith("Error(s) in loading state_dict")
        lenient = res["bridge_self_lenient"]
        assert lenient["missing"] and all(".to_wrap." in k for k in lenient["missing"])
        assert lenient["unexpected"] == sorted(_wrapped_base_keys(res["bridge_keys"]))


@pytest.mark.parametrize("strategy", C.STRATEGIES)
def test_bridge_state_dict_loads_strictly_into_every_strategy(runs, strategy):
    for res in runs:
        r = res[strategy]
        assert r["before"] > 1e-3  # the adapters were initialised otherwise: the load mattered
        if strategy == "lowrank":  # same function, gradients in another summation order
            assert r["after"] < 1e-6, r["after"]
        else:
            assert r["after"] == 0.0
        assert r["writes_bridge_state_dict"]  # same keys, same order, same tensors, same _extra_state


def test_bridge_adapter_part_loads_into_regather(runs):
    for res in runs:
        assert res["adapter_part_into_regather"] == 0.0


def test_regather_checkpoint_loads_into_bridge_the_bridge_way(runs):
    for res in runs:
        assert res["base_into_unwrapped_strict"] == {"missing": [], "unexpected": []}
        r = res["regather_into_bridge"]
        assert r["unexpected"] == [] and not any(".adapter." in k for k in r["missing"])
        assert r["adapter_keys"] == res["bridge_own_filtered_keys"] and len(r["adapter_keys"]) == 2 * N_ADAPTERS
        assert r["diff"] == 0.0

