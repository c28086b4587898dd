"""Rank workers: checkpoints across Megatron Bridge 0.6.2 and regather (state dicts and
megatron ``dist_checkpointing``), on the tiny GPT of workers_bridge (TP=2 + SP, fp32).

How Bridge itself loads a LoRA checkpoint (Bridge 0.6.2 source):

- the frozen base: ``training/setup.py`` (``_create_peft_pre_wrap_hook``) loads the
  pretrained checkpoint into the model *before* ``peft(model, training=True)`` wraps it,
  i.e. under the unwrapped keys (``…linear_qkv.weight``);
- the adapters, on resume: ``training/checkpointing.py`` builds the model's
  ``sharded_state_dict()``, keeps only ``peft.adapter_key_filter(key)`` entries without
  ``_extra_state`` (``apply_peft_adapter_filter_to_state_dict``), ``dist_checkpointing.load``s
  it and calls ``model.load_state_dict(..., strict=False)``; ``peft/utils.py``
  ``load_peft_adapter_checkpoint`` does the same for external trainers (``strict=False``);
- Bridge's wrapper writes base keys without ``to_wrap.`` but defines no load hook, so its
  own wrapped model does not load its own ``state_dict()`` with ``strict=True``
  (:func:`state_dict_worker` records that).
"""

from __future__ import annotations

import torch
import workers_bridge as W

from regather.tools.cpu.models import gpt_batch

STRATEGIES = ("gather", "regather", "lowrank")
# regather's models with the classic output: what a checkpoint restores is compared with Bridge's model
# bit for bit (regather's lean default sums the row adapters' LoRA-B weight gradient in another order,
# tests/distributed/megatron/bridge/test_bridge_parity.py)
CLASSIC = {"lean_transients": False}


def _outputs(model, batch) -> dict:
    res = W.measure(model, batch)
    return {"logits": res["logits"], "loss": res["loss"], "grads": res["grads"]}


def _diff(a: dict, b: dict, rank: int) -> float:
    """Largest absolute difference of logits, losses and LoRA gradients (a replicated
    LoRA-A gradient is compared on this rank's rows)."""
    d = [(a["logits"] - b["logits"]).abs().max(), (a["loss"] - b["loss"]).abs().max()]
    assert a["grads"].keys() == b["grads"].keys()
    for n, g in b["grads"].items():
        mine = a["grads"][n]
        if mine.shape != g.shape:
            mine = mine.chunk(W.TP, 0)[rank]
        d.append((mine - g).abs().max())
    return float(max(d))


def _load_report(result) -> dict:
    return {"missing": sorted(result.missing_keys), "unexpected": sorted(result.unexpected_keys)}


def _same_state(a: dict, b: dict) -> bool:
    if list(a) != list(b):
        return False
    for k, v in a.items():
        w = b[k]
        if isinstance(v, torch.Tensor) != isinstance(w, torch.Tensor):
            return False
        if isinstance(v, torch.Tensor) and not (v.shape == w.shape and v.dtype == w.dtype and torch.equal(v, w)):
            return False
        if not isinstance(v, torch.Tensor) and v != w:
            return False
    return True


def state_dict_worker(rank: int, world_size: int) -> dict:
    from regather.megatron.dense import checkpoint

    W.bridge_peft()
    batch = gpt_batch(W.SHAPE, W.MICRO_BATCH, seed=3)
    out: dict = {"rank": rank}

    bridge = W.bridge_model(regather=False)
    bsd = bridge.state_dict()
    ref = _outputs(bridge, batch)
    out["bridge_keys"] = list(bsd)
    out["bridge_extra_state"] = sorted(k for k in bsd if k.endswith("_extra_state") and ".adapter." in k)
    # Bridge's own wrapped model and its own state dict, strict
    other = W.bridge_model(regather=False)
    try:
        other.load_state_dict(bsd, strict=True)
        out["bridge_self_strict"] = "loaded"
    except RuntimeError as exc:
        out["bridge_self_strict"] = str(exc).splitlines()[0]
    out["bridge_self_lenient"] = _load_report(other.load_state_dict(bsd, strict=False))

    # Bridge -> regather, every strategy, strict=True; regather writes back the same state dict
    for strategy in STRATEGIES:
        # another adapter init than Bridge's: the load must replace it
        model = W.regather_model(strategy, lora_B_init_method="normal", **CLASSIC)
        before = _diff(_outputs(model, batch), ref, rank)
        model.load_state_dict(bsd, strict=True)
        out[strategy] = {"before": before, "after": _diff(_outputs(model, batch), ref, rank),
                         "writes_bridge_state_dict": _same_state(model.state_dict(), bsd)}

    # Bridge's adapter-only part (its checkpoint filter) -> regather, strict within the part
    peft = W.bridge_lora(regather=False)
    adapter_part = {k: v for k, v in bsd.items() if peft.adapter_key_filter(k) and "_extra_state" not in k}
    model = W.regather_model("regather", lora_B_init_method="normal", **CLASSIC)
    checkpoint.load_adapter_state_dict(model, adapter_part)
    out["adapter_part_into_regather"] = _diff(_outputs(model, batch), ref, rank)

    # regather -> Bridge, the way Bridge loads: base into the unwrapped model (pretrained),
    # then the adapter part through Bridge's filter with strict=False (resume)
    mine = W.regather_model("regather", lora_B_init_method="normal", adapter_seed=5, **CLASSIC)
    mine_out = _outputs(mine, batch)
    msd = mine.state_dict()
    base = W.base_model()
    out["base_into_unwrapped_strict"] = _load_report(base.load_state_dict(checkpoint.base_only(msd), strict=True))
    target = W.bridge_lora(regather=True)([base], training=True)[0]
    filtered = {k: v for k, v in msd.items() if peft.adapter_key_filter(k) and "_extra_state" not in k}
    report = _load_report(target.load_state_dict(filtered, strict=False))
    out["regather_into_bridge"] = {**report, "diff": _diff(_outputs(target, batch), mine_out, rank),
                                   "adapter_keys": sorted(filtered)}
    out["bridge_own_filtered_keys"] = sorted(adapter_part)
    return out


