"""regather.megatron.dense.te and .te_release: Transformer Engine bases, on the TE model.

CPU part: the routing on :mod:`tests.harness.te_model` (megatron's TE linears over autograd
Functions that follow TE's source), at both TE behaviours (TE <= 2.3, TE >= 2.4 read at v2.18), and
the model itself where LoRA depends on it (what it saves, frees and returns). GPU part
(``TestRealTE``): a real ``TELayerNormColumnParallelLinear``; skips unless transformer_engine
imports and CUDA is available. Transformer Engine is never installed on CPU machines (it breaks
``import megatron.core`` there, docs/design.md §6), so on CPU those tests always skip with that
reason. Two ranks (the gathered output, every strategy against fp64):
``tests/distributed/megatron/test_te_routing.py``.
"""

from __future__ import annotations

import logging
import sys
import types
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from tests.harness.te_model import (
    BEHAVIOURS,
    TE_2_3,
    TE_2_4,
    TE_2_8,
    DistributedWeight,
    Holder,
    TEColumnParallelLinear,
    TELayerNormColumnParallelLinear,
    clear_tensor_data,
    te_behaviour,
    te_config,
    te_linear,
)
from torch import nn

from regather.core.allocated import AllocatedBytes
from regather.megatron.dense import te, te_release, te_rule

TE_SKIP = ("transformer_engine is not installed: it is never installed on CPU machines "
           "(docs/design.md §6); run on a CUDA machine with Transformer Engine")
BEHAVIOUR_NAMES = sorted(BEHAVIOURS)


def _column(h=16, o=24, group=None):
    return TEColumnParallelLinear(h, o, config=te_config(h, 1, False), init_method=nn.init.zeros_,
                                  gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
                                  tp_group=group)



def _frozen(base):
    for p in base.parameters():
        p.requires_grad_(False)
    return base


# ---------------------------------------------------------------- recognition and sizes


def test_recognition_by_class_name():
    ln, col = te_linear(16, 24, tp_group=None, sequence_parallel=False), _column()
    assert te.is_te_linear(ln) and te.is_te_linear(col)
    assert te.fuses_layernorm(ln) and not te.fuses_layernorm(col)
    assert not te.is_te_linear(nn.Linear(2, 3)) and not te.fuses_layernorm(nn.Linear(2, 3))

    class Sub(TELayerNormColumnParallelLinear):  # subclasses are recognised through the MRO
        pass

    assert te.fuses_layernorm(Sub(16, 24, config=te_config(16, 1, False), init_method=nn.init.zeros_,
                                  gather_output=False, bias=False, skip_bias_add=False, is_expert=False))


def test_column_parallel_from_parallel_mode():
    from regather.megatron.dense.linears import is_column_parallel

    col = _column()
    assert is_column_parallel(col)
    col.parallel_mode = "row"  # TE's own record wins over the class name
    assert not is_column_parallel(col)


@pytest.mark.parametrize("mode,t,expect", [("column", 4, (16, 24 * 4)), ("row", 4, (16 * 4, 24)), (None, 4, (16, 24))])
def test_linear_sizes_from_te_weight(mode, t, expect):
    base = SimpleNamespace(weight=torch.empty(24, 16), parallel_mode=mode)  # TE: per-rank weight
    assert te.linear_sizes(base, column_parallel=True, tp_size=t) == expect


def test_linear_sizes_prefers_megatron_attributes():
    base = SimpleNamespace(input_size=64, output_size=96, weight=torch.empty(48, 64))
    assert te.linear_sizes(base, column_parallel=True, tp_size=2) == (64, 96)
    with pytest.raises(TypeError, match="cannot read its sizes"):
        te.linear_sizes(SimpleNamespace(weight=None), column_parallel=True, tp_size=1)


# ---------------------------------------------------------------- return forms and flags


def test_split_output_forms():
    out, bias, ln = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    assert te.split_output(((out, ln), None)) == (out, None, ln)
    assert te.split_output((out, bias, ln)) == (out, bias, ln)
    for bad in ((out, None), out, (out,)):
        with pytest.raises(TypeError, match="did not return its LayerNorm output"):
            te.split_output(bad)


