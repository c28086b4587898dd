"""Rank bodies for ``LoRA(recompute_adapter_inputs=True)`` (issue 9): a real megatron-core GPT
(local spec) on gloo ranks, every variant against the gather path in the same process.

A :class:`Setup` is one model configuration and schedule; :func:`run_setup` trains one fresh
model per *variant* (strategy x recompute, :data:`VARIANTS`) from the same weights and batches
and returns, per variant, what the tests compare (:func:`run_variant`). :func:`run_many` runs a
list of setups in one spawn; the parallel state is initialised once per TP size (megatron's
groups are not re-created per model).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from regather.tools.cpu.models import TinyGPT

RC = {"recompute_adapter_inputs": True}
# name -> (strategy, LoRA field overrides)
VARIANTS = {
    "gather": ("gather", {}),
    "gather-rc": ("gather", RC),
    "regather": ("regather", {}),
    "regather-rc": ("regather", RC),
    "regather-plain": ("regather", {"early_regather": False}),
    "regather-plain-rc": ("regather", {"early_regather": False, **RC}),
    "lowrank": ("lowrank", {}),
    "lowrank-rc": ("lowrank", RC),
    "gather-shared": ("gather", {"share_sequence_gather": True}),
    "gather-shared-rc": ("gather", {"share_sequence_gather": True, **RC}),
    "regather-shared": ("regather", {"share_sequence_gather": True}),
    "regather-shared-rc": ("regather", {"share_sequence_gather": True, **RC}),
}
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


# the recompute matrix's GPT: the harness's TinyGPT, smaller
Shape = functools.partial(TinyGPT, hidden=32, ffn=64, vocab=128, seq=16)


@dataclass
class Setup:
    """One model configuration and schedule, run for every variant in ``variants``."""

    variants: tuple
    tp: int = 2
    sp: bool = True
    dtype: str = "float32"
    fusion: bool = False  # gradient_accumulation_fusion, main_grad + grad_added_to_main_grad as DDP sets them
    model: dict = field(default_factory=dict)  # TransformerConfig overrides
    lora: dict = field(default_factory=dict)  # LoRA overrides for every variant (dropout, ...)
    input_grad: bool = False  # the decoder input requires grad (Bridge's maybe_enable_recompute_inputs_grad)
    schedule: str = "plain"  # plain | interleaved | retain | eval | no_grad | steps
    shape: TinyGPT = field(default_factory=Shape)
    micro_batch: int = 2
    prepare: str | None = None  # name in PREPARE: changes the model after LoRA (hooks, patches)
    spec: str | None = None  # name in SPECS: a custom layer spec
    # also run the frozen model without LoRA (results key "frozen"): what LoRA adds over it
    frozen_baseline: bool = False
    # LoRA(lean_transients=...) of every variant, the gather path included, so that variants are
    # compared like for like (a lean row-parallel adapter sums LoRA-B's weight gradient per sequence
    # shard, another order than the classic gather path's: docs/design.md §3.7); None: each
    # strategy's default (lean but for the classic gather path)
    lean: bool | None = True

    @property
    def torch_dtype(self):
        return getattr(torch, self.dtype)


# -- custom specs and model changes ------------------------------------------------------------


def _layer_forward_override(spec):
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class CustomLayer(TransformerLayer):
        def forward(self, *args, **kwargs):  # a custom spec's layer: same maths, own forward
            return super().forward(*args, **kwargs)

    spec.module = CustomLayer
    return spec


def _mlp_forward_override(spec):
    from megatron.core.transformer.mlp import MLP

    class CustomMLP(MLP):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    mlp = spec.submodules.mlp
    if isinstance(mlp, functools.partial):  # megatron-core 0.19: partial(MLP.as_mlp_submodule, submodules=...)
        spec.submodules.mlp = functools.partial(CustomMLP.as_mlp_submodule, *mlp.args, **mlp.keywords)
    else:  # 0.16: a ModuleSpec
        mlp.module = CustomMLP
    return spec


def _attention_path_override(spec):
    """``forward`` is megatron's, ``_forward_attention`` feeds attention ``norm(x) * 1.5``
    (computed out of place): structurally a megatron layer, but the qkv input is not the norm's
    output. The per-forward identity check must see it."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class ScaledNormLayer(TransformerLayer):
        def _forward_attention(self, hidden_states, *args, **kwargs):
            norm = self.input_layernorm

            class Scaled(torch.nn.Module):
                def forward(self_, x):
                    return norm(x) * 1.5

            self.input_layernorm = Scaled()
            try:
                return super()._forward_attention(hidden_states, *args, **kwargs)
            finally:
                self.input_layernorm = norm

    spec.module = ScaledNormLayer
    return spec


