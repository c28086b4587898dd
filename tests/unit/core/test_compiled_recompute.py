"""regather's joint-graph pass (regather.core.recompute.compiled) on real Inductor compiles, one
process: an adapter input one pointwise step from what the backward reads anyway is rebuilt by the
partitioner instead of saved; one behind a GEMM is kept, with the reason; a read without a ticket
is left alone. Bytes: the tensors the compiled graph saves for backward (saved-tensor hooks see
what AOT autograd's runtime saves), and the caches off so that every compile runs the pass."""

import pytest
import torch
import torch.nn.functional as F
from tests.harness.numerics import check_rounding

from regather.core.recompute import compiled
from regather.core.strategies.traced import traced_linear_a

N, H, R = 64, 32, 4


@pytest.fixture(autouse=True)
def fresh_compiles():
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False, joint_custom_post_pass=None), \
            functorch_config.patch(enable_autograd_cache=False):
        compiled.install()
        yield
    torch._dynamo.reset()


def _norm_then_lora(ticket: int):
    def f(h, w, a):
        y = F.rms_norm(h, (H,), w, 1e-6)  # the norm's input and rsqrt: read by its backward anyway
        return traced_linear_a(y, a, ticket).sum() + y.sum()

    return torch.compile(f, backend="inductor", fullgraph=True)


def _gemm_then_lora(ticket: int):
    def f(h, w, a):
        y = h @ w  # a GEMM, w frozen: nothing of it is read by the backward but h
        return traced_linear_a(y, a, ticket).sum()

    return torch.compile(f, backend="inductor", fullgraph=True)


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g, dtype=dtype).requires_grad_(True)
    w = torch.randn(H, generator=g, dtype=dtype) if dtype else None
    a = (torch.randn(R, H, generator=g, dtype=dtype) * 0.1).requires_grad_(True)
    return h, w, a


def _saved_bytes(fn, *args) -> tuple[int, torch.Tensor]:
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn(*args)
    distinct = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(distinct.values()), out


def test_a_norm_output_is_rebuilt_from_what_the_norm_backward_reads():
    kept_ticket, rebuilt_ticket = compiled.NO_TICKET, compiled.ticket("test.norm.lora")
    compiled.OUTCOMES.pop(rebuilt_ticket, None)
    h, w, a = _inputs()
    kept, _ = _saved_bytes(_norm_then_lora(kept_ticket), h, w, a)
    assert compiled.outcome(rebuilt_ticket) is None  # no ticket: the pass tagged nothing
    torch._dynamo.reset()
    rebuilt, out = _saved_bytes(_norm_then_lora(rebuilt_ticket), h, w, a)
    assert isinstance(compiled.outcome(rebuilt_ticket), int) and compiled.outcome(rebuilt_ticket) >= 1
    assert kept - rebuilt == N * H * 4  # exactly the norm's output [N, H] fp32 is no longer saved

    out.backward()
    # against fp64 eager, bounded by the same compiled graph without the rebuild (its own rounding)
    h64, w64, a64 = (t.detach().double().requires_grad_(t.requires_grad) for t in (h, w, a))
    (F.linear(F.rms_norm(h64, (H,), w64, 1e-6), a64).sum() + F.rms_norm(h64, (H,), w64, 1e-6).sum()).backward()
    ha, aa = h.grad.clone(), a.grad.clone()
    h.grad = a.grad = None
    torch._dynamo.reset()
    _norm_then_lora(kept_ticket)(h, w, a).backward()
    check_rounding(aa.double(), a.grad.double(), a64.grad, "dA")
    check_rounding(ha.double(), h.grad.double(), h64.grad, "dX")


def test_an_input_behind_a_gemm_is_kept_with_the_reason():
    ticket = compiled.ticket("test.gemm.lora")
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(N, H, generator=g), torch.randn(H, H, generator=g)
    a = torch.randn(R, H, generator=g).requires_grad_(True)
    _saved_bytes(_gemm_then_lora(ticket), h, w, a)
    why = compiled.outcome(ticket)
    assert isinstance(why, str) and "neither pointwise nor read by the backward" in why, why


def test_install_keeps_a_pass_already_there_and_adds_itself_once():
    import torch._inductor.config as inductor_config

    def theirs(graph):
        return None

    with inductor_config.patch(joint_custom_post_pass=theirs):
        assert compiled.install() is True
        assert compiled.install() is False
        passes = inductor_config.joint_custom_post_pass
        assert passes[0] is theirs and len(passes) == 2
