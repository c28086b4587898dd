"""State-dict layout of a LoRA-wrapped megatron GPT (TP=2) and partial loads
(regather.megatron.dense.checkpoint): Megatron Bridge's keys, strict loading of both regather layouts,
a frozen model's checkpoint into the wrapped model, an adapter-only checkpoint."""

import functools

import pytest
import torch
from workers_checkpoint import QKV, key_cases, partial_cases

from regather.tools.cpu.dist import run_ranks

T = 2
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


@functools.cache
def _run(fn):
    return run_ranks(fn, T, timeout=240)


@pytest.mark.parametrize("strategy", ["gather", "regather", "lowrank"])
def test_state_dict_uses_bridge_keys_and_loads_strictly(strategy):
    for _rank, res in enumerate(_run(key_cases)):
        got = res[strategy]
        assert got["keys"] == [f"{QKV}.{k}" for k in (
            "weight", "bias", "_extra_state", "adapter.linear_in.weight", "adapter.linear_in._extra_state",
            "adapter.linear_out.weight", "adapter.linear_out._extra_state")], got["keys"]
        torch.testing.assert_close(got["own_logits"], got["logits"], rtol=0, atol=0)
        assert got["old_has_to_wrap"]
        torch.testing.assert_close(got["old_logits"], got["logits"], rtol=0, atol=0)
        assert got["twice_error"] and "twice" in got["twice_error"] and "to_wrap.weight" in got["twice_error"]


@pytest.mark.parametrize("strategy", ["regather", "lowrank"])
def test_frozen_checkpoint_and_adapter_only_checkpoint_load_into_wrapped_model(strategy):
    for _rank, res in enumerate(_run(partial_cases)):
        got = res[strategy]
        assert got["adapters_kept"] and got["base_from_plain"]
        torch.testing.assert_close(got["zero_b_logits"], res["plain_logits"], rtol=0, atol=0)
        assert got["missing_error"].startswith("KeyError") and "decoder.final_layernorm.weight" in got["missing_error"]
        assert got["unchanged_after_error"], "a refused load changed weights"
        assert got["adapter_only_keys_ok"] and got["base_kept"]
        torch.testing.assert_close(got["adapter_logits"], got["src_logits"], rtol=0, atol=0)
        assert got["extra_error"].startswith("KeyError") and "unexpected" in got["extra_error"]
        assert got["base_only_has_no_adapter"]