# -- megatron dist_checkpointing ---------------------------------------------------------------


def _full_adapter_weights(model) -> dict[str, torch.Tensor]:
    """Every adapter weight as the full (unsharded) tensor, gathered over TP along its
    partition axis (a replicated LoRA-A as it is)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    t = dist.get_world_size(group)
    out = {}
    for name, p in W.adapter_params(model).items():
        axis = getattr(p, "partition_dim", -1)
        if t == 1 or not getattr(p, "tensor_model_parallel", False) or axis < 0:
            out[name] = p.detach().clone()
            continue
        parts = [torch.empty_like(p) for _ in range(t)]
        dist.all_gather(parts, p.detach().contiguous(), group=group)
        out[name] = torch.cat(parts, dim=axis)
    return out


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _dist_load(model, directory, part=None):
    """``dist_checkpointing.load`` of the model section, as Bridge lays it out (``{"model": ...}``)."""
    from megatron.core import dist_checkpointing

    sharded = model.sharded_state_dict()
    if part is not None:
        sharded = part(sharded)
    return dist_checkpointing.load({"model": sharded}, directory)["model"]


def _save(sharded: dict, directory: str) -> None:
    """``dist_checkpointing.save`` into a new directory (made by rank 0 first)."""
    import os

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(directory)
    dist.barrier()
    dist_checkpointing.save(sharded, directory)
    dist.barrier()


def dist_checkpoint_worker(rank: int, world_size: int, root: str) -> dict:
    from tests.harness.bridge_env import import_bridge_checkpointing
    from tests.harness.megatron_ckpt import enable_dist_checkpointing_cpu

    from regather.megatron.dense import checkpoint

    enable_dist_checkpointing_cpu()
    W.bridge_peft()
    bridge_ckpt = import_bridge_checkpointing()  # Bridge's own save filter and model section
    import megatron.bridge.peft.utils as bridge_utils

    batch = gpt_batch(W.SHAPE, W.MICRO_BATCH, seed=3)
    out: dict = {"rank": rank}
    peft = W.bridge_lora(regather=False)

    # Bridge, TP=2: a full checkpoint and an adapter-only one, saved the way Bridge saves
    bridge = W.bridge_model(regather=False)
    ref = _outputs(bridge, batch)
    ref_weights = _full_adapter_weights(bridge)
    model_section = bridge_ckpt._generate_model_state_dict([bridge])
    _save(model_section, f"{root}/bridge_full")
    adapter_section = bridge_ckpt.apply_peft_adapter_filter_to_state_dict(
        bridge_ckpt._generate_model_state_dict([bridge]), peft)
    out["bridge_adapter_ckpt_keys"] = sorted(adapter_section["model"])
    _save(adapter_section, f"{root}/bridge_adapters")

    # Bridge -> regather, TP=2: the full checkpoint strictly, the adapter-only one through
    # regather.megatron.dense.checkpoint and through Bridge's own loader, every strategy
    for strategy in STRATEGIES:
        model = W.regather_model(strategy, lora_B_init_method="normal", **CLASSIC)
        model.load_state_dict(_dist_load(model, f"{root}/bridge_full"), strict=True)
        full = _diff(_outputs(model, batch), ref, rank)
        model = W.regather_model(strategy, lora_B_init_method="normal", **CLASSIC)
        checkpoint.load_adapter_state_dict(model, _dist_load(model, f"{root}/bridge_adapters", checkpoint.adapter_only))
        part = _diff(_outputs(model, batch), ref, rank)
        model = W.regather_model(strategy, lora_B_init_method="normal", **CLASSIC)
        bridge_utils.load_peft_adapter_checkpoint([model], f"{root}/bridge_adapters", peft, fully_parallel_load=False)
        by_bridge = _diff(_outputs(model, batch), ref, rank)
        out[f"bridge->{strategy}"] = {"full": full, "adapter_part": part, "bridge_loader": by_bridge}

    # regather -> Bridge, TP=2: regather's full checkpoints (regather; lowrank: replicated LoRA-A,
    # written as rank shards) and an adapter-only one; Bridge loads the base into the unwrapped
    # model, then the adapters with its own loader (load_peft_adapter_checkpoint, strict=False)
    for strategy in ("regather", "lowrank"):
        mine = W.regather_model(strategy, lora_B_init_method="normal", adapter_seed=5, **CLASSIC)
        mine_out, mine_weights = _outputs(mine, batch), _full_adapter_weights(mine)
        _save({"model": mine.sharded_state_dict()}, f"{root}/{strategy}_full")
        sources = [f"{strategy}_full"]
        if strategy == "lowrank":
            _save({"model": checkpoint.adapter_only(mine.sharded_state_dict())}, f"{root}/{strategy}_adapters")
            sources.append(f"{strategy}_adapters")
        for source in sources:
            base = W.base_model()
            base.load_state_dict(_dist_load(base, f"{root}/{strategy}_full"), strict=True)
            target = W.bridge_lora(regather=True)([base], training=True)[0]
            bridge_utils.load_peft_adapter_checkpoint([target], f"{root}/{source}", peft, fully_parallel_load=False)
            out[f"{source}->bridge"] = _diff(mine_out, _outputs(target, batch), rank)

    out.update(_gated_dist_checkpoints(rank, root, batch, peft, bridge_ckpt, bridge_utils))

    # TP=1 (the two ranks become data-parallel replicas): both TP=2 checkpoints load; the
    # TP=1 models hold the full weights of the TP=2 ones and give their per-token losses
    model = W.regather_model("gather", tp=1, lora_B_init_method="normal", **CLASSIC)
    model.load_state_dict(_dist_load(model, f"{root}/bridge_full"), strict=True)
    tp1 = _outputs(model, batch)
    out["tp1: bridge->regather"] = {
        "weights_equal": _same_weights(_full_adapter_weights(model), ref_weights),
        "loss_diff": float((tp1["loss"] - ref["loss"]).abs().max())}
    base = W.base_model(tp=1)
    base.load_state_dict(_dist_load(base, f"{root}/lowrank_full"), strict=True)
    target = W.bridge_lora(regather=False)([base], training=True)[0]
    bridge_utils.load_peft_adapter_checkpoint([target], f"{root}/lowrank_adapters", peft, fully_parallel_load=False)
    tp1 = _outputs(target, batch)
    out["tp1: lowrank->bridge"] = {
        "weights_equal": _same_weights(_full_adapter_weights(target), mine_weights),
        "loss_diff": float((tp1["loss"] - mine_out["loss"]).abs().max())}
    return out


def _gated_dist_checkpoints(rank, root, batch, peft, bridge_ckpt, bridge_utils) -> dict:
    """A gated (SwiGLU) MLP, TP=2: linear_fc1's LoRA-B is ``[gate_i; up_i]`` on rank ``i`` and both
    implementations declare it through megatron's SwiGLU sharded factory (global: all gate rows,
    then all up rows). Bridge's full checkpoint into regather (strict); regather's into Bridge
    the Bridge way (base into the unwrapped model, then ``load_peft_adapter_checkpoint``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    fc1_b = "decoder.layers.0.mlp.linear_fc1.adapter.linear_out.weight"
    out = {}
    bridge = W.bridge_model(regather=False, config=W.GATED)
    ref = _outputs(bridge, batch)
    section = bridge_ckpt._generate_model_state_dict([bridge])
    out["gated: bridge fc1 LoRA-B is a factory"] = isinstance(bridge.sharded_state_dict()[fc1_b], ShardedTensorFactory)
    _save(section, f"{root}/gated_bridge_full")
    for strategy in ("regather", "lowrank"):
        model = W.regather_model(strategy, lora_B_init_method="normal", config=W.GATED, **CLASSIC)
        before = _diff(_outputs(model, batch), ref, rank)
        model.load_state_dict(_dist_load(model, f"{root}/gated_bridge_full"), strict=True)
        out[f"gated: bridge->{strategy}"] = {"before": before, "after": _diff(_outputs(model, batch), ref, rank)}

    mine = W.regather_model("regather", lora_B_init_method="normal", adapter_seed=5, config=W.GATED, **CLASSIC)
    out["gated: regather fc1 LoRA-B is a factory"] = isinstance(mine.sharded_state_dict()[fc1_b], ShardedTensorFactory)
    mine_out = _outputs(mine, batch)
    _save({"model": mine.sharded_state_dict()}, f"{root}/gated_regather_full")
    base = W.base_model(config=W.GATED)
    base.load_state_dict(_dist_load(base, f"{root}/gated_regather_full"), strict=True)
    target = W.bridge_lora(regather=True)([base], training=True)[0]
    before = _diff(mine_out, _outputs(target, batch), rank)
    bridge_utils.load_peft_adapter_checkpoint([target], f"{root}/gated_regather_full", peft, fully_parallel_load=False)
    out["gated: regather->bridge"] = {"before": before, "after": _diff(mine_out, _outputs(target, batch), rank)}
    return out