@pytest.mark.parametrize("bias,skip", [(False, False), (True, True), (True, False)])
def test_call_with_layernorm_output_sets_flags_for_one_call(bias, skip):
    base = te_linear(16, 24, tp_group=None, sequence_parallel=False, bias=bias, skip_bias_add=skip)
    base.return_layernorm_output_gathered = True  # set by someone else: asked off for the call, restored
    x = torch.randn(4, 2, 16)
    out, b, ln = te.call_with_layernorm_output(base, x)
    assert (base.return_layernorm_output, base.return_layernorm_output_gathered) == (False, True)
    torch.testing.assert_close(ln, te.layernorm_output(base, x), rtol=0, atol=0)
    base.return_layernorm_output_gathered = False
    plain_out, plain_bias = base(x)  # flags restored: megatron's usual (out, bias)
    torch.testing.assert_close(out, plain_out, rtol=0, atol=0)
    assert (b is None) == (not (bias and skip)) and (plain_bias is None) == (b is None)


def test_flags_restored_when_base_raises():
    class Boom(TELayerNormColumnParallelLinear):
        def forward(self, x):
            assert self.return_layernorm_output and not self.return_layernorm_output_gathered
            raise RuntimeError("boom")

    base = Boom(16, 24, config=te_config(16, 1, False), init_method=nn.init.zeros_, gather_output=False,
                bias=False, skip_bias_add=False, is_expert=False)
    base.return_layernorm_output_gathered = True
    with pytest.raises(RuntimeError, match="boom"):
        te.call_with_layernorm_output(base, torch.randn(4, 2, 16))
    assert (base.return_layernorm_output, base.return_layernorm_output_gathered) == (False, True)


def test_a_layernorm_output_not_shaped_as_the_input_is_an_error():
    class Gathers(TELayerNormColumnParallelLinear):  # a base that hands back another shape
        def forward(self, x):
            out, bias = super().forward(x)
            return (out[0], torch.cat([out[1], out[1]])), bias

    base = Gathers(16, 24, config=te_config(16, 1, False), init_method=nn.init.zeros_, gather_output=False,
                   bias=False, skip_bias_add=False, is_expert=False)
    with pytest.raises(RuntimeError, match=r"shape \(8, 2, 16\) for an input of shape \(4, 2, 16\)"):
        te.call_with_layernorm_output(base, torch.randn(4, 2, 16))


def test_installed_version_reads_te_without_importing_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", types.SimpleNamespace(__version__="2.18.0+e7c550c5"))
    assert te.installed_version() == "2.18.0+e7c550c5"
    monkeypatch.delitem(sys.modules, "transformer_engine")
    assert te.installed_version() is None  # not installed here (never on a CPU machine)


# ---------------------------------------------------------------- the TE model, where LoRA depends on it


@pytest.mark.parametrize("behaviour", BEHAVIOUR_NAMES)
def test_model_returns_a_view_of_the_saved_layernorm_output(behaviour):
    """No SP: the returned ln_out is a new view on the storage TE saved (v2.18:593-600, 503-513)."""
    base = _frozen(te_linear(16, 24, tp_group=None, sequence_parallel=False, behaviour=BEHAVIOURS[behaviour]))
    x = torch.randn(4, 2, 16, requires_grad=True)
    _, _, ln = te.call_with_layernorm_output(base, x)
    node, saved = te_release.saved_layernorm_output(ln)
    assert node is ln.grad_fn and saved is not ln and saved is ln._base
    assert saved.shape == (8, 16) and saved.untyped_storage().data_ptr() == ln.untyped_storage().data_ptr()
    inputmat = node.saved_tensors[0]  # TE's inputmat: the input's own storage (v2.18:172-179)
    assert inputmat.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


@pytest.mark.parametrize("behaviour", BEHAVIOUR_NAMES)
def test_model_frees_layernorm_output_when_not_returned(behaviour):
    """Frozen weight, no ln_out returned: the forward leaves the output and TE's inputs/statistics
    (the input is not new: it shares x) — ln_out is gone on both behaviours (v2.8+ clears it, v2.3-v2.7's
    clear on None is a no-op but the last reference dies with the forward)."""
    base = _frozen(te_linear(16, 24, tp_group=None, sequence_parallel=False, behaviour=BEHAVIOURS[behaviour]))
    x = torch.randn(64, 2, 16, requires_grad=True)
    with AllocatedBytes() as plain:
        out, _ = base(x)
    with AllocatedBytes() as asked:
        out2, _, ln = te.call_with_layernorm_output(base, x)
        del ln
    n, e = 64 * 2, 4
    assert plain.alive == n * 24 * e + 2 * n * e  # out, mu, rsigma
    assert asked.alive - plain.alive == n * 16 * e  # ln_out kept because it was returned
    del out, out2