SPECS = {"layer_forward": _layer_forward_override, "mlp_forward": _mlp_forward_override,
         "attention_path": _attention_path_override}


def _norms(model, attr):
    return [getattr(layer, attr) for layer in model.decoder.layers]


def _scale_in_place(module, args, out):
    out.mul_(1.5)  # returns None: the module's output stays the (modified) tensor


def _inplace_after_norm(model):
    """A forward hook registered after LoRA (runs after the producer's): scales qkv's input in place."""
    for norm in _norms(model, "input_layernorm"):
        norm.register_forward_hook(_scale_in_place)


def _unfaithful(model, attr: str, eps: float = 1e-3):
    """Every producer's rerun is off by ``eps``: first-forward verification must switch it off."""
    from regather.megatron.dense.model import adapters

    for path, ad in adapters(model).items():
        if path.endswith(attr) and ad.producer is not None:
            orig = ad.producer.recompute
            ad.producer.recompute = lambda *t, _f=orig: _f(*t) + eps


class Switch:
    """A hook that does nothing until switched on (after the first, verified forward)."""

    def __init__(self, fn):
        self.on, self.fn = False, fn

    def __call__(self, *args):
        return self.fn(*args) if self.on else None


def _switched(model, hooks):
    model._regather_test_switches = hooks
    return hooks


def _late_fc2_prehook(model):
    """From the second forward on, linear_fc2's input is scaled (out of place) by a forward pre-hook."""
    hooks = []
    for layer in model.decoder.layers:
        h = Switch(lambda m, args: (args[0] * 1.5,) + tuple(args[1:]))
        layer.mlp.linear_fc2.register_forward_pre_hook(h)
        hooks.append(h)
    return _switched(model, hooks)


def _late_inplace_before_lora(model):
    """From the second forward on, a norm forward hook registered before LoRA scales the output in place."""
    hooks = []
    for norm in _norms(model, "input_layernorm"):
        h = Switch(_scale_in_place)
        norm.register_forward_hook(h)
        hooks.append(h)
    return _switched(model, hooks)


def _no_layernorm_checkpoint(model):
    """The config asks for selective recompute of 'layernorm'; megatron's CheckpointWithoutOutput
    needs Transformer Engine (NameError: FP8GlobalStateManager without it, 0.16.1 and 0.19.2), so
    the layers run their norms directly. What the producer reads is the config."""
    for layer in model.decoder.layers:
        layer.recompute_input_layernorm = layer.recompute_pre_mlp_layernorm = False


PREPARE: dict[str, Callable] = {
    "late_fc2_prehook": _late_fc2_prehook,
    "no_layernorm_checkpoint": _no_layernorm_checkpoint,
    "inplace_after_norm": _inplace_after_norm,
    "unfaithful_norm": lambda m: _unfaithful(m, "linear_qkv"),
    "unfaithful_act": lambda m: _unfaithful(m, "linear_fc2"),
}
# applied before LoRA (so before the producers' hooks)
PREPARE_BEFORE: dict[str, Callable] = {
    "inplace_before_lora": lambda m: [n.register_forward_hook(_scale_in_place)
                                      for n in _norms(m, "input_layernorm")],
    "late_inplace_before_lora": _late_inplace_before_lora,
}


# -- one model -----------------------------------------------------------------------------------


_TP_INIT = {"tp": None}
# TransformerConfig fields regather.tools.cpu.models.build_gpt sets itself (CPU-friendly defaults)
FIXED_BY_BUILD_GPT = ("bias_activation_fusion", "masked_softmax_fusion", "bias_dropout_fusion",
                      "apply_rope_fusion", "persist_layer_norm")


def ensure_parallel(tp: int) -> None:
    from tests.harness.megatron_train import enable_megatron_training_cpu

    from regather.tools.cpu.models import init_model_parallel

    enable_megatron_training_cpu()  # the fused wgrad stand-in (gradient_accumulation_fusion)
    if _TP_INIT["tp"] != tp:
        init_model_parallel(tp)
        _TP_INIT["tp"] = tp


