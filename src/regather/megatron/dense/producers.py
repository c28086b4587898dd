"""Producers of adapter inputs: found in the model, checked per forward, run again in backward.

With ``LoRA(recompute_adapter_inputs=True)`` an adapter saves, instead of its input, the
tensor that the op producing that input already saves for its own backward, and rebuilds
the input from it (:class:`regather.core.recompute.sources.Recomputed`):

======================= ============================= =================================== ========================
adapter                 producer (found from)         saved instead of the input          recompute
======================= ============================= =================================== ========================
``linear_qkv``          ``input_layernorm`` of the    the norm's input (the residual      the norm module's own
                        ``TransformerLayer`` holding  stream ``[s/t, b, h]``), which the  ``forward``
                        the ``SelfAttention``         norm keeps for its backward
``linear_fc1``          ``pre_mlp_layernorm``         the same                            the same
TE ``linear_qkv`` /     the base itself               its pre-norm input, which TE keeps  :func:`regather.megatron.dense.te.
``linear_fc1``          (``TELayerNormColumn...``)                                        layernorm_output`
``linear_fc2``          megatron ``MLP``'s activation ``linear_fc1``'s output (the         MLP's activation code,
                        between ``linear_fc1`` and    activation's input, which the       gated or not, fused
                        ``linear_fc2``                activation keeps)                   or not (mirrored)
expert ``linear_fc2``   an expert ``MLP``'s           the same, and the routing probs     the same, times the
(``SequentialMLP``)     activation times its          (``per_token_scale``) that the      probs, cast back (or
                        ``per_token_scale``           multiply (weighted SwiGLU) keeps    the weighted SwiGLU)
======================= ============================= =================================== ========================

The pairing comes from the model's structure (module classes and which module holds which;
a custom spec that overrides ``forward`` is refused) and is checked on every forward before
anything is saved:

- the adapter input *is* the producer's output (the same tensor object, its version unchanged:
  nothing modified it in place in between), recorded by a hook that runs before any other hook
  of that module (``prepend=True``: the norm's forward hook; for ``linear_fc2``, a forward
  pre-hook on it that records what megatron's MLP passed in). A hook registered for every module
  (``torch.nn.modules.module.register_module_forward_hook`` / ``_pre_hook``) runs before those,
  so while one is registered no input is recomputed. These checks run on *every* forward: a hook
  that starts changing the input after the first forward is caught as well;
- the adapter input depends on nothing but the producer's input (walking its autograd graph,
  parameters aside), and some node on that walk saved a tensor sharing the storage of what
  we are about to save — so saving it adds no bytes. A norm whose input and weights need no
  gradient (layer 0 with frozen embeddings) saves nothing, and then recompute would keep a
  tensor alive that nobody else keeps: the input is kept instead, with that reason;
- activation recompute or CPU offload covering the producer, an fp8 input store: refused with
  the reason.

What cannot be established is never guessed: :meth:`capture` returns a reason and the adapter
keeps its input as before (``regather.decisions`` shows it). The first recompute of every
adapter is also compared with the input the forward computed (``torch.equal``); a producer
whose rerun is not bit-identical is switched off for that adapter with the difference named.
"""

from __future__ import annotations

import math
import sys
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from regather.core.recompute.graph import Meta, kept_between, modified_in_place, reason_now, same_tensor
from regather.core.recompute.producers import HookedProducer, NormProducer
from regather.core.recompute.sources import Captured, Kept, Recomputed
from regather.megatron.dense import te, te_release, te_rule
from regather.megatron.reasons import CPU_OFFLOADING, TE_FUSED_NORM, layernorm_recomputed, no_recomputable_producer

_NORM_CLASSES = ("LayerNorm", "RMSNorm", "FusedLayerNorm", "L2Norm")


class MegatronNormProducer(NormProducer):
    """A megatron norm (``input_layernorm`` / ``pre_mlp_layernorm``) feeding the adapter; refused
    while selective recompute covers ``layernorm`` (megatron reruns it: it keeps no input)."""

    def __init__(self, norm: nn.Module, name: str, config=None):
        super().__init__(norm, name)
        self.config = config

    def static_reason(self) -> str | None:
        modules = getattr(self.config, "recompute_modules", None) or []
        if getattr(self.config, "recompute_granularity", None) == "selective" and "layernorm" in modules:
            return layernorm_recomputed(modules)
        return None