def test_clearing_the_returned_view_frees_nothing_the_saved_one_does():
    """Why regather reaches TE's saved tensor through its node: TE's clear_tensor_data swaps .data
    of the tensor it is given; the returned view is another object (TE's real layout, modelled)."""
    base = _frozen(te_linear(16, 24, tp_group=None, sequence_parallel=False))
    x = torch.randn(64, 2, 16, requires_grad=True)
    with AllocatedBytes() as naive:
        out, _, ln = te.call_with_layernorm_output(base, x)
        clear_tensor_data(ln)  # the adapter side's own object
        del ln
    with AllocatedBytes() as reached:
        out2, _, ln = te.call_with_layernorm_output(base, x)
        assert te_release.release(ln) is None
        del ln
    assert naive.alive - reached.alive == 64 * 2 * 16 * 4
    (out.sum() + out2.sum()).backward()  # TE's backward never reads it (frozen weight)
    assert x.grad is not None


@pytest.mark.parametrize("behaviour", BEHAVIOUR_NAMES)
def test_model_adds_the_local_layernorm_output_gradient(behaviour):
    """Both behaviours add the returned local ln_out's gradient (v2.3:812-813, v2.18:1105-1106)."""
    base = _frozen(te_linear(16, 24, tp_group=None, sequence_parallel=False, behaviour=BEHAVIOURS[behaviour]))
    g = torch.Generator().manual_seed(3)
    x, side = torch.randn(4, 2, 16, generator=g), torch.randn(4, 2, 16, generator=g)
    xt = x.clone().requires_grad_()
    out, _, ln = te.call_with_layernorm_output(base, xt)
    (out.sum() + (ln * side).sum()).backward()
    xr = x.double().requires_grad_()
    w, b = base.layer_norm_weight.double(), base.layer_norm_bias.double()
    lr = F.layer_norm(xr, (16,), w, b, base.eps)
    ((lr @ base.weight.double().t()).sum() + (lr * side.double()).sum()).backward()
    torch.testing.assert_close(xt.grad.double(), xr.grad, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the model: TE's copies and backward frees


@pytest.mark.parametrize("behaviour", BEHAVIOUR_NAMES)
def test_model_backward_empties_what_te_frees(behaviour):
    """What TE's backward empties (``clear_tensor_data``): mu / rsigma after the norm backward
    (2.20.2:1164-1165, v2.3:842-843); with a trainable weight, the ln_out it saved after the weight
    gradient unless it was returned (2.20.2:1093-1102; v2.3-v2.7 clear ``ln_out_total``, the same
    tensor without SP, v2.3:786-789). The saved objects are watched through a hook that hands back
    what it was given."""
    for returned in (False, True):
        base = te_linear(16, 24, tp_group=None, sequence_parallel=False, behaviour=BEHAVIOURS[behaviour])
        base.return_layernorm_output = returned
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            result = base(torch.randn(4, 2, 16, requires_grad=True))[0]
        out = result[0] if returned else result
        node = out.grad_fn
        ln_out, mu, rsigma = (node.saved_tensors[i] for i in (5, 6, 7))  # 2.20.2:526-536's order
        assert ln_out.numel() == mu.numel() * 16 == 8 * 16 and rsigma.numel() == 8
        out.sum().backward()
        assert (mu.numel(), rsigma.numel()) == (0, 0)
        assert ln_out.numel() == (8 * 16 if returned else 0), (behaviour, returned)


def test_model_copies_under_autocast_and_for_a_non_contiguous_input():
    """TE's copies: under autocast ``inputmat`` and the norm weight are cast to the activation dtype
    (2.20.2:188-191: copies, not the input's storage), and ``prepare_forward`` makes a non-contiguous
    input contiguous (base.py 2.20.2:1639-1640); outside autocast a dtype unlike the parameters' is
    TE's TypeError (2.20.2:1493-1499)."""
    base = _frozen(te_linear(16, 24, tp_group=None, sequence_parallel=False))
    x = torch.randn(4, 2, 16, requires_grad=True)
    _, _, ln = te.call_with_layernorm_output(base, x)
    inputmat, ln_weight = ln.grad_fn.saved_tensors[0], ln.grad_fn.saved_tensors[4]
    assert inputmat.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert ln_weight.untyped_storage().data_ptr() == base.layer_norm_weight.untyped_storage().data_ptr()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _, ln = te.call_with_layernorm_output(base, x)
    inputmat, ln_weight = ln.grad_fn.saved_tensors[0], ln.grad_fn.saved_tensors[4]
    assert (out.dtype, ln.dtype, inputmat.dtype, ln_weight.dtype) == (torch.bfloat16,) * 4
    assert inputmat.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    xt = torch.randn(2, 4, 16).transpose(0, 1).requires_grad_()
    _, _, ln = te.call_with_layernorm_output(base, xt)
    assert ln.grad_fn.saved_tensors[0].untyped_storage().data_ptr() != xt.untyped_storage().data_ptr()
    with pytest.raises(TypeError, match="Data types for parameters must match"):
        base(x.double())


# ---------------------------------------------------------------- releasing TE's ln_out: when, and when not


def test_version_range_read():
    for read in ("2.3.0", "2.7.0", "2.9.0.dev0", "2.18.0+e7c550c5", "2.19.0", "2.20.2"):
        assert te_rule.version_reason(read) is None, read
    assert "outside the versions read (2.3 to 2.20)" in te_rule.version_reason("2.21.0")
    assert "outside the versions read" in te_rule.version_reason("2.2.1")
    assert "outside the versions read" in te_rule.version_reason("main")
    assert "cannot be read" in te_rule.version_reason(None)


def _extra_weight(base):
    """A second weight TE names (``weight_names``: TE's ``parameters_split``), trainable."""
    base.extra_weight = nn.Parameter(torch.zeros(2, 16))
    base.weight_names = ["weight", "extra_weight"]


def _distributed_weight(base):
    base.weight = DistributedWeight(base.weight.detach().clone(), requires_grad=False)


@pytest.mark.parametrize("change,expect", [
    (lambda b: b.weight.requires_grad_(True), "weight 'weight' is trainable"),
    (_extra_weight, "weight 'extra_weight' is trainable"),
    (_distributed_weight, "weight 'weight' is a distributed weight (GTP)"),
    (lambda b: setattr(b.config, "fp8", "hybrid"), "fp8 is on: TE saves a quantized copy"),
    (lambda b: setattr(b, "fp8", True), "fp8 is on"),
    (lambda b: setattr(b, "fsdp_group", object()), "TE's own FSDP (fsdp_group): with a frozen weight TE does not "
                                                   "scatter"),
    (lambda b: setattr(b.config, "cpu_offloading", True), "CPU offload (cpu_offloading=True)"),
    (lambda b: (setattr(b.config, "fine_grained_activation_offloading", True),
                setattr(b.config, "offload_modules", ["core_attn", "qkv_linear"])),
     "fine-grained activation offloading covers the TE base (offload_modules ['qkv_linear'])"),
])
def test_release_refused_where_te_reads_or_something_holds_its_layernorm_output(change, expect):
    base = _frozen(te_linear(16, 24, tp_group=None, sequence_parallel=False))
    assert te_rule.unsupported_reason(base, "2.20.2", "linear_qkv") is None
    change(base)
    assert expect in te_rule.unsupported_reason(base, "2.20.2", "linear_qkv")


def test_fine_grained_offloading_refuses_only_the_base_it_covers():
    """megatron wraps ``linear_qkv``'s forward in the ``qkv_linear`` offload context (attention.py);
    nothing wraps a TE ``linear_fc1`` (``mlp_norm`` wraps ``pre_mlp_layernorm``, an IdentityOp on the TE spec)."""
    base = _frozen(te_linear(16, 24, tp_group=None, sequence_parallel=False))
    base.config.fine_grained_activation_offloading, base.config.offload_modules = True, ["qkv_linear"]
    assert "offload_modules ['qkv_linear']" in te_rule.unsupported_reason(base, "2.20.2", "linear_qkv")
    assert te_rule.unsupported_reason(base, "2.20.2", "linear_fc1") is None


def test_userbuffers_refused_only_where_te_copies_the_layernorm_output():
    """TE 2.3's backward copies the saved ln_out into the userbuffers buffer whatever the weight
    (v2.3:578); from 2.4 that copy sits under ``ln_out_needs_gather`` (v2.4:632-643), false when frozen."""
    base = _frozen(te_linear(16, 24, tp_group=None, sequence_parallel=False))
    base.ub_bulk_dgrad = True
    assert "userbuffers (ub_bulk_dgrad) on Transformer Engine 2.3.0" in te_rule.unsupported_reason(base, "2.3.0")
    for version in ("2.4.0", "2.7.0", "2.18.0", "2.20.2"):
        assert te_rule.unsupported_reason(base, version) is None, version
    base.ub_bulk_dgrad, base.config.tp_comm_overlap = False, True
    assert "userbuffers (tp_comm_overlap)" in te_rule.unsupported_reason(base, "2.3.0")
    assert te_rule.unsupported_reason(base, "2.20.2") is None


def test_release_refused_under_backward_override(monkeypatch):
    base = _frozen(te_linear(16, 24, tp_group=None, sequence_parallel=False))
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "dequantized")
    assert "NVTE_BACKWARD_OVERRIDE='dequantized'" in te_rule.unsupported_reason(base, "2.20.2")