def build_base(setup: Setup):
    """The setup's megatron GPT (its spec, config overrides and pre-LoRA changes), before LoRA."""
    from megatron.core.models.gpt import gpt_layer_specs

    from regather.tools.cpu.models import build_gpt

    ensure_parallel(setup.tp)
    shape = setup.shape
    orig_spec = gpt_layer_specs.get_gpt_layer_local_spec
    if setup.spec is not None:
        gpt_layer_specs.get_gpt_layer_local_spec = lambda *a, **k: SPECS[setup.spec](orig_spec(*a, **k))
    fixed = {k: v for k, v in setup.model.items() if k in FIXED_BY_BUILD_GPT}
    try:
        model = build_gpt(shape, setup.tp, setup.sp, setup.torch_dtype, seed=1234,
                          gradient_accumulation_fusion=setup.fusion, init_parallel=False,
                          **{k: v for k, v in setup.model.items() if k not in fixed})
    finally:
        gpt_layer_specs.get_gpt_layer_local_spec = orig_spec
    if fixed:  # megatron reads them in forward from the one config object every module holds
        dataclasses.replace(model.config, **fixed)  # megatron's own validation of the combination
        for k, v in fixed.items():
            setattr(model.config, k, v)
    if setup.prepare in PREPARE_BEFORE:
        PREPARE_BEFORE[setup.prepare](model)
    return model


def build(setup: Setup, variant: str):
    from regather import LoRA

    model = build_base(setup)
    strategy, overrides = VARIANTS[variant]
    torch.manual_seed(99)  # adapter init: the same for every variant
    lora = LoRA(dim=8, alpha=16, lora_B_init_method="normal", sequence_parallel_input_strategy=strategy,
                lean_transients=setup.lean, **overrides, **setup.lora)
    model = lora(model, training=True)
    if setup.prepare in PREPARE:
        PREPARE[setup.prepare](model)
    if setup.fusion:  # what megatron DDP gives every trainable parameter
        for p in model.parameters():
            if p.requires_grad:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
                p.grad_added_to_main_grad = False
    return model


class Recorder:
    """Per forward: each wrapped linear's output and its input's gradient; the decoder input's
    gradient when it requires grad; every adapter forward's decision."""

    def __init__(self, model, input_grad: bool):
        from regather.megatron.dense.model import adapters
        from regather.megatron.dense.wrapper import LoRALinear

        self.out: dict = {}
        self.dx: dict = {}
        self.seen: dict = {}
        self.inputs: list = []
        self.mb = 0
        for path, m in model.named_modules():
            if isinstance(m, LoRALinear):
                m.register_forward_pre_hook(self._pre(path))
                m.register_forward_hook(self._post(path))
        for path, ad in adapters(model).items():
            ad.register_forward_hook(lambda mod, a, o, _p=path: self.seen.setdefault(_p, []).append(
                str(mod.last_decision)))
        if input_grad:  # Bridge's maybe_enable_recompute_inputs_grad, on the decoder
            decoder = model.decoder
            orig = decoder.forward

            def forward(hidden_states, *args, **kwargs):
                if torch.is_grad_enabled() and not hidden_states.requires_grad:
                    hidden_states = hidden_states.detach().requires_grad_(True)
                    hidden_states.retain_grad()
                    self.inputs.append(hidden_states)
                return orig(hidden_states, *args, **kwargs)

            decoder.forward = forward

    def _pre(self, path):
        def hook(module, args):
            x = args[0]
            if x.requires_grad:
                key = (path, self.mb)
                x.register_hook(lambda g: self.dx.__setitem__(key, self.dx.get(key, 0) + g.detach().clone()))
        return hook

    def _post(self, path):
        def hook(module, args, output):
            self.out[(path, self.mb)] = output[0].detach().clone()
        return hook


def _loss(model, batch):
    inputs, labels, position_ids, mask = batch
    per_token = model(inputs, position_ids, mask, labels=labels)
    return per_token.float().mean(), per_token.detach().clone()


def _logits_loss(model, batch):
    """A loss whose backward can run twice: megatron's vocab-parallel cross entropy rewrites its
    saved softmax in place in backward (a second backward fails for every strategy, gather
    included), so ``retain_graph`` is checked on a fixed projection of this rank's logits."""
    inputs, _, position_ids, mask = batch
    logits = model(inputs, position_ids, mask)
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5)).to(logits.dtype)
    return (logits * w).float().mean(), logits.detach().clone()


