"""Checkpoints of a LoRA model: state-dict keys, distributed-checkpoint shards, partial loads.

regather writes Megatron Bridge's layout, so that checkpoints cross-load between the two
implementations and a frozen model's own checkpoint loads into the wrapped model:

=============================== ======================================= ==========================================
entry                           ``state_dict`` key                      ``sharded_state_dict`` (dist_checkpointing)
=============================== ======================================= ==========================================
frozen base parameters          ``<path>.weight`` (no ``to_wrap.``)     the base layer's own ``sharded_state_dict``
LoRA-A, column-parallel base    ``<path>.adapter.linear_in.weight``     ``[r, h]`` global, split over TP on axis 0
LoRA-A, row-parallel base       ``<path>.adapter.linear_in.weight``     ``[r, h]`` global, split over TP on axis 1
LoRA-B                          ``<path>.adapter.linear_out.weight``    ``[o, r]`` global, split over TP on axis 0;
                                                                        gated ``linear_fc1``: gate and up halves
                                                                        declared apart (megatron's SwiGLU factory)
holder extra state              ``<path>.adapter.linear_{in,out}.``     ``ShardedObject`` (``None``), as megatron's
                                ``_extra_state``                        linears write it
DoRA magnitude, column base     ``<path>.adapter.weight_magnitude``     ``[o]`` global, split over TP on axis 0
DoRA magnitude, row base        ``<path>.adapter.weight_magnitude``     ``[o]``, replicated (Bridge's layout)
=============================== ======================================= ==========================================

``<path>`` is the wrapped linear's path (``decoder.layers.0.self_attention.linear_qkv``);
in a distributed checkpoint the layer index moves into a leading axis (megatron's
``TransformerBlock``), e.g. ``decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight``
of ``(L, r, h)``. A low-rank adapter's replicated LoRA-A ``[r, h]`` is written as this rank's
rows, exactly like a sharded one, so every strategy writes the same checkpoint.

Loading accepts the layout above, and regather's earlier one (``<path>.to_wrap.weight``, no
``_extra_state``) — never by being lenient: every key is matched. To load only one part
(a frozen model's checkpoint into a wrapped model, or an adapter-only checkpoint), use
:func:`load_base_state_dict` / :func:`load_adapter_state_dict`, strict within their part;
:func:`base_only` / :func:`adapter_only` select the same part of a (sharded) state dict for
``dist_checkpointing.load``::

    sharded = checkpoint.base_only(model.sharded_state_dict())
    checkpoint.load_base_state_dict(model, dist_checkpointing.load(sharded, pretrained_dir))
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import nn

WRAPPED = "to_wrap."
ADAPTER = "adapter."


# -- the wrapper's keys ----------------------------------------------------------------


def flatten_base_keys(module: nn.Module, state_dict, prefix: str, local_metadata) -> None:
    """``state_dict`` hook of ``LoRALinear``: ``<prefix>to_wrap.<k>`` -> ``<prefix><k>``.

    The wrapper's entries are the last ones added to ``state_dict``; they are re-inserted in
    order (base first, then the adapter), as megatron Bridge's wrapper writes them.
    """
    keys = []
    for key in reversed(state_dict):
        if not key.startswith(prefix):
            break
        keys.append(key)
    inner = prefix + WRAPPED
    for key in reversed(keys):
        value = state_dict.pop(key)
        state_dict[prefix + key[len(inner):] if key.startswith(inner) else key] = value


def nest_base_keys(state_dict, prefix: str, *unused) -> None:
    """``load_state_dict`` pre-hook of ``LoRALinear``: ``<prefix><k>`` -> ``<prefix>to_wrap.<k>``
    for every key of this wrapper that is not the adapter's (already nested keys stay)."""
    mine = [k for k in state_dict if k.startswith(prefix)]
    for key in mine:
        rest = key[len(prefix):]
        if rest.startswith((WRAPPED, ADAPTER)):
            continue
        nested = prefix + WRAPPED + rest
        if nested in state_dict:
            raise ValueError(f"state dict holds the frozen base weight twice: {key!r} and {nested!r}")
        state_dict[nested] = state_dict.pop(key)


# -- distributed checkpoints ------------------------------------------------------------


def _metadata(metadata):
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    return ensure_metadata_has_dp_cp_group(metadata)