#: TE's module-level state as TE would answer it (read from sys.modules: TE is never imported here)
TE_STATE = {
    "debug": ("transformer_engine.debug.pytorch.debug_state",
              types.SimpleNamespace(TEDebugState=types.SimpleNamespace(debug_enabled=True)),
              "Transformer Engine's debug mode is on (TEDebugState.debug_enabled)"),
    "offload": ("transformer_engine.pytorch.cpu_offload", types.SimpleNamespace(is_cpu_offload_enabled=lambda: True),
                "Transformer Engine's CPU offload is enabled (is_cpu_offload_enabled())"),
}


@pytest.mark.parametrize("state", sorted(TE_STATE))
def test_te_debug_mode_and_offload_refuse_where_the_adapter_runs(single_rank_group, monkeypatch, state):
    """TE's debug mode and its CPU offload are read from TE's own module state on every forward: the
    adapter keeps its input with the reason, TE's copy stays, the results are those without recompute."""
    from regather import LoRA

    module, value, expect = TE_STATE[state]
    models = {}
    for rc in (False, True):
        models[rc] = Holder(_frozen(te_linear(16, 24, tp_group=single_rank_group, sequence_parallel=False)))
        torch.manual_seed(0)
        LoRA(target_modules=["linear_qkv"], dim=4, lora_B_init_method="normal", recompute_adapter_inputs=rc)(models[rc])
    monkeypatch.setitem(sys.modules, module, value)
    x = torch.randn(8, 2, 16, requires_grad=True)
    got = {}
    for rc, model in models.items():
        x.grad = None
        y, _ = model(x)
        y.square().sum().backward()
        got[rc] = (y.detach(), x.grad.clone(), model.linear_qkv.adapter.linear_in.weight.grad.clone())
    assert expect in str(models[True].linear_qkv.adapter.last_decision)
    assert all(torch.equal(a, b) for a, b in zip(got[True], got[False]))
    _, _, ln = te.call_with_layernorm_output(models[True].linear_qkv.to_wrap, x)
    assert te_release.release(ln) == expect + (": its debug quantizer may save the LayerNorm output inside its own "
                                               "tensor" if state == "debug" else ": it offloads the LayerNorm output "
                                               "it keeps")