def lora_grads(model, fusion: bool) -> dict:
    from regather.megatron.dense.model import adapters

    out = {}
    for path, ad in adapters(model).items():
        for key, w in (("A", ad.linear_in.weight), ("B", ad.linear_out.weight)):
            g = w.main_grad if fusion else w.grad
            if g is not None and key == "A" and ad.replicated_a:  # the Bridge (sharded) layout
                g = g[ad.lora_a_rows()]
            out[f"{path}.{key}"] = None if g is None else g.detach().clone()
            if fusion:
                out[f"{path}.{key}.flag"] = getattr(w, "grad_added_to_main_grad", None)
    return out


def run_variant(setup: Setup, variant: str) -> dict:
    """One fresh model of ``variant`` through ``setup.schedule``."""
    from regather import decisions
    from regather.core.accounting import ADAPTER_INPUT, CollectiveBytes, SavedBytes
    from regather.megatron.dense.model import adapters
    from regather.tools.cpu.models import gpt_batch

    model = build(setup, variant)
    rec = Recorder(model, setup.input_grad)
    sh = setup.shape
    batches = [gpt_batch(sh, setup.micro_batch, seed=s) for s in (1, 2)]
    res: dict = {"before": {p: str(d) for p, d in decisions(model).items()}}
    logs: list = []
    fallbacks: list = []  # (level, what, reason, adapter paths, text) of each fallback record

    def emit(r):
        logs.append((r.levelname, r.getMessage()))
        if hasattr(r, "regather_adapters"):
            fallbacks.append((r.levelname, r.regather_what, r.regather_reason, list(r.regather_adapters),
                              r.getMessage()))

    handler = logging.Handler()
    handler.emit = emit
    logger = logging.getLogger("regather")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        _schedule(setup, model, rec, batches, res, SavedBytes, CollectiveBytes)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    res["saved_adapter_input"] = res["saved_obj"].of(ADAPTER_INPUT) if "saved_obj" in res else None
    if "saved_obj" in res:
        saved = res.pop("saved_obj")
        res["saved_total"], res["saved_by_label"] = saved.total, saved.by_label()
    res["decisions"] = {p: str(a.last_decision) for p, a in adapters(model).items()}
    res["after"] = {p: str(d) for p, d in decisions(model).items()}
    res["seen"] = rec.seen
    res["out"], res["dx"] = rec.out, rec.dx
    res["input_dx"] = [t.grad for t in rec.inputs]
    res["logs"] = logs
    res["fallbacks"] = fallbacks
    res["producers"] = {p: (type(a.producer).__name__ if a.producer is not None else None, a.producer_reason)
                        for p, a in adapters(model).items()}
    res["norm_eps"] = [getattr(layer.input_layernorm, "eps", None) for layer in model.decoder.layers]
    return res


