"""LoRA config errors name their values and are raised before the model changes."""

import pytest
import torch

from regather import LoRA, ParallelLinearAdapter


@pytest.mark.parametrize("kwargs,match", [
    (dict(dim=0), r"dim=0"),
    (dict(dim=-4), r"dim=-4"),
    (dict(dim=2.5), r"dim=2.5"),
    (dict(dropout=1.0), r"dropout=1.0.*\[0, 1\)"),
    (dict(dropout=-0.1), r"dropout=-0.1"),
    (dict(dropout_position="middle"), r"dropout_position='middle'"),
    (dict(lora_A_init_method="orthogonal"), r"lora_A_init_method='orthogonal'"),
    (dict(lora_B_init_method="ones"), r"lora_B_init_method='ones'"),
    (dict(activation="tanh"), r"activation='tanh'"),
])
def test_bad_config_fails_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoRA(**kwargs)


def test_string_targets_are_refused():
    with pytest.raises(TypeError, match="lists of names"):
        LoRA(target_modules="linear_qkv")


def _snapshot(model):
    return (sorted(model.state_dict()), [(n, type(m).__name__) for n, m in model.named_modules()],
            [p.requires_grad for p in model.parameters()], model.training,
            {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)})


def _same(a, b):
    return a[:4] == b[:4] and all(torch.equal(a[4][k], b[4][k]) for k in a[4])


@pytest.fixture
def tiny_gpt(single_rank_group):
    from regather.tools.cpu.models import TinyGPT, build_gpt

    return build_gpt(TinyGPT(num_layers=1), tp=1)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(target_modules=["linear_qkv", "q_proj"]), ValueError, r"\['q_proj'\] match no module"),
    (dict(target_modules=["*.layers.7.*"]), ValueError, r"layers.7"),
    (dict(target_modules=["embedding"]), TypeError, r"'embedding' is a"),
])
def test_failed_apply_leaves_the_model_as_it_was(tiny_gpt, kwargs, exc, match):
    tiny_gpt.eval()  # training=True would flip it: a half-applied call would show
    before = _snapshot(tiny_gpt)
    with pytest.raises(exc, match=match):
        LoRA(**kwargs)(tiny_gpt, training=True)
    assert _same(before, _snapshot(tiny_gpt))
    assert not hasattr(tiny_gpt, "_regather_seq_check")


def test_applying_twice_is_refused_and_changes_nothing(tiny_gpt):
    LoRA(dim=4)(tiny_gpt)
    before = _snapshot(tiny_gpt)
    with pytest.raises(ValueError, match="match no module"):
        LoRA(dim=4)(tiny_gpt)
    assert _same(before, _snapshot(tiny_gpt))


def test_tp_group_without_torch_distributed():
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="not initialised"):
        ParallelLinearAdapter(16, 16, 4, column_parallel=True, base_name="linear_qkv", tp_group=object())


def test_megatron_tp_group_missing(single_rank_group):
    """A base layer without a TP group while megatron's parallel state is uninitialised."""
    from megatron.core import parallel_state

    from regather.megatron.dense.linears import tp_group

    parallel_state.destroy_model_parallel()
    with pytest.raises(Exception, match=r"(?i)tensor.*model.*parallel.*group.*not initialized"):
        tp_group(torch.nn.Linear(2, 2))


def test_adapter_names_the_dtype_and_device(single_rank_group):
    ad = ParallelLinearAdapter(16, 16, 4, column_parallel=True, base_name="linear_qkv",
                               tp_group=single_rank_group)
    with pytest.raises(TypeError, match=r"torch.float64 on cpu.*torch.float32 on cpu"):
        ad(torch.randn(4, 1, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\(4, 1, 8\).*16 features"):
        ad(torch.randn(4, 1, 8))
