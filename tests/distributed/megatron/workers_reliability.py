"""Rank bodies for the hostile-schedule, fault, bad-input and property tests.

Each body runs many cases in one spawn (a spawn costs seconds) and returns
plain tensors / strings; the tests compare every strategy against the gather
path computed in the same rank.
"""

from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist
from workers_adapter import _inputs, fp64_reference, make_adapter

from regather import Strategy
from regather.core.accounting import CollectiveBytes, SavedBytes
from regather.core.buffers import Lease, ScratchPool
from regather.tools.cpu.megatron_cpu import enable_megatron_cpu

SEQUENCE_LOCAL = [s for s in Strategy if s != Strategy.GATHER]


def strategies():
    return list(Strategy)


def _data(rank, t, s, b, h, o, dtype, n, seed):
    return _inputs(rank, t, s, b, h, o, dtype, True, n, seed)


def lora_a_grad(adapter, rank, t):
    """LoRA-A's gradient as this rank's rows (a replicated low-rank A holds all rows)."""
    g = adapter.linear_in.weight.grad
    if g is not None and adapter.column_parallel and g.shape[0] == adapter.dim and t > 1:
        g = g.chunk(t, 0)[rank]
    return g


def _grads(adapter, rank, t):
    return {"dA": lora_a_grad(adapter, rank, t), "dB": adapter.linear_out.weight.grad}


class SharingPool(ScratchPool):
    """A broken pool: every lease of a key gets the SAME storage (what the real pool must never do)."""

    def __init__(self):
        super().__init__()
        self._shared = {}

    def acquire(self, purpose, shape, dtype, device):
        shape = tuple(int(d) for d in shape)
        key = (purpose, dtype, torch.device(device))
        buf = self._shared.get(key)
        if buf is None or buf.numel() < math.prod(shape):
            buf = self._shared[key] = torch.empty(math.prod(shape), dtype=dtype, device=device)
            self.allocations += 1
        with self._lock:
            self._leased[key] += 1
        return Lease(self, key, buf, shape)

    def _give_back(self, key, storage):
        with self._lock:
            self._leased[key] -= 1


# -- 1. hostile schedules ------------------------------------------------------------------


def schedules(rank, t, s=16, b=2, h=32, o=48, r=8):
    enable_megatron_cpu()
    res = {}
    (x1, dy1), (x2, dy2) = _data(rank, t, s, b, h, o, torch.float32, 2, seed=3)

    # interleaved micro-batches: fwd1 fwd2 bwd2 bwd1 / fwd1 fwd2 bwd1 bwd2
    for order in ("21", "12"):
        for st in strategies():
            ad = make_adapter(st, h=h, o=o, r=r, dtype=torch.float32)
            xs = [x1.clone().requires_grad_(), x2.clone().requires_grad_()]
            ys = [ad(xs[0]), ad(xs[1])]
            dys = [dy1, dy2]
            for i in (int(c) - 1 for c in order):
                ys[i].backward(dys[i])
            res[("interleave" + order, st.value)] = {
                "y1": ys[0].detach(), "y2": ys[1].detach(), "dx1": xs[0].grad, "dx2": xs[1].grad,
                **_grads(ad, rank, t), "used": ad.last_decision.used.value,
                "in_flight": (ad.pool or _default_pool()).in_flight()}

    # two adapters sharing one scratch pool in one layer, both backward gathers in flight
    # at once (both planned before either forward: their deferred dA run after both hooks)
    for pool_kind in ("real", "sharing"):
        for st in strategies():
            pool = ScratchPool() if pool_kind == "real" else SharingPool()
            a1 = make_adapter(st, h=h, o=o, r=r, dtype=torch.float32, seed=7, pool=pool, base_name="linear_qkv")
            a2 = make_adapter(st, h=h, o=o, r=r, dtype=torch.float32, seed=8, pool=pool, base_name="linear_fc1")
            xa, xb = x1.clone().requires_grad_(), x2.clone().requires_grad_()
            pa_x, pa = a1.plan(xa)
            pb_x, pb = a2.plan(xb)
            ya, yb = a1(pa_x, plan=pa), a2(pb_x, plan=pb)
            seen = []
            orig_acquire = pool.acquire

            def acquire(*args, _orig=orig_acquire, **kw):
                lease = _orig(*args, **kw)
                seen.append(pool.in_flight())
                return lease

            pool.acquire = acquire
            ((ya * dy1).sum() + (yb * dy2).sum()).backward()
            res[("two_adapters_" + pool_kind, st.value)] = {
                "ya": ya.detach(), "yb": yb.detach(), "dxa": xa.grad, "dxb": xb.grad,
                "dA1": lora_a_grad(a1, rank, t), "dA2": lora_a_grad(a2, rank, t),
                "dB1": a1.linear_out.weight.grad, "dB2": a2.linear_out.weight.grad,
                "max_in_flight": max(seen, default=0), "in_flight_after": pool.in_flight()}

    # eval mode (grad on): falls back, matches gather; torch.no_grad: nothing saved, no graph
    for st in strategies():
        ad = make_adapter(st, h=h, o=o, r=r, dtype=torch.float32)
        ad.eval()
        x = x1.clone().requires_grad_()
        y = ad(x)
        decision = ad.last_decision
        with CollectiveBytes() as bwd:
            y.backward(dy1)
        ad.train()
        with torch.no_grad(), SavedBytes.for_model(ad) as saved, CollectiveBytes() as fwd:
            y_ng = ad(x1.clone().requires_grad_())
        ng_decision = ad.last_decision
        ad.eval()
        with torch.inference_mode(), SavedBytes.for_model(ad) as saved_inf:
            y_inf = ad(x1)
        res[("eval", st.value)] = {
            "y": y.detach(), "dx": x.grad, **_grads(ad, rank, t), "reason": decision.reason,
            "used": decision.used.value, "bwd_comm": bwd.snapshot(),
            "y_nograd": y_ng, "nograd_reason": ng_decision.reason, "nograd_saved": saved.total,
            "nograd_has_graph": y_ng.grad_fn is not None, "nograd_comm": fwd.snapshot(),
            "y_inference": y_inf.clone(), "inference_saved": saved_inf.total}

    # a second backward through the same graph
    for st in strategies():
        ad = make_adapter(st, h=h, o=o, r=r, dtype=torch.float32)
        x = x1.clone().requires_grad_()
        y = ad(x)
        y.backward(dy1, retain_graph=True)
        first = {k: v.clone() for k, v in _grads(ad, rank, t).items()}
        first_dx = x.grad.clone()
        try:
            y.backward(dy1)
            second = {"dx": x.grad, **_grads(ad, rank, t), "error": None}
        except RuntimeError as exc:
            second = {"error": str(exc)}
        res[("retain_graph", st.value)] = {"first": first, "first_dx": first_dx, "second": second}
    return res