class TELayerNormProducer(HookedProducer):
    """Transformer Engine's fused ``TELayerNormColumnParallelLinear``: its input is pre-norm,
    the adapter reads its (local) LayerNorm output. TE keeps its pre-norm input (``inputmat``),
    and keeps the returned output too unless it is released: a forward whose adapters all rebuild
    it frees TE's copy (:mod:`regather.megatron.dense.te_release`), so this producer is refused
    wherever that cannot be done safely (its ``static_reason``, on every forward:
    :func:`regather.megatron.dense.te_rule.unsupported_reason`), and a forward where TE's saved copy
    cannot be found keeps its input."""

    name = TE_FUSED_NORM

    def __init__(self, module: nn.Module, target: str | None = None):
        super().__init__(module)
        self.target = target  # linear_qkv / linear_fc1: which of megatron's offload modules cover it

    def output_of(self, result):
        if not getattr(self.module, "return_layernorm_output", False):
            return None
        return te.split_output(result)[2]

    def static_reason(self) -> str | None:
        return te_rule.unsupported_reason(self.module, te.installed_version(), self.target)

    def capture(self, x: torch.Tensor) -> Captured:
        found = super().capture(x)
        if isinstance(found, Recomputed):
            saved = te_release.saved_layernorm_output(x)
            if isinstance(saved, str):
                return Kept(f"{self.name}: {saved}")
        return found

    def recompute(self, inp: torch.Tensor) -> torch.Tensor:
        return te.layernorm_output(self.module, inp)


class ActivationProducer:
    """megatron ``MLP``'s activation between ``linear_fc1`` and ``linear_fc2``."""

    def __init__(self, mlp: nn.Module):
        self.mlp, self.config = mlp, mlp.config
        gated = getattr(self.config, "gated_linear_unit", False)
        fn = getattr(mlp, "activation_func", None)
        fused = getattr(self.config, "bias_activation_fusion", False)
        self.name = (f"the MLP activation ({getattr(fn, '__name__', type(fn).__name__)}"
                     f"{', gated' if gated else ''}{', fused' if fused else ''})")
        self._clear()
        self._scale = None  # weakly: this forward's per_token_scale (experts: the routing probs)
        mlp.linear_fc1.register_forward_hook(self._seen)
        mlp.register_forward_pre_hook(self._called, with_kwargs=True)
        # what MLP.forward hands linear_fc2 (the activation's output), before any other pre-hook
        # of linear_fc2 may replace it: capture requires the adapter input to be that tensor
        mlp.linear_fc2.register_forward_pre_hook(self._handed, prepend=True)

    def _clear(self):
        self._meta, self._stop, self._bias = None, None, None
        self._act, self._act_version = None, None

    def _handed(self, module, args):
        act = args[0] if args else None
        if isinstance(act, torch.Tensor) and torch.is_grad_enabled():
            self._act, self._act_version = weakref.ref(act), act._version
        else:
            self._act, self._act_version = None, None

    def _called(self, module, args, kwargs):
        scale = self.scale_argument(args, kwargs)
        self._scale = weakref.ref(scale) if isinstance(scale, torch.Tensor) else None

    def scale_argument(self, args, kwargs) -> torch.Tensor | None:
        """The per-token scale the MLP is called with (an expert MLP's routing probs), or None."""
        return kwargs.get("per_token_scale", args[1] if len(args) > 1 else None)

    def _seen(self, module, args, result):
        out, bias = result if isinstance(result, tuple) else (result, None)
        if not (torch.is_grad_enabled() and isinstance(out, torch.Tensor)):
            self._clear()
            return
        self._meta, self._stop, self._bias = Meta(out), out.grad_fn, bias

    def static_reason(self) -> str | None:
        cfg = self.config
        if getattr(cfg, "activation_func_fp8_input_store", False):
            return "the activation stores its input in fp8 (activation_func_fp8_input_store=True)"
        if getattr(cfg, "cpu_offloading", False) and getattr(cfg, "cpu_offloading_activations", True):
            return CPU_OFFLOADING
        if getattr(cfg, "bias_activation_fusion", False) and not getattr(cfg, "use_te_activation_func", False):
            fn, gated = self.mlp.activation_func, getattr(cfg, "gated_linear_unit", False)
            # megatron fuses gelu (plain or gated) and SwiGLU; and, in an expert MLP scaled by its
            # routing probs (the only place megatron runs it fused), the gated, clamped quick-GeLU
            quick_gelu = getattr(sys.modules[type(self.mlp).forward.__module__], "quick_gelu", None)
            if not (fn is F.gelu or (fn is F.silu and gated) or (quick_gelu is not None and fn is quick_gelu
                                                                  and gated)):
                return f"bias-activation fusion with {getattr(fn, '__name__', fn)!r} is not one megatron fuses"
        return None

    def capture(self, x: torch.Tensor) -> Captured:
        meta, stop, bias = self._meta, self._stop, self._bias
        act = self._act() if self._act is not None else None
        act_version = self._act_version
        self._clear()
        why = reason_now(self)
        if why is not None:
            return Kept(why)
        scale = self._scale() if self._scale is not None else None
        if self._scale is not None and scale is None:
            return Kept("the MLP's per-token scale is gone before linear_fc2 ran")
        if meta is None:
            return Kept("linear_fc1 did not run in this forward")
        if act is None or not same_tensor(x, act):
            return Kept(f"the adapter input is not {self.name}'s output (linear_fc2's input was replaced)")
        changed = modified_in_place(act, act_version, self.name)
        if changed:
            return Kept(changed)
        biased = []

        def pick(saved):
            """Unfused bias: the activation keeps ``fc1_out + bias`` (gated: the two halves
            ``torch.chunk`` cut from it), not fc1's output: recompute from that sum."""
            for t in saved:
                found = _biased_sum(t, meta, stop) if bias is not None else None
                if found is not None:
                    biased.append(True)
                    return found
            return None

        # an expert MLP scales the activation by the routing probs (``per_token_scale.unsqueeze(-1)``):
        # the multiply (or megatron's fused weighted SwiGLU) keeps that view of the probs
        extra = None if scale is None else (Meta(scale.unsqueeze(-1)), scale.grad_fn)
        found = kept_between(x, meta, stop, pick=pick, extra=extra)
        if isinstance(found, Kept):
            return Kept(f"{self.name}: {found.reason}")
        found, weights = found if extra is not None else (found[0], None)
        return Recomputed(self, (found, None if biased else bias, weights))  # with a bias in ``found``, none apart

    def recompute(self, out: torch.Tensor, bias: torch.Tensor | None,
                  scale: torch.Tensor | None = None) -> torch.Tensor:
        return mlp_activation(self.mlp, out, bias, scale)