def lora_linear_sharded_state_dict(wrapper, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
    """The base layer's own shards under the wrapper's prefix, then the adapter's."""
    metadata = _metadata(metadata)
    out = dict(wrapper.to_wrap.sharded_state_dict(prefix, sharded_offsets, metadata))
    out.update(wrapper.adapter.sharded_state_dict(f"{prefix}{ADAPTER}", sharded_offsets, metadata))
    return out


def adapter_sharded_state_dict(adapter, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
    """LoRA-A and LoRA-B as megatron's Column/RowParallelLinear would declare them (table above)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    metadata = _metadata(metadata)
    tp_group = adapter.tp_group or parallel_state.get_tensor_model_parallel_group()
    out = {}
    for name, holder, axis in (("linear_in", adapter.linear_in, 0 if adapter.column_parallel else 1),
                               ("linear_out", adapter.linear_out, 0)):
        local = holder.state_dict(prefix="", keep_vars=True)
        if name == "linear_in" and adapter.replicated_a:  # this rank's rows: the sharded layout
            local["weight"] = local["weight"].detach()[adapter.lora_a_rows()]
        out.update(make_sharded_tensors_for_checkpoint(
            local, f"{prefix}{name}.", {"weight": axis}, sharded_offsets,
            tp_group=tp_group, dp_cp_group=metadata["dp_cp_group"]))
    if (adapter.facts.base_name == "linear_fc1" and getattr(adapter.config, "gated_linear_unit", False)
            and getattr(adapter, "gate_up_fused", True)):  # CanonicalLoRA's gate/up adapters hold one half
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        key = f"{prefix}linear_out.weight"  # [gate_i; up_i] per rank, like the base fc1 weight
        out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets,
                                                metadata.get("singleton_local_shards", False))
    return out


def magnitude_sharded_state_dict(adapter, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
    """A DoRA adapter's ``weight_magnitude`` as Megatron Bridge's ``ParallelLinearDoRAAdapter`` declares it:
    ``[o]`` global split over TP on axis 0 for a column-parallel base, replicated (whole) for a row-parallel one."""
    from megatron.core import parallel_state
    from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

    metadata = _metadata(metadata)
    key = f"{prefix}weight_magnitude"
    groups = dict(tp_group=adapter.tp_group or parallel_state.get_tensor_model_parallel_group(),
                  dp_cp_group=metadata["dp_cp_group"])
    if adapter.column_parallel:
        sharded = make_tp_sharded_tensor_for_checkpoint(adapter.weight_magnitude, key, 0,
                                                        prepend_offsets=sharded_offsets, **groups)
    else:
        sharded = make_sharded_tensor_for_checkpoint(adapter.weight_magnitude, key, prepend_offsets=sharded_offsets,
                                                     **groups)
    return {key: sharded}


# -- parts of a checkpoint ----------------------------------------------------------------


def is_adapter_key(key) -> bool:
    """Whether a state-dict key (or a sharded-state-dict key) belongs to a LoRA adapter."""
    key = key if isinstance(key, str) else str(key)
    return key.startswith(ADAPTER) or f".{ADAPTER}" in key


def adapter_only(state_dict: Mapping) -> dict:
    """The adapter weights of a state dict or a sharded state dict (by dict key).

    The holders' ``_extra_state`` (always ``None``) is left out, as Megatron Bridge's adapter
    filter leaves it out of every PEFT checkpoint: selecting it for ``dist_checkpointing.load``
    would ask a Bridge adapter checkpoint for objects it does not hold.
    """
    return {k: v for k, v in state_dict.items() if is_adapter_key(k) and not _is_extra_state(k)}


def _is_extra_state(key) -> bool:
    return str(key).endswith("_extra_state")


def base_only(state_dict: Mapping) -> dict:
    """Everything but the adapter entries (what a frozen model's checkpoint holds)."""
    return {k: v for k, v in state_dict.items() if not is_adapter_key(k)}


def _wrapper_paths(model: nn.Module) -> list[str]:
    # LoRALinear marks itself (no import of regather.megatron.lora here: lora -> adapter -> checkpoint)
    return [path for path, m in model.named_modules() if getattr(m, "is_lora_wrapper", False)]


def _canonical(keys: Iterable[str], wrappers: list[str]) -> dict[str, str]:
    """Map each given key to the layout's key (an earlier ``<path>.to_wrap.<k>`` -> ``<path>.<k>``)."""
    nested = [(f"{p}.{WRAPPED}" if p else WRAPPED, f"{p}." if p else "") for p in wrappers]
    out = {}
    for key in keys:
        for old, new in nested:
            if key.startswith(old):
                key_new = new + key[len(old):]
                break
        else:
            key_new = key
        out[key] = key_new
    return out


def _load_part(model: nn.Module, state_dict: Mapping, adapter_part: bool) -> None:
    expected = {k for k in model.state_dict(keep_vars=True) if is_adapter_key(k) == adapter_part}
    given = _canonical(state_dict, _wrapper_paths(model))
    unexpected = sorted(k for k, c in given.items() if c not in expected)
    # _extra_state may be absent, as megatron's own linears accept on load (they default it to
    # None in a load pre-hook; GPTModel.sharded_state_dict drops output_layer's) and as Bridge's
    # adapter checkpoints leave it out; every weight is required
    missing = sorted(k for k in expected - set(given.values()) if not _is_extra_state(k))
    what = "adapter" if adapter_part else "frozen base"
    if unexpected or missing:
        raise KeyError(f"loading the {what} part of {type(model).__name__}: missing keys {missing[:8]}"
                       f"{'...' if len(missing) > 8 else ''} ({len(missing)}), unexpected keys "
                       f"{unexpected[:8]}{'...' if len(unexpected) > 8 else ''} ({len(unexpected)})")
    result = model.load_state_dict(dict(state_dict), strict=False)
    left = [k for k in result.missing_keys if is_adapter_key(k) == adapter_part and not _is_extra_state(k)]
    if left or result.unexpected_keys:  # the checks above make this unreachable; never silent
        raise RuntimeError(f"loading the {what} part: missing {left}, unexpected {result.unexpected_keys}")


def load_base_state_dict(model: nn.Module, state_dict: Mapping) -> None:
    """Load a frozen model's state dict (no adapter keys) into a LoRA-wrapped ``model``.

    Strict for the base: every non-adapter weight of ``model`` must be given and nothing else
    (``_extra_state`` entries may be absent, as megatron's linears allow); checked before
    anything is loaded. The adapters keep their weights.
    """
    _load_part(model, state_dict, adapter_part=False)


def load_adapter_state_dict(model: nn.Module, state_dict: Mapping) -> None:
    """Load an adapter-only state dict (e.g. Megatron Bridge's PEFT checkpoint) into ``model``.

    Strict for the adapters: every adapter weight of ``model`` must be given and nothing
    else; checked before anything is loaded.
    """
    _load_part(model, state_dict, adapter_part=True)
