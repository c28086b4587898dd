"""regather's torchtitan LoRAConverter config, in process, against the real torchtitan 0.3.0: its
fields are torchtitan's plus regather's, and bad values fail before anything changes (the
two-rank llama3 runs are in test_titan_llama3.py)."""

import pytest

from regather.tools.cpu import torchtitan_models

if torchtitan_models.missing():
    pytest.skip(torchtitan_models.missing(), allow_module_level=True)

import torch


def test_fields_are_torchtitans_plus_regathers_and_bad_values_fail_before_any_change():
    from regather.tools.cpu.torchtitan_cpu import enable_torchtitan_cpu

    enable_torchtitan_cpu()
    from torchtitan.components.lora import LoRAConverter as TitanConverter
    from torchtitan.models.utils import validate_converter_order

    from regather.torchtitan import LoRAConverter, apply_lora

    ours = LoRAConverter.Config()
    assert isinstance(ours, TitanConverter.Config) and issubclass(LoRAConverter, TitanConverter)
    assert (ours.rank, ours.alpha, ours.target_modules) == (8, 16.0, None)  # torchtitan's defaults
    assert (ours.sequence_parallel_input_regather, ours.sequence_parallel_input_strategy,
            ours.early_regather, ours.recompute_adapter_inputs) == (False, None, True, False)
    validate_converter_order([ours])
    bad = {
        "sequence_parallel_input_strategy": ("foo", "sequence_parallel_input_strategy='foo'"),
        "rank": (0, "rank=0"),
        "early_regather": ("yes", "early_regather='yes'"),
        "recompute_adapter_inputs": (1, "recompute_adapter_inputs=1"),
        "target_modules": ("wqkv", "target_modules='wqkv'"),
        "alpha": ("16", "alpha='16'"),
    }
    for field, (value, named) in bad.items():
        with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
            LoRAConverter.Config(**{field: value})
    with pytest.raises(ValueError, match="disagree"):
        LoRAConverter.Config(sequence_parallel_input_regather=True, sequence_parallel_input_strategy="lowrank")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    before = [p.requires_grad for p in model.parameters()]
    for kw in (dict(sequence_parallel_input_strategy="foo"), dict(rank=-1), dict(target_modules=["nope"])):
        with pytest.raises(ValueError, match="apply_lora"):
            apply_lora(model, **kw)
        assert type(model[0]) is torch.nn.Linear and [p.requires_grad for p in model.parameters()] == before