def test_a_saved_tensor_hook_refuses_before_anything_is_read(single_rank_group):
    """An offload hook pops what it stored when unpacked (megatron's fine-grained activation offloading,
    ``fine_grained_activation_offload.py`` 0.16.1:356-358): reading TE's node in forward would take the
    tensors from under its backward. Under such a hook the adapter keeps its input with the reason,
    :func:`te_release.release` reads nothing, and backward runs on what the hook kept, exactly as
    without recompute."""
    from regather import LoRA

    store = {}

    def push(t):
        store[len(store)] = t
        return len(store) - 1

    got = {}
    for rc in (False, True):
        model = Holder(_frozen(te_linear(16, 24, tp_group=single_rank_group, sequence_parallel=False)))
        torch.manual_seed(0)
        LoRA(target_modules=["linear_qkv"], dim=4, lora_B_init_method="normal", recompute_adapter_inputs=rc)(model)
        x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
        store.clear()
        with torch.autograd.graph.saved_tensors_hooks(push, store.pop):
            y, _ = model(x)
            _, _, ln = te.call_with_layernorm_output(model.linear_qkv.to_wrap, x)
            kept = len(store)
            why = te_release.release(ln)
            assert len(store) == kept  # nothing unpacked
        y.square().sum().backward()
        got[rc] = (y.detach(), x.grad, model.linear_qkv.adapter.linear_in.weight.grad)
        if rc:
            decision = str(model.linear_qkv.adapter.last_decision)
            assert "a saved-tensor hook is active" in decision and ".push)" in decision
            assert why.startswith("a saved-tensor hook is active")
    assert all(torch.equal(a, b) for a, b in zip(got[True], got[False]))