def _biased_sum(t: torch.Tensor, meta: Meta, stop) -> torch.Tensor | None:
    """``fc1_out + bias`` if the saved ``t`` is that sum (an ``AddBackward0`` of fc1's output
    node ``stop``) or one of the halves a gated activation's ``torch.chunk`` cut from it — then
    rebuilt over the same storage, which the activation's node keeps, so it adds no bytes.
    Under ``saved_tensors_hooks`` an unpacked view has no ``_base``; its ``SplitBackward0``
    node and its geometry (a last-dim half of a contiguous sum) identify the sum instead."""
    node = t.grad_fn
    if node is not None and type(node).__name__ == "SplitBackward0":
        full, half = torch.empty(meta.shape, device="meta").stride(), meta.shape[-1] // 2  # contiguous strides
        if (tuple(t.stride()) != full or t.storage_offset() not in (0, half) or t.dtype != meta.dtype
                or t.untyped_storage().nbytes() != math.prod(meta.shape) * t.element_size()):
            return None
        node = node.next_functions[0][0]
        t = t.detach().as_strided(meta.shape, full, 0)
    if (node is None or type(node).__name__ != "AddBackward0" or tuple(t.shape) != meta.shape
            or not any(fn is stop for fn, _ in node.next_functions)):
        return None
    return t.detach()


def mlp_activation(mlp: nn.Module, intermediate: torch.Tensor, bias: torch.Tensor | None,
                   scale: torch.Tensor | None = None) -> torch.Tensor:
    """The activation block of megatron-core's ``MLP.forward`` (0.16.1 – 0.19.x), on the same
    functions that module imported, so the result is bit-identical. ``scale`` is an expert's
    ``per_token_scale.unsqueeze(-1)`` (``[n, 1]``, the routing probs), applied as megatron does:
    after the activation in the probs' precision, cast back; fused into megatron's weighted
    SwiGLU / quick-GeGLU under ``bias_activation_fusion``."""
    cfg, fn = mlp.config, mlp.activation_func
    mod = sys.modules[type(mlp).forward.__module__]
    if scale is None:
        return _activation(cfg, fn, mod, intermediate, bias)
    return scaled_activation(cfg, fn, mod, intermediate, bias, scale)