def _schedule(setup, model, rec, batches, res, SavedBytes, CollectiveBytes):
    fusion = setup.fusion
    torch.manual_seed(123)  # adapter dropout masks: the same for every variant
    if setup.schedule == "plain":
        with CollectiveBytes() as comm:
            with SavedBytes.for_model(model) as saved:
                loss, per_token = _loss(model, batches[0])
            res["comm_forward"] = comm.snapshot()
            loss.backward()
        res["comm"] = comm.snapshot()
        res["saved_obj"] = saved
        res["loss"], res["per_token"] = [loss.detach()], [per_token]
        res["grads"] = lora_grads(model, fusion)
    elif setup.schedule == "interleaved":  # fwd1 fwd2 bwd2 bwd1, grads accumulate
        with SavedBytes.for_model(model) as saved:
            l1, p1 = _loss(model, batches[0])
            rec.mb = 1
            l2, p2 = _loss(model, batches[1])
        l2.backward()
        l1.backward()
        res["saved_obj"] = saved
        res["loss"], res["per_token"] = [l1.detach(), l2.detach()], [p1, p2]
        res["grads"] = lora_grads(model, fusion)
    elif setup.schedule == "retain":  # a second backward through the same graph
        loss, per_token = _logits_loss(model, batches[0])
        loss.backward(retain_graph=True)
        res["grads_first"] = lora_grads(model, fusion)
        first_dx = {k: v.clone() for k, v in rec.dx.items()}
        try:
            loss.backward()
            res["second_error"] = None
        except RuntimeError as exc:
            res["second_error"] = str(exc)
        res["dx_first"] = first_dx
        res["loss"], res["per_token"] = [loss.detach()], [per_token]
        res["grads"] = lora_grads(model, fusion)
    elif setup.schedule in ("eval", "no_grad"):
        if setup.schedule == "eval":
            model.eval()
        res["eval_before"] = {}
        from regather import decisions

        ctx = torch.no_grad() if setup.schedule == "no_grad" else torch.enable_grad()
        with ctx:
            res["eval_before"] = {p: str(d) for p, d in decisions(model).items()}
            with SavedBytes.for_model(model) as saved:
                loss, per_token = _loss(model, batches[0])
        res["saved_obj"] = saved
        if loss.requires_grad:
            loss.backward()
        res["loss"], res["per_token"] = [loss.detach()], [per_token]
        res["grads"] = lora_grads(model, fusion)
    elif setup.schedule == "two_steps":  # step 1 clean; hooks switched on; step 2 recorded
        loss, _ = _loss(model, batches[0])
        loss.backward()
        res["grads_first"] = lora_grads(model, fusion)
        model.zero_grad(set_to_none=True)
        for h in getattr(model, "_regather_test_switches", []):
            h.on = True
        rec.mb = 1
        loss, per_token = _loss(model, batches[1])
        loss.backward()
        res["loss"], res["per_token"] = [loss.detach()], [per_token]
        res["grads"] = lora_grads(model, fusion)
    elif setup.schedule == "steps":  # eval forward, then a training step, then no_grad, then training
        from regather.megatron.dense.model import adapters

        res["phases"] = []
        for phase in ("eval", "train", "no_grad", "train"):
            model.train(phase != "eval")
            ctx = torch.no_grad() if phase == "no_grad" else torch.enable_grad()
            with ctx:
                loss, per_token = _loss(model, batches[0])
            if phase == "train":
                loss.backward()
            res["phases"].append({"phase": phase, "per_token": per_token,
                                  "decisions": {p: str(a.last_decision) for p, a in adapters(model).items()}})
        res["loss"], res["per_token"] = [loss.detach()], [per_token]
        res["grads"] = lora_grads(model, fusion)
    else:
        raise ValueError(setup.schedule)


def run_frozen(setup: Setup) -> dict:
    """The same model without LoRA, every weight frozen, through one plain step: the bytes autograd
    keeps for a backward that only carries gradients through the model (the decoder input requires
    grad with ``input_grad``, as in a fine-tune whose embeddings are frozen below the first adapter)."""
    from regather.core.accounting import SavedBytes
    from regather.tools.cpu.models import gpt_batch

    model = build_base(setup)
    for p in model.parameters():
        p.requires_grad_(False)
    rec = Recorder(model, setup.input_grad)
    with SavedBytes.for_model(model) as saved:
        loss, _ = _loss(model, gpt_batch(setup.shape, setup.micro_batch, seed=1))
    if loss.requires_grad:
        loss.backward()
    return {"saved_total": saved.total, "saved_by_label": saved.by_label(),
            "input_dx": [t.grad for t in rec.inputs]}


def run_setup(setup: Setup) -> dict:
    out = {}
    if setup.frozen_baseline:
        out["frozen"] = run_frozen(setup)
    for v in setup.variants:
        try:
            out[v] = run_variant(setup, v)
        except Exception as exc:
            import traceback

            out[v] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    return out


def run_many(rank: int, world: int, setups: dict, te: bool = False) -> dict:
    """Every setup (name -> Setup), TP=2 ones first; returns name -> variant -> result, and the
    seconds each setup took; with ``te`` also :func:`run_te` (under ``"te"``)."""
    import time

    out, seconds = {}, {}
    for name in sorted(setups, key=lambda n: (setups[n].tp != 2, n)):
        t0 = time.perf_counter()
        out[name] = run_setup(setups[name])
        seconds[name] = time.perf_counter() - t0
    result = {"results": out, "seconds": seconds}
    if te:
        t0 = time.perf_counter()
        result["te"] = run_te(rank, world)
        seconds["te"] = time.perf_counter() - t0
    return result


# -- Transformer Engine routing (the TE model's TELayerNormColumnParallelLinear) --------------------