def test_release_under_regathers_own_byte_count_and_respects_do_not_clear():
    """regather's saved-tensor count hands back what it was given (marked transparent): the release
    runs under it; a tensor TE marked ``_do_not_clear`` is left alone; no node, nothing to release."""
    from regather.core.accounting import SavedBytes

    base = _frozen(te_linear(16, 24, tp_group=None, sequence_parallel=False))
    x = torch.randn(4, 2, 16, requires_grad=True)
    with SavedBytes():
        _, _, ln = te.call_with_layernorm_output(base, x)
        assert te_release.release(ln) is None
    assert te_release.saved_layernorm_output(ln) == (
        "TE's autograd node saved no tensor on the storage of the LayerNorm output it returned (a copy: fp8, or a "
        "saved-tensor hook)")  # released: its saved tensor is empty
    _, _, ln = te.call_with_layernorm_output(base, x)
    te_release.saved_layernorm_output(ln)[1]._do_not_clear = True
    assert "_do_not_clear" in te_release.release(ln)
    with torch.no_grad():
        _, _, ln = te.call_with_layernorm_output(base, x)
    assert "no autograd node" in te_release.release(ln)


# ---------------------------------------------------------------- LoRA on a TE base, one rank


@pytest.mark.parametrize("behaviour", BEHAVIOUR_NAMES)
def test_lora_feeds_layernorm_output_to_adapter(single_rank_group, behaviour):
    """TP=1: the adapter must see LN(x), not the pre-norm x; output = base + scale * B A LN(x)."""
    from regather import LoRA

    with te_behaviour(behaviour):
        base = te_linear(16, 24, tp_group=single_rank_group, sequence_parallel=False, bias=True, skip_bias_add=True)
    model = nn.Module()
    model.linear_qkv = base
    torch.manual_seed(0)
    LoRA(target_modules=["linear_qkv"], dim=4, alpha=8, lora_B_init_method="normal")(model)
    lora = model.linear_qkv
    adapter = lora.adapter
    assert lora.te_layernorm and (adapter.linear_in.weight.shape, adapter.linear_out.weight.shape) == (
        (4, 16), (24, 4))
    x = (torch.randn(6, 2, 16) * 3 + 1).requires_grad_()
    out, bias = lora(x)
    a, b = adapter.linear_in.weight, adapter.linear_out.weight
    with torch.no_grad():
        plain_out, plain_bias = base(x)
        expect = plain_out + (te.layernorm_output(base, x) @ a.t() @ b.t()) * 2.0
        wrong = plain_out + (x @ a.t() @ b.t()) * 2.0  # what feeding the pre-norm input would give
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, wrong, atol=1e-3)
    assert torch.equal(bias, plain_bias)
    out.sum().backward()
    assert a.grad is not None and a.grad.abs().sum() > 0 and x.grad is not None
    assert (base.return_layernorm_output, base.return_layernorm_output_gathered) == (False, False)


def test_adapter_rejects_input_gathered_off_the_gather_path(single_rank_group):
    from regather import ParallelLinearAdapter

    adapter = ParallelLinearAdapter(16, 24, 4, column_parallel=True, base_name="linear_qkv",
                                    tp_group=single_rank_group, sequence_parallel=True)
    with pytest.raises(ValueError, match="input_gathered=True needs a column-parallel base with sequence"):
        adapter(torch.randn(4, 2, 16), input_gathered=True)  # t == 1: SP comm is off


def test_te_column_parallel_base_uses_plain_path(single_rank_group):
    from regather import LoRA

    model = nn.Module()
    model.linear_fc1 = _column(group=single_rank_group)
    LoRA(target_modules=["linear_fc1"], dim=4, lora_B_init_method="normal")(model)
    assert not model.linear_fc1.te_layernorm
    x = torch.randn(3, 2, 16)
    out, _ = model.linear_fc1(x)
    assert out.shape == (3, 2, 24)


