"""Bad input to ``regather.bridge.LoRA``, and Bridge's values kept (issue 27, item 3).

Measured with Bridge 0.6.2 (2026-12-06):

- ``regather.bridge.LoRA(target_modules="linear_qkv")`` is accepted and its regather config becomes
  ``['l', 'i', 'n', 'e', ...]`` (``list(self.target_modules)``); ``regather.LoRA`` rejects the same
  string. Expected: an error naming the value, at construction and again when Bridge's ``validate()``
  re-runs ``__post_init__`` (a recipe sets ``cfg.peft.target_modules`` after construction).
- ``regather.bridge.LoRA(lora_A_init_method="uniform")`` raised at construction, while Bridge's LoRA
  accepts it: its plain ``nn.Linear`` adapters (``LinearAdapter``: Kaiming-uniform LoRA-A) honour it,
  and regather hands plain ``nn.Linear`` targets to Bridge's own ``transform``. Expected: accepted,
  on plain linears exactly Bridge's adapters, and refused with the reason, before the model changes,
  where it selects a megatron linear (no parallel-linear adapter has it, Bridge's included).

"""

from __future__ import annotations

import os

import pytest
import torch
from tests.harness import recipes as R

pytestmark = pytest.mark.timeout(300)



def test_string_target_modules_rejected_at_construction(bridge):
    with pytest.raises((TypeError, ValueError), match="linear_qkv"):
        bridge.LoRA(target_modules="linear_qkv")


def test_string_target_modules_rejected_when_validate_reruns_post_init(bridge, tmp_path):
    from megatron.bridge.training.config import runtime_config_update

    cfg = R.RECIPES["qwen3_8b"].config()
    cfg.peft = bridge.LoRA(target_modules=["linear_qkv", "linear_proj"], dim=8, alpha=16)
    cfg.checkpoint.pretrained_checkpoint = str(tmp_path)
    cfg.peft.target_modules = "linear_qkv"  # set after construction, as the recipes set their fields
    saved = dict(os.environ)
    os.environ["WORLD_SIZE"] = "1"
    try:
        with pytest.raises((TypeError, ValueError), match="linear_qkv"):
            runtime_config_update(cfg)  # finetune()'s first step: validate() re-runs __post_init__
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_bridge_accepts_uniform_lora_a_init():
    """The reference behaviour the next two tests ask of regather.bridge.LoRA."""
    BridgeLoRA = R.import_bridge().LoRA
    assert BridgeLoRA(lora_A_init_method="uniform").lora_A_init_method == "uniform"


def test_uniform_lora_a_init_accepted(bridge):
    assert bridge.LoRA(lora_A_init_method="uniform").lora_A_init_method == "uniform"


class _PlainLinears(torch.nn.Module):
    """Plain ``nn.Linear`` targets (what Bridge adapts with its ``LinearAdapter``)."""

    def __init__(self):
        super().__init__()
        self.linear_qkv = torch.nn.Linear(16, 48)
        self.linear_proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.linear_proj(self.linear_qkv(x)[..., :16])


def _adapted(lora_cls):
    torch.manual_seed(0)
    model = _PlainLinears()
    torch.manual_seed(1)  # the adapters' init draws from the default generator
    peft = lora_cls(target_modules=["linear_qkv", "linear_proj"], dim=4, alpha=8, lora_A_init_method="uniform")
    (model,) = R.apply_peft(peft, model)
    return model


def test_uniform_lora_a_init_on_plain_linears_as_in_bridge(bridge):
    ours, theirs = _adapted(bridge.LoRA), _adapted(R.import_bridge().LoRA)
    for name in ("linear_qkv", "linear_proj"):
        assert type(getattr(ours, name)) is type(getattr(theirs, name))
    ours_params, theirs_params = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert ours_params.keys() == theirs_params.keys()
    for n, p in theirs_params.items():
        assert torch.equal(ours_params[n], p), n
        assert ours_params[n].requires_grad == p.requires_grad, n
    x = torch.randn(3, 16)
    assert torch.equal(ours(x), theirs(x))


def test_uniform_lora_a_init_refused_on_megatron_linears_before_any_change(bridge, single_rank_group):
    """A megatron parallel linear selected under ``lora_A_init_method="uniform"``: no parallel-linear
    adapter has that initialiser (Bridge's raises ``NotImplementedError`` mid-walk); regather's config
    names the modules and the value, and leaves the model as it was."""
    from regather.tools.cpu.models import TinyGPT, build_gpt

    model = build_gpt(TinyGPT(num_layers=1), tp=1, sequence_parallel=False)
    before = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    modules = [type(m).__name__ for m in model.modules()]
    peft = bridge.LoRA(target_modules=["linear_qkv", "linear_fc1"], lora_A_init_method="uniform")
    with pytest.raises(ValueError, match=r"lora_A_init_method='uniform'.*decoder\.layers\.0\.self_attention\.linear_qkv"):
        R.apply_peft(peft, model)
    assert [type(m).__name__ for m in model.modules()] == modules
    after = model.state_dict()
    assert before.keys() <= after.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert all(p.requires_grad for p in model.parameters())  # nothing frozen either