def scaled_activation(cfg, fn, mod, intermediate: torch.Tensor, bias: torch.Tensor | None,
                      scale: torch.Tensor) -> torch.Tensor:
    """The activation times an expert's probs view ``scale`` (``[n, 1]``), as megatron's ``MLP``
    and ``TEGroupedMLP`` apply it (``mod``: the module whose functions they call): megatron's
    weighted SwiGLU / quick-GeGLU under ``bias_activation_fusion``, else after the activation in
    the probs' precision, cast back."""
    if cfg.bias_activation_fusion and not cfg.use_te_activation_func:
        if fn is F.silu and cfg.gated_linear_unit:
            return mod.weighted_bias_swiglu_impl(intermediate, bias, scale, cfg.activation_func_fp8_input_store)
        return mod.weighted_bias_quick_geglu_impl(intermediate, bias, scale, cfg.activation_func_fp8_input_store,
                                                  cfg.glu_linear_offset, cfg.activation_func_clamp_value)
    out = _activation(cfg, fn, mod, intermediate, bias)
    return (out * scale).to(out.dtype)


def _activation(cfg, fn, mod, intermediate: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The unscaled activation of :func:`mlp_activation`."""
    if cfg.use_te_activation_func:
        if bias is not None:
            intermediate = intermediate + bias
        return fn(intermediate)
    if cfg.bias_activation_fusion:
        if fn is F.gelu:
            if cfg.gated_linear_unit:
                return mod.bias_geglu_impl(intermediate, bias)
            return mod.bias_gelu_impl(intermediate, bias)
        return mod.bias_swiglu_impl(intermediate, bias, cfg.activation_func_fp8_input_store,
                                    cfg.cpu_offloading and cfg.cpu_offloading_activations and mod.HAVE_TE)
    if bias is not None:
        intermediate = intermediate + bias
    if cfg.gated_linear_unit:
        x_glu, x_linear = torch.chunk(intermediate, 2, dim=-1)
        val = getattr(cfg, "activation_func_clamp_value", None)
        if val is not None:
            x_glu = x_glu.clamp(min=None, max=val)
            x_linear = x_linear.clamp(min=-val, max=val)
        if hasattr(cfg, "glu_linear_offset"):
            x_linear = x_linear + cfg.glu_linear_offset
        return cfg.activation_func(x_glu) * x_linear
    return fn(intermediate)


# -- finding them ----------------------------------------------------------------------------------


def _megatron_classes():
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return SelfAttention, MLP, TransformerLayer


def own_forward(module: nn.Module, cls: type) -> bool:
    """``module`` is a ``cls`` running ``cls``'s own forward (no custom spec overriding it)."""
    return isinstance(module, cls) and type(module).forward is cls.forward


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__ in _NORM_CLASSES


def find_producer(model: nn.Module, path: str, wrapper: nn.Module):
    """The producer of the adapter input of the wrapped linear at ``path``, or why there is none."""
    SelfAttention, MLP, TransformerLayer = _megatron_classes()
    name = path.rsplit(".", 1)[-1]
    parent_path = path.rpartition(".")[0]
    parent = model.get_submodule(parent_path) if parent_path else model
    grand_path = parent_path.rpartition(".")[0]
    grand = (model.get_submodule(grand_path) if grand_path else model) if parent_path else None
    base = wrapper.to_wrap
    if name in ("linear_qkv", "linear_fc1") and te.fuses_layernorm(base):
        return TELayerNormProducer(base, name)
    if name == "linear_qkv":
        owner, norm_attr, holder = SelfAttention, "input_layernorm", "self_attention"
    elif name == "linear_fc1":
        owner, norm_attr, holder = MLP, "pre_mlp_layernorm", "mlp"
    elif name == "linear_fc2":
        if not own_forward(parent, MLP):
            return f"{name}'s parent is a {type(parent).__name__}, not megatron's MLP running its own forward"
        producer = ActivationProducer(parent)
        return producer.static_reason() or producer
    else:
        return no_recomputable_producer(name)
    if not own_forward(parent, owner):
        return f"{name}'s parent is a {type(parent).__name__}, not megatron's {owner.__name__} running its own forward"
    if grand is None or not own_forward(grand, TransformerLayer) or getattr(grand, holder, None) is not parent:
        return f"{name} is not inside a megatron TransformerLayer running its own forward (custom spec)"
    norm = getattr(grand, norm_attr, None)
    if norm is None or not _is_norm(norm):
        return f"{norm_attr} of the layer is a {type(norm).__name__}, not a norm this package recomputes"
    return MegatronNormProducer(norm, norm_attr, getattr(grand, "config", None))