def _default_pool():
    from regather.core.buffers import default_pool

    return default_pool()


def recompute(rank, t, configs, only=None):
    """Model level: one forward/backward per (recompute config, strategy); LoRA grads + decisions."""
    from regather import LoRA, adapters
    from regather.tools.cpu.models import TinyGPT, build_gpt, gpt_batch, gpt_loss

    out = {}
    shape = TinyGPT(num_layers=2, seq_length=16)
    batch = gpt_batch(shape, 2, seed=5)
    for name, overrides in configs.items():
        for st in [s for s in strategies() if only is None or s.value in only]:
            model = build_gpt(shape, t, True, torch.float32, seed=1234, **overrides)
            if "mlp" in (overrides.get("recompute_modules") or []):
                # megatron-core's selective MLP checkpoint recurses without end on CPU/gloo
                # (a plain GPT without LoRA hangs too), so the layers run their MLP directly;
                # the config still says recompute_modules=[..., "mlp"], which is what the
                # adapter's eligibility reads.
                for layer in model.decoder.layers:
                    layer.recompute_mlp = False
            torch.manual_seed(99)
            # lean on every strategy, gather too: like for like (the row-parallel targets' lean LoRA-B weight
            # gradient is another summation order than the classic gather path's, docs/design.md §3.7)
            lora = LoRA(dim=8, alpha=16, lora_B_init_method="normal", sequence_parallel_input_strategy=st.value,
                        lean_transients=True)
            model = lora(model, training=True)
            # frozen embeddings: megatron's reentrant checkpoint needs an input that requires grad
            # (HF's enable_input_require_grads; Bridge does the same for PEFT + full recompute)
            model.embedding.register_forward_hook(lambda m, i, o: o.requires_grad_(True))
            seen = {}
            for path, ad in adapters(model).items():  # every forward's decision (recompute re-runs it)
                ad.register_forward_hook(
                    lambda m, i, o, _p=path: seen.setdefault(_p, []).append(str(m.last_decision)))
            loss = gpt_loss(model, batch)
            loss.backward()
            grads = {}
            for path, ad in adapters(model).items():
                grads[path + ".A"] = lora_a_grad(ad, rank, t)
                grads[path + ".B"] = ad.linear_out.weight.grad
            out[(name, st.value)] = {"loss": loss.detach(), "grads": grads, "decisions": seen}
    return out


# -- 2/3. faults and bad input -----------------------------------------------------------------


def raise_or_block(rank, t, delay=1.0):
    """Rank 1 raises mid-step; rank 0 blocks in a collective that rank 1 never joins."""
    enable_megatron_cpu()
    x = torch.ones(4)
    dist.all_reduce(x)  # a first step that both ranks finish
    if rank == 1:
        time.sleep(delay)
        raise RuntimeError(f"rank 1 failed mid-step (injected at t={time.time():.3f})")
    dist.all_reduce(x)  # waits for rank 1 forever (until the pg timeout)
    return "unreachable"


