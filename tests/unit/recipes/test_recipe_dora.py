"""``peft_scheme=regather.bridge.DoRA(...)`` in Megatron Bridge 0.6.2's PEFT recipes, as a user writes it: the
recipe keeps the instance (its ``peft_scheme="dora"`` builds Bridge's own ``DoRA``, whose fields regather's
has), Bridge's ``runtime_config_update`` validates it at the recipe's parallelism and at TP2 + SP, and the
run config's YAML names ``regather.bridge.DoRA`` and reads back through ``ConfigContainer.from_yaml``."""

from __future__ import annotations

import dataclasses
import os

import pytest
from tests.harness import recipes as R

pytestmark = pytest.mark.timeout(600)
DENSE = ("qwen3_8b", "llama3_70b")  # DoRA adapts dense linears only




def _bridge_fields(peft) -> dict:
    from megatron.bridge.peft.dora import DoRA

    return {f.name: getattr(peft, f.name) for f in dataclasses.fields(DoRA) if f.init}


def _finalize(cfg, world_size, environ, pretrained):
    from megatron.bridge.training.config import runtime_config_update

    cfg.checkpoint.pretrained_checkpoint = pretrained
    R.without_gpu_kernels(cfg.model)
    environ["WORLD_SIZE"] = str(world_size)
    runtime_config_update(cfg)
    return cfg


@pytest.mark.parametrize("name", DENSE)
def test_recipe_takes_regather_dora(bridge, name, environ, tmp_path):
    from megatron.bridge.peft.dora import DoRA as BridgeDoRA
    from megatron.bridge.training.config import ConfigContainer
    from megatron.bridge.utils import instantiate_utils

    recipe = R.RECIPES[name]
    theirs = recipe.config(peft_scheme="dora").peft
    assert type(theirs) is BridgeDoRA
    ours = bridge.DoRA(**_bridge_fields(theirs), sequence_parallel_input_strategy="regather",
                       recompute_adapter_inputs=True, recompute_dora_output=True)
    assert isinstance(ours, BridgeDoRA) and _bridge_fields(ours) == _bridge_fields(theirs)
    pretrained = str(tmp_path / "pretrained")
    os.makedirs(pretrained)
    for tp in (None, 2):
        cfg = recipe.config(peft_scheme=ours)
        assert cfg.peft is ours
        if tp is not None:
            cfg.model.tensor_model_parallel_size, cfg.model.sequence_parallel = tp, True
        _finalize(cfg, recipe.gpus if tp is None else tp, environ, pretrained)
        assert cfg.peft is ours
    path = tmp_path / "run_config.yaml"
    cfg.to_yaml(str(path))
    assert "_target_: regather.bridge.DoRA" in path.read_text()
    instantiate_utils.register_allowed_target_prefix("regather")
    loaded = ConfigContainer.from_yaml(str(path))
    assert type(loaded.peft) is bridge.DoRA and loaded.peft == cfg.peft
    assert loaded.peft.regather_config().recompute_dora_output


def test_a_bad_dora_field_is_refused_at_validate(bridge, environ, tmp_path):
    recipe = R.RECIPES["qwen3_8b"]
    cfg = recipe.config(peft_scheme=bridge.DoRA())
    cfg.peft.dora_norm = "per_tensor"
    pretrained = str(tmp_path / "pretrained")
    os.makedirs(pretrained)
    with pytest.raises(ValueError, match="per_tensor"):
        _finalize(cfg, 1, environ, pretrained)