@pytest.mark.parametrize("behaviour", [TE_2_3, TE_2_4, TE_2_8], ids=str)
def test_recompute_releases_te_copy_and_logs_a_refusal_once(single_rank_group, behaviour, caplog):
    """TP=1, recompute, at every behaviour the model has (TE <= 2.3, 2.4 - 2.7, 2.8 - 2.20): LoRA over
    the frozen base is its rank-r tensor alone (allocator bytes, the second forward: the first
    allocates nothing that stays but it is the first-rebuild check's), and the output and every
    gradient are those without recompute bit for bit; where the version is outside the range read
    (2.21.0) the input is kept, with the reason, logged once."""
    from regather import LoRA, decisions

    s, b, h, o, r = 64, 2, 32, 48, 4
    alive, got = {}, {}
    with te_behaviour(behaviour):
        for variant in ("frozen", "lora", "lora-rc"):
            base = _frozen(te_linear(h, o, tp_group=single_rank_group, sequence_parallel=False))
            model = nn.Module()
            model.linear_qkv = base
            if variant != "frozen":
                torch.manual_seed(0)
                LoRA(target_modules=["linear_qkv"], dim=r, alpha=2 * r, lora_B_init_method="normal",
                     recompute_adapter_inputs=variant == "lora-rc")(model)
            x = torch.randn(s, b, h, generator=torch.Generator().manual_seed(1)).requires_grad_()
            for _ in range(2):
                x.grad = None
                with AllocatedBytes() as a:
                    y, _ = model.linear_qkv(x)
                y.square().sum().backward()
            alive[variant] = a.alive
            if variant != "frozen":
                ad = model.linear_qkv.adapter
                got[variant] = (y.detach(), x.grad, ad.linear_in.weight.grad, ad.linear_out.weight.grad)
        assert str(decisions(model)["linear_qkv"]).endswith("input recomputed from the fused LayerNorm of the TE base")
    e = 4
    assert alive["lora"] - alive["frozen"] == s * b * h * e + s * b * r * e  # TE keeps ln_out; LoRA-B keeps mid
    assert alive["lora-rc"] - alive["frozen"] == s * b * r * e  # ln_out released: mid alone
    for name, rc, plain in zip(("out", "dx", "dA", "dB"), got["lora-rc"], got["lora"]):
        assert torch.equal(rc, plain), name

    with te_behaviour(TE_2_8), caplog.at_level(logging.INFO, logger="regather"):
        te_behaviour_version = te.installed_version
        te.installed_version = lambda: "2.21.0"
        try:
            model = Holder(_frozen(te_linear(h, o, tp_group=single_rank_group, sequence_parallel=False)))
            LoRA(target_modules=["linear_qkv"], dim=r, recompute_adapter_inputs=True)(model)
            x = torch.randn(s, b, h, requires_grad=True)
            for _ in range(2):
                with AllocatedBytes() as a:
                    y, _ = model(x)
                y.sum().backward()
        finally:
            te.installed_version = te_behaviour_version
    assert "Transformer Engine 2.21.0 is outside the versions read" in str(model.linear_qkv.adapter.last_decision)
    assert sum("2.21.0 is outside" in r.getMessage() for r in caplog.records) == 1
    assert a.alive - alive["frozen"] == s * b * h * e + s * b * r * e  # TE's ln_out kept, as without recompute


def test_a_distributed_weight_keeps_the_input_with_the_reason(single_rank_group):
    """A distributed weight (GTP, TE 2.19+): TE swaps it for the gathered copy its
    ``materialize_group_for_forward`` makes and tests ``requires_grad`` there, then saves the original
    (2.20.2:326-330, 523-536). regather cannot see the copy: the adapter keeps its input with the
    reason, TE's ln_out stays, and the results are those without recompute."""
    from regather import LoRA

    got = {}
    for rc in (False, True):
        base = _frozen(te_linear(16, 24, tp_group=single_rank_group, sequence_parallel=False))
        base.weight = DistributedWeight(base.weight.detach().clone(), requires_grad=False)
        model = Holder(base)
        torch.manual_seed(0)
        LoRA(target_modules=["linear_qkv"], dim=4, lora_B_init_method="normal", recompute_adapter_inputs=rc)(model)
        x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
        y, _ = model(x)
        y.square().sum().backward()
        got[rc] = (y.detach(), x.grad, model.linear_qkv.adapter.linear_in.weight.grad)
    assert "weight 'weight' is a distributed weight (GTP)" in str(model.linear_qkv.adapter.last_decision)
    _, _, ln = te.call_with_layernorm_output(base, x)
    saved = ln.grad_fn.saved_tensors
    assert saved[1] is None and saved[2] is base.weight  # no GEMM weight saved, the original is
    assert all(torch.equal(a, b) for a, b in zip(got[True], got[False]))