def te_case(rank, t, strategy, recompute, *, behaviour, normalization="LayerNorm", zero_centered_gamma=False,
            x_grad=True, eps=1e-5, s=8, b=2, h=16, o=24, r=4, sp=True) -> dict:
    """LoRA on the TE model's LayerNorm-fused base (``behaviour``: TE <= 2.3 or 2.8 - 2.20), with and
    without recompute (``sp=False``: the whole sequence on every rank, the replicated path). Bytes:
    saved-tensor hooks over the first forward (they count TE's ``ln_out`` when it is saved, released
    or not) and the allocator's, alive after the later forwards (the smallest of three,
    regather.core.allocated, the collectives settled)."""
    import torch.distributed as dist
    from tests.harness.te_model import te_behaviour, te_linear
    from torch import nn

    from regather import LoRA
    from regather.core.accounting import ADAPTER_INPUT, CollectiveBytes, SavedBytes
    from regather.core.allocated import AllocatedBytes
    from regather.tools.cpu.megatron_cpu import enable_megatron_cpu

    enable_megatron_cpu()
    group = dist.group.WORLD
    with te_behaviour(behaviour):
        base = te_linear(h, o, tp_group=group, sequence_parallel=sp, eps=eps, normalization=normalization,
                         zero_centered_gamma=zero_centered_gamma)
        for p in base.parameters():
            p.requires_grad_(False)
        model = nn.Module()
        model.linear_qkv = base
        torch.manual_seed(5)
        LoRA(target_modules=["linear_qkv"], dim=r, alpha=2 * r, lora_B_init_method="normal",
             sequence_parallel_input_strategy=strategy, recompute_adapter_inputs=recompute)(model)
        lora = model.linear_qkv
        g = torch.Generator().manual_seed(11)
        x_full, dy_full = torch.randn(s, b, h, generator=g), torch.randn(s, b, o, generator=g)
        x = (x_full.chunk(t, 0)[rank] if sp else x_full).clone().requires_grad_(x_grad)
        dy = dy_full.chunk(t, 2)[rank].clone()
        out, alive = {}, []
        with CollectiveBytes() as comm:
            with SavedBytes.for_model(model) as saved:
                y, _ = lora(x)
            y.backward(dy)
            for _ in range(3):  # after the first-forward verification
                with AllocatedBytes(settle_collectives=True, hold_collective_tensors=True) as alloc:
                    y2, _ = lora(x)
                y2.backward(dy)
                alive.append(alloc.alive)
    a, ad = lora.adapter.linear_in.weight, lora.adapter
    rows = ad.lora_a_rows() if ad.replicated_a else slice(None)
    out.update(out=y.detach(), out2=y2.detach(), dx=None if x.grad is None else x.grad.clone(),
               dA=a.grad[rows].clone(), dB=ad.linear_out.weight.grad.clone(), decision=str(ad.last_decision),
               producer=type(ad.producer).__name__ if ad.producer is not None else ad.producer_reason,
               saved_total=saved.total, saved_adapter_input=saved.of(ADAPTER_INPUT), comm=comm.snapshot(),
               alive=min(alive))
    return out


TE_NORMS = {"layernorm": {}, "rmsnorm": {"normalization": "RMSNorm"},
            "zero_centered": {"zero_centered_gamma": True},
            "rmsnorm_zero_centered": {"normalization": "RMSNorm", "zero_centered_gamma": True, "eps": 1e-3}}


def run_te(rank, t) -> dict:
    """Every TE case on both behaviours (keys ``(behaviour, norm, strategy, recompute)``)."""
    out = {}
    for behaviour in ("te<=2.3", "te2.8-2.20"):
        for norm, kw in TE_NORMS.items():
            for strategy in ("gather", "regather", "lowrank"):
                for rc in (False, True):
                    out[(behaviour, norm, strategy, rc)] = te_case(rank, t, strategy, rc, behaviour=behaviour, **kw)
        for strategy in ("gather", "regather"):  # SP off: every strategy takes the replicated path
            for rc in (False, True):
                out[(behaviour, "sp_off", strategy, rc)] = te_case(rank, t, strategy, rc, sp=False, behaviour=behaviour)
        for strategy in ("regather", "lowrank"):  # the norm keeps nothing: its input and weights need no grad
            for rc in (False, True):
                out[(behaviour, "no_x_grad", strategy, rc)] = te_case(rank, t, strategy, rc, x_grad=False,
                                                                     behaviour=behaviour)
    return out
