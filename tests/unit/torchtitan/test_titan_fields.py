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




def test_drop_in_validation_as_torchtitans_own():
    """torchtitan's converter-order check accepts regather's converter where it accepts its own, and
    refuses it with the same words; a non-positive rank fails with torchtitan's type and sentence."""
    from regather.tools.cpu.torchtitan_cpu import enable_torchtitan_cpu

    enable_torchtitan_cpu()
    from torchtitan.components.lora import LoRAConverter as TitanConverter
    from torchtitan.components.quantization.float8 import Float8LinearConverter
    from torchtitan.models.utils import validate_converter_order

    from regather.torchtitan import LoRAConverter

    fp8 = Float8LinearConverter.Config(emulate=True, model_compile_enabled=False)
    messages = []
    for lora in (TitanConverter.Config(rank=8), LoRAConverter.Config(rank=8, sequence_parallel_input_regather=True)):
        validate_converter_order([fp8, lora])  # torchtitan's llama3_debugmodel_float8_emulate_lora order
        with pytest.raises(ValueError) as refused:
            validate_converter_order([lora, fp8])
        messages.append(str(refused.value))
    assert messages[0] == messages[1] and "must be applied before LoRAConverter" in messages[0]
    with pytest.raises(ValueError, match="LoRA rank must be positive, got 0") as titan:
        TitanConverter(TitanConverter.Config(rank=0))
    with pytest.raises(type(titan.value), match="LoRA rank must be positive, got 0"):
        LoRAConverter.Config(rank=0)
