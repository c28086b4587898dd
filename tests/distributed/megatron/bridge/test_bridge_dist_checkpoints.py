"""Checkpoints across Megatron Bridge 0.6.2 and regather: megatron ``dist_checkpointing``
(torch_dist, saved at TP=2, loaded at TP=2 and TP=1; workers_bridge_ckpt.dist_checkpoint_worker);
also a gated (SwiGLU) MLP at TP=2, whose linear_fc1 LoRA-B both declare through megatron's
SwiGLU sharded factory.

Bridge's side runs Bridge's own code: its model section (``_generate_model_state_dict``) and
adapter filter (``apply_peft_adapter_filter_to_state_dict``) for saving, ``load_peft_adapter_checkpoint``
for loading (``fully_parallel_load=False``: megatron's fully-parallel load exchanges shards
through CUDA buffers). dist_checkpointing runs on gloo after
``tests.harness.megatron_ckpt.enable_dist_checkpointing_cpu``."""

import pytest
import workers_bridge as W
import workers_bridge_ckpt as C
from tests.harness.bridge_env import INSTALL_HINT, bridge_available

from regather.tools.cpu.dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.skipif(not bridge_available(), reason=INSTALL_HINT),
              pytest.mark.timeout(600)]

N_ADAPTERS = 4 * W.SHAPE.num_layers


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bridge-dist-ckpt")
    return run_ranks(C.dist_checkpoint_worker, W.TP, str(root), timeout=400)


def test_bridge_saves_adapter_weights_only(dist_runs):
    for res in dist_runs:
        keys = res["bridge_adapter_ckpt_keys"]
        assert len(keys) == 2 * N_ADAPTERS and all(".adapter.linear_" in k and k.endswith(".weight") for k in keys)


@pytest.mark.parametrize("strategy", C.STRATEGIES)
def test_bridge_dist_checkpoint_loads_into_every_strategy(dist_runs, strategy):
    """Bridge's full checkpoint strictly (``load_state_dict(strict=True)``); its adapter-only one
    (no ``_extra_state``) through ``regather.megatron.dense.checkpoint.adapter_only`` + ``load_adapter_state_dict``
    and through Bridge's own ``load_peft_adapter_checkpoint``."""
    tol = 1e-6 if strategy == "lowrank" else 0.0
    for res in dist_runs:
        r = res[f"bridge->{strategy}"]
        assert r["full"] <= tol and r["adapter_part"] <= tol and r["bridge_loader"] <= tol, r


def test_regather_dist_checkpoints_load_into_bridge(dist_runs):
    """The Bridge way: the base into the unwrapped model (strict), then Bridge's own
    ``load_peft_adapter_checkpoint``, from regather's full and adapter-only checkpoints."""
    for res in dist_runs:
        assert res["regather_full->bridge"] == 0.0
        assert res["lowrank_full->bridge"] < 1e-6 and res["lowrank_adapters->bridge"] < 1e-6


@pytest.mark.parametrize("direction", ["tp1: bridge->regather", "tp1: lowrank->bridge"])
def test_tp2_checkpoints_load_at_tp1(dist_runs, direction):
    for res in dist_runs:
        r = res[direction]
        assert r["weights_equal"]  # the TP=1 adapters are the TP=2 shards put together, exactly
        assert r["loss_diff"] < 1e-5  # TP=1 vs TP=2: another summation order


@pytest.mark.parametrize("direction", ["gated: bridge->regather", "gated: bridge->lowrank", "gated: regather->bridge"])
def test_gated_fc1_dist_checkpoints_cross_load(dist_runs, direction):
    """Same TP: a plain ShardedTensor on one side would give rank 0 ``[gate_0; gate_1]`` of the
    other's ``[gate_0; gate_1; up_0; up_1]`` and change the outputs."""
    tol = 1e-6 if "lowrank" in direction else 0.0
    for res in dist_runs:
        assert res["gated: bridge fc1 LoRA-B is a factory"] and res["gated: regather fc1 LoRA-B is a factory"]
        r = res[direction]
        assert r["before"] > 1e-3, r  # other adapter weights until the load
        assert r["after"] <= tol, r