def bad_inputs(rank, t):
    """Every bad-input case; returns {case: error message or result}."""
    from regather import LoRA
    from regather.tools.cpu.models import TinyGPT, batch_from_tokens, build_gpt, gpt_loss

    enable_megatron_cpu()
    out = {}

    def err(fn):
        try:
            fn()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    # sequence length not divisible by TP, at model level (LoRA's pre-hook names the sizes)
    shape = TinyGPT(num_layers=1, seq_length=16)
    model = build_gpt(shape, t, True, torch.float32)
    model = LoRA(dim=8, sequence_parallel_input_regather=True)(model)
    tokens = torch.randint(0, shape.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))  # s=15
    out["seq_not_divisible"] = err(lambda: gpt_loss(model, batch_from_tokens(tokens)))

    # LoRA dim not divisible by TP: raised before the model changes
    fresh = build_gpt(shape, t, True, torch.float32)
    before = (sorted(fresh.state_dict()), [type(m).__name__ for m in fresh.modules()])
    out["dim_not_divisible"] = err(lambda: LoRA(dim=3)(fresh))
    after = (sorted(fresh.state_dict()), [type(m).__name__ for m in fresh.modules()])
    out["dim_not_divisible_unchanged"] = before == after and all(p.requires_grad for p in fresh.parameters())

    s, b, h, o, r = 8, 2, 16, 16, 4
    for st in strategies():
        ad = make_adapter(st, h=h, o=o, r=r, dtype=torch.float32)
        x = torch.randn(s // t, b, h)
        # dtype / device mismatch
        out[("dtype", st.value)] = err(lambda: ad(x.to(torch.bfloat16)))
        out[("device", st.value)] = err(lambda: ad(x.to("meta")))
        # non-contiguous input: works and equals the contiguous result
        xt = torch.randn(b, s // t, h).transpose(0, 1)
        assert not xt.is_contiguous()
        y_nc = ad(xt.requires_grad_())
        y_nc.sum().backward()
        xc = xt.detach().contiguous().requires_grad_()
        y_c = ad(xc)
        y_c.sum().backward()
        out[("noncontiguous", st.value)] = (torch.equal(y_nc, y_c), torch.equal(xt.grad, xc.grad))
        # different local sequence lengths on the ranks, with the opt-in check
        x_bad = torch.randn(s // t + rank, b, h)
        ad.check_shapes = True
        out[("shapes_flag", st.value)] = err(lambda: ad(x_bad))
        ad.check_shapes = False
        os.environ["REGATHER_DEBUG_SHAPES"] = "1"
        try:
            out[("shapes_env", st.value)] = err(lambda: ad(x_bad))
            out[("shapes_ok_env", st.value)] = err(lambda: ad(x))  # equal shapes pass the check
        finally:
            del os.environ["REGATHER_DEBUG_SHAPES"]

    # NaN / Inf in the input propagate exactly as on the gather path (no silent repair)
    x = torch.randn(s // t, b, h)
    x[0, 0, 0] = float("nan")
    x[-1, -1, -1] = float("inf")
    dy = torch.randn(s, b, o // t)
    for st in strategies():
        ad = make_adapter(st, h=h, o=o, r=r, dtype=torch.float32)
        xi = x.clone().requires_grad_()
        y = ad(xi)
        y.backward(dy)
        out[("nan", st.value)] = {"y": y.detach(), "dx": xi.grad, **_grads(ad, rank, t)}
        if st == Strategy.GATHER:  # the same function in fp64 (the same weights in every strategy)
            ref = fp64_reference(ad, [(x, dy)], rank, t)
            out[("nan", "fp64")] = {"y": ref["y"][0], "dx": ref["dx"][0], "dA": ref["dA"], "dB": ref["dB"]}
    return out


# -- property-based parity -------------------------------------------------------------------


def property_cases(rank, t, cases):
    """Each case: gather vs every other strategy on the same adapter; returns the failures."""
    enable_megatron_cpu()
    failures = []
    for i, c in enumerate(cases):
        dtype = getattr(torch, c["dtype"])
        s = c["s_local"] * t
        data = _data(rank, t, s, c["b"], c["h"], c["o"], dtype, c["micro_batches"], seed=c["seed"])
        ref = None
        for st in strategies():
            ad = make_adapter(st, h=c["h"], o=c["o"], r=c["r"], dtype=dtype, seed=c["seed"],
                              dropout=c["dropout"], dropout_position=c["dropout_position"])
            torch.manual_seed(1000 + rank + c["seed"])
            got = []
            for x, dy in data:
                x = x.clone().requires_grad_()
                y = ad(x)
                y.backward(dy)
                got += [y.detach(), x.grad]
            got += [lora_a_grad(ad, rank, t), ad.linear_out.weight.grad]
            if st == Strategy.GATHER:
                ref = got
                continue
            if st != Strategy.GATHER and ad.last_decision.used != st:
                failures.append(f"case {i} {c}: {st.value} fell back: {ad.last_decision}")
                continue
            for name, a, b in zip(["y", "dx"] * c["micro_batches"] + ["dA", "dB"], got, ref):
                if st == Strategy.REGATHER:
                    if not torch.equal(a, b):
                        failures.append(f"case {i} {c}: regather {name} differs, max "
                                        f"{(a.float() - b.float()).abs().max().item():.3g}")
                elif dtype == torch.float32:
                    rel = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
                    if rel > 1e-6:
                        failures.append(f"case {i} {c}: {st.value} {name} rel err {rel:.3g} > 1e-6")
    return failures
