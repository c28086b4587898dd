"""Every private upstream name regather.torchtitan.compat touches exists, with the meaning it was
read for, in the pinned torchtitan and torch: an upgrade fails here, naming the attribute."""

import importlib.metadata

import pytest

from regather.tools.cpu import torchtitan_models

if torchtitan_models.missing():
    pytest.skip(torchtitan_models.missing(), allow_module_level=True)

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from regather.tools.cpu.torchtitan_cpu import enable_torchtitan_cpu
from regather.torchtitan import compat


def test_pinned_versions_are_the_ones_compat_was_read_from():
    assert importlib.metadata.version("torchtitan") == compat.TORCHTITAN_VERSION
    assert torch.__version__.split("+")[0] in compat.TORCH_VERSIONS


def test_torchtitan_privates_exist_and_mean_what_compat_says():
    enable_torchtitan_cpu()
    from torchtitan.components.lora import LoRAConverter as TitanConverter
    from torchtitan.models.common import Linear
    from torchtitan.protocols.module import Module

    from regather.torchtitan import LoRAConverter

    lora_cls = compat.titan_lora_class(Linear)
    assert issubclass(lora_cls, Linear)
    config = Linear.Config(in_features=4, out_features=6)
    assert compat.config_owner(config) is Linear
    assert callable(getattr(TitanConverter, compat.MAKE_LORA_CONFIG))
    assert getattr(LoRAConverter, compat.MAKE_LORA_CONFIG) is LoRAConverter.lora_config
    with torch.device("meta"):
        lora = lora_cls.Config(in_features=4, out_features=6, rank=2, alpha=3.0).build()
    assert compat.lora_scaling(lora) == 1.5
    assert callable(getattr(Module, compat.REDISTRIBUTE_INPUTS))
    assert compat.sharding_config(lora) is None  # set by set_*_sharding_config, not here


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_selective_checkpointing_policy_does_not_see_the_unseen_body_in_either_pass():
    seen = {"forward": [], "recompute": []}

    def policy(ctx, func, *args, **kwargs):
        seen["recompute" if ctx.is_recompute else "forward"].append(func)
        return CheckpointPolicy.MUST_SAVE if func == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    calls = []

    def block(x, w, a):
        calls.append(1)
        y = x @ w
        with compat.unseen_by_selective_checkpoint():
            z = (x @ a) * 2.0
        return (y + z.sum(-1, keepdim=True)).sum()

    g = torch.Generator().manual_seed(0)
    x, w, a = (torch.randn(8, 8, generator=g, requires_grad=True) for _ in range(3))
    out = checkpoint(block, x, w, a, use_reentrant=False,
                     context_fn=lambda: create_selective_checkpoint_contexts(policy))
    out.backward()
    grads = [t.grad.clone() for t in (x, w, a)]
    assert seen["forward"].count(torch.ops.aten.mm.default) == 1  # the body's matmul is not counted
    assert calls == [1, 1]  # the block ran again in backward: the recompute popped its mode alike
    for t in (x, w, a):
        t.grad = None
    calls.clear()
    block(x, w, a).backward()
    for t, want in zip((x, w, a), grads):
        assert torch.equal(t.grad, want)  # rtol=0: the same ops, recomputed
    outside, xd, wd = _Ops(), x.detach(), w.detach()
    with outside:  # another innermost mode is left alone: the body is seen
        with compat.unseen_by_selective_checkpoint():
            torch.mm(xd, wd)
    assert outside.seen == [torch.ops.aten.mm.default]