@pytest.mark.parametrize("behaviour", BEHAVIOUR_NAMES)
def test_canonical_lora_releases_te_copy_after_its_last_member(single_rank_group, behaviour):
    """CanonicalLoRA's q / k / v adapters read one LayerNorm output of one TE base: with recompute
    each rebuilds it, TE's copy goes after the last of them; the results are those without recompute
    bit for bit, and LoRA over the frozen base is the three rank-r tensors."""
    from regather import CanonicalLoRA

    s, b, h, r, e = 64, 2, 32, 4, 4
    got = {}
    with te_behaviour(behaviour):
        for variant in ("frozen", "plain", "rc"):
            model = Holder(_frozen(te_linear(h, 3 * h, tp_group=single_rank_group, sequence_parallel=False)))
            if variant != "frozen":
                torch.manual_seed(3)
                CanonicalLoRA(target_modules=["linear_q", "linear_k", "linear_v"], dim=r, lora_B_init_method="normal",
                              recompute_adapter_inputs=variant == "rc")(model)
            x = torch.randn(s, b, h, generator=torch.Generator().manual_seed(4)).requires_grad_()
            for _ in range(2):
                x.grad = None
                with AllocatedBytes() as a:
                    y, _ = model(x)
                y.square().sum().backward()
            adapters = getattr(model.linear_qkv, "adapter", {})
            got[variant] = {"alive": a.alive, "y": y.detach(), "dx": x.grad,
                            "decisions": {k: str(ad.last_decision) for k, ad in dict(adapters).items()}}
    assert all(d.endswith("input recomputed from the fused LayerNorm of the TE base")
               for d in got["rc"]["decisions"].values()) and len(got["rc"]["decisions"]) == 3
    assert torch.equal(got["rc"]["y"], got["plain"]["y"]) and torch.equal(got["rc"]["dx"], got["plain"]["dx"])
    assert got["plain"]["alive"] - got["frozen"]["alive"] == s * b * h * e + 3 * s * b * r * e
    assert got["rc"]["alive"] - got["frozen"]["alive"] == 3 * s * b * r * e


# ---------------------------------------------------------------- real Transformer Engine (GPU)


@pytest.fixture
def real_te(tmp_path):
    """megatron + TE on one CUDA device, TP=1 (NCCL cannot run two ranks on one GPU)."""
    pytest.importorskip("transformer_engine", reason=TE_SKIP)
    if not torch.cuda.is_available():
        pytest.skip("Transformer Engine tests need a CUDA device")
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1)
    model_parallel_cuda_manual_seed(123)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _te_base(bias: bool, skip_bias_add: bool, h=64, o=96):
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear as Real
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=4, bf16=True,
                               params_dtype=torch.bfloat16, sequence_parallel=False)
    init = lambda w: torch.nn.init.normal_(w, std=0.02)
    return Real(h, o, config=config, init_method=init, gather_output=False, bias=bias,
                skip_bias_add=skip_bias_add, is_expert=False, tp_comm_buffer_name="qkv")


class TestRealTE:
    @pytest.mark.parametrize("bias,skip", [(False, False), (True, True)])
    def test_return_forms(self, real_te, bias, skip):
        base = _te_base(bias, skip)
        x = torch.randn(8, 2, 64, device="cuda", dtype=torch.bfloat16)
        out, b, ln = te.call_with_layernorm_output(base, x)
        assert ln.shape == x.shape and out.shape == (8, 2, 96)
        assert (b is not None) == (bias and skip)
        ref = torch.nn.functional.layer_norm(x.float(), (64,), base.layer_norm_weight.float(),
                                             base.layer_norm_bias.float(), base.eps)
        torch.testing.assert_close(ln.float(), ref, rtol=2e-2, atol=2e-2)
        assert (base.return_layernorm_output, base.return_layernorm_output_gathered) == (False, False)

    def test_lora_on_real_te_layernorm_linear(self, real_te):
        from regather import LoRA

        base = _te_base(True, False)
        model = nn.Module()
        model.linear_qkv = base
        LoRA(target_modules=["linear_qkv"], dim=8, alpha=16, lora_B_init_method="normal")(model)
        lora = model.linear_qkv
        assert lora.te_layernorm
        x = torch.randn(8, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out, _ = lora(x)
        a, b = lora.adapter.linear_in.weight, lora.adapter.linear_out.weight
        with torch.no_grad():
            plain, _ = base(x)
            ln = torch.nn.functional.layer_norm(x.float(), (64,), base.layer_norm_weight.float(),
                                                base.layer_norm_bias.float(), base.eps)
            expect = plain.float() + (ln @ a.float().t() @ b.float().t()) * 2.0
        torch.testing.assert_close(out.float(), expect, rtol=3e-2, atol=3e-2)
        out.float().square().mean().backward()
        assert a.grad is not None and torch.isfinite(a.grad).all() and a.grad.abs().sum() > 0
        assert torch.isfinite(x.grad).all()
