"""Rank bodies for test_dist_checkpoint.py: megatron dist_checkpointing of plain and LoRA GPTs.

Three spawns share one checkpoint root:

- :func:`save_side` (2 ranks, TP=2) writes every checkpoint with
  ``dist_checkpointing.save(model.sharded_state_dict(), dir)``, records what the
  saving models compute and hold, reloads at TP=2, and runs the TP=2-only cases
  (sharded metadata, attention-only per-rank halves, plain ``state_dict``).
- :func:`load_side` (1 rank at TP=1, 4 ranks at TP=4) reloads the same
  checkpoints with other TP sizes.

Besides the plain-GELU GPT, a gated (SwiGLU) one (``GATED``) is saved and reloaded
by both spawns: its ``linear_fc1`` LoRA-B holds ``[gate_i; up_i]`` per rank.

Every loading model is built from *other* seeds than the saving one, so equal
outputs prove the load. Each case reports the ranks' tracebacks instead of its
results when it fails, so one missing feature fails only its tests (see
:func:`_case`). Values are compared in the test process.
"""

from __future__ import annotations

import datetime
import os
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

from regather import LoRA, adapters, set_strategy
from regather.core.comm import all_gather_dim
from regather.tools.cpu.models import TinyGPT, build_gpt, gpt_batch, init_model_parallel

SHAPE = TinyGPT(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                vocab_size=256, seq_length=32)
RANK_R = 16
STRATEGIES = ("gather", "regather", "lowrank")
ALL_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
ATTN_TARGETS = ["linear_qkv", "linear_proj"]
SAVE_SEEDS = (1234, 99)   # (base, LoRA) seeds of the saving models
LOAD_SEEDS = (4321, 7)    # of every loading model: different weights until the load
# SwiGLU MLP, as Qwen / Llama: linear_fc1 writes [gate; up] (2 * ffn outputs) per rank
GATED = {"gated_linear_unit": True, "activation_func": F.silu}
GATED_STRATEGIES = ("regather", "lowrank")
# each strategy saves and each loads, across (same-strategy pairs are covered by the GELU GPT)
GATED_PAIRS = ("regather->lowrank", "lowrank->regather")
FC1 = "mlp.linear_fc1"


AGREE_TIMEOUT_S = 30.0  # below the launcher's 60 s stall detection
_AGREE: dict = {}  # the gloo group the ranks agree on case outcomes over (see _case)


# -- models ------------------------------------------------------------------------------------


def _setup(tp: int) -> None:
    from tests.harness.megatron_ckpt import enable_dist_checkpointing_cpu

    enable_dist_checkpointing_cpu()
    _AGREE["group"] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=AGREE_TIMEOUT_S))
    init_model_parallel(tp)


def plain_gpt(tp: int, seed: int, **config):
    return build_gpt(SHAPE, tp, seed=seed, init_parallel=False, **config)


def lora_gpt(tp: int, strategy: str, seeds=SAVE_SEEDS, targets=ALL_TARGETS, b_init="normal", **config):
    model = plain_gpt(tp, seeds[0], **config)
    torch.manual_seed(seeds[1])
    return LoRA(dim=RANK_R, alpha=32, target_modules=list(targets), lora_B_init_method=b_init,
                sequence_parallel_input_strategy=strategy)(model, training=True)


def logits(model) -> torch.Tensor:
    """Full-vocabulary logits ``[b, s, V]`` of a fixed batch. Training mode with autograd on,
    so every adapter runs its own strategy's forward (eval / no_grad would all fall back to the
    gather path); dropout is 0."""
    from megatron.core import parallel_state

    inputs, _, position_ids, mask = gpt_batch(SHAPE, 2, seed=5)
    model.train()
    out = model(inputs, position_ids, mask).detach()
    return all_gather_dim(out, parallel_state.get_tensor_model_parallel_group(), -1)


def full_adapters(model) -> dict:
    """Every adapter's TP-gathered ``(A [r, h_in], B [o, r])``, by wrapped-linear path."""
    out = {}
    for path, a in adapters(model).items():
        A = a.linear_in.weight.detach()
        if not a.replicated_a:
            A = all_gather_dim(A, a.tp_group, 0 if a.column_parallel else 1)
        out[path] = (A.clone(), all_gather_dim(a.linear_out.weight.detach(), a.tp_group, 0).clone())
    return out


def fc1_b_shards(model) -> dict:
    """Every ``linear_fc1`` adapter's LoRA-B as its per-rank shards ``[B_0, ..., B_{t-1}]`` (each
    ``[gate_i; up_i]`` in a gated MLP), by wrapped-linear path; the test composes the layout."""
    out = {}
    for path, a in adapters(model).items():
        if path.endswith(FC1):
            B = a.linear_out.weight.detach().contiguous()
            parts = [torch.empty_like(B) for _ in range(a.tp_size)]
            dist.all_gather(parts, B, group=a.tp_group)
            out[path] = parts
    return out


def local_weights(model, names=ATTN_TARGETS) -> dict:
    """This rank's own tensors of the wrapped linears in ``names``: base weight, LoRA-A rows as
    written to a checkpoint (a replicated LoRA-A is sliced to this rank's rows), LoRA-B."""
    out = {}
    for path, a in adapters(model).items():
        if path.rsplit(".", 1)[-1] not in names:
            continue
        base = model.get_submodule(path).to_wrap.weight.detach().clone()
        A = a.linear_in.weight.detach()
        if a.replicated_a:  # the rows of a sharded LoRA-A on this rank
            A = A.chunk(a.tp_size, 0)[a.tp_rank]
        out[path] = {"base": base, "A": A.clone(), "B": a.linear_out.weight.detach().clone()}
    return out


# -- checkpoints -------------------------------------------------------------------------------

def save(model, path: str) -> None:
    from megatron.core import dist_checkpointing

    os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), path)


def load(model, path: str) -> None:
    """The user's round trip: load into the model's own sharded state dict, then strict
    ``load_state_dict``."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(model.sharded_state_dict(), path)
    model.load_state_dict(loaded)


def load_pretrained_base(model, path: str) -> None:
    """A plain (no-LoRA) checkpoint into a LoRA model through regather.megatron.dense.checkpoint."""
    from megatron.core import dist_checkpointing

    from regather.megatron.dense import checkpoint

    loaded = dist_checkpointing.load(checkpoint.base_only(model.sharded_state_dict()), path)
    checkpoint.load_base_state_dict(model, loaded)


def sharded_meta(model) -> dict:
    """Per entry of ``model.sharded_state_dict()`` (by its dict key): the checkpoint key and, for
    a ShardedTensor, ``global_shape``, ``global_offset``, ``axis_fragmentations``,
    ``local_shape`` (the shard's own shape, without the prepended layer axis),
    ``prepend_axis_num`` and ``replica_id`` (as a tuple); a ShardedTensorFactory gives, as
    ``parts``, the entries of the ShardedTensors it builds (what is written); other entries give
    their type name."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    def describe(v) -> dict:
        entry = {"key": getattr(v, "key", None), "type": type(v).__name__}
        if isinstance(v, ShardedTensor):
            rid = v.replica_id if isinstance(v.replica_id, tuple) else (v.replica_id,)
            entry.update(global_shape=tuple(v.global_shape), global_offset=tuple(v.global_offset),
                         axis_fragmentations=tuple(v.axis_fragmentations),
                         local_shape=tuple(v.local_shape), prepend_axis_num=v.prepend_axis_num,
                         replica_id=tuple(rid))
        elif isinstance(v, ShardedTensorFactory):
            built = v.build()
            entry["parts"] = [describe(p) for p in (built if isinstance(built, (list, tuple)) else [built])]
        return entry

    return {name: describe(v) for name, v in model.sharded_state_dict().items()}


def _case(res: dict, name: str, fn) -> None:
    """Run one case; on failure record the tracebacks (of every rank) instead of its results.

    The ranks then agree on the outcome over their own gloo group before the next case. A
    failure on some ranks only can leave the others inside a collective of the case; the
    agreement then times out (``AGREE_TIMEOUT_S``) and this rank raises with its traceback,
    which fails the spawn at once instead of desynchronising the next cases."""
    try:
        res[name] = fn()
        err = None
    except Exception:
        err = traceback.format_exc()
    errors = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(errors, err, group=_AGREE["group"])
    except Exception as exc:
        raise RuntimeError(f"case {name!r}: the ranks did not meet after it ({exc}); this rank's "
                           f"error: {err or 'none (another rank failed)'}") from exc
    failed = {r: e for r, e in enumerate(errors) if e is not None}
    if failed:
        res[name] = {"error": "\n".join(f"rank {r}: {e}" for r, e in failed.items())}


def _on_rank0(rank: int, value):
    return value if rank == 0 else None


# -- spawns ------------------------------------------------------------------------------------

def save_side(rank: int, world: int, root: str) -> dict:
    """TP=2: write the checkpoints, record the savers, reload at TP=2, TP=2-only cases."""
    import megatron.core

    tp = world
    _setup(tp)
    res: dict = {"megatron": megatron.core.__version__}

    def plain():
        m = plain_gpt(tp, SAVE_SEEDS[0])
        ref = logits(m)
        save(m, os.path.join(root, "plain"))
        back = plain_gpt(tp, LOAD_SEEDS[0])
        before = logits(back)
        load(back, os.path.join(root, "plain"))
        return _on_rank0(rank, {"saved": ref, "loaded": logits(back), "before_load": before})

    _case(res, "plain", plain)

    def lora_saves():
        out = {}
        for s in STRATEGIES:
            m = lora_gpt(tp, s)
            save(m, os.path.join(root, f"lora-{s}"))
            refs = {}
            for s_eval in STRATEGIES:  # the saver under each strategy (layout switches are exact)
                set_strategy(m, s_eval)
                refs[s_eval] = logits(m)
            set_strategy(m, s)
            out[s] = _on_rank0(rank, {"logits": refs, "adapters": full_adapters(m)})
        return out

    _case(res, "lora_saved", lora_saves)

    def lora_loads():
        out = {}
        for s_saved in STRATEGIES:
            for s_load in STRATEGIES:
                m = lora_gpt(tp, s_load, LOAD_SEEDS)
                load(m, os.path.join(root, f"lora-{s_saved}"))
                out[f"{s_saved}->{s_load}"] = _on_rank0(rank, {"logits": logits(m),
                                                               "adapters": full_adapters(m)})
        return out

    _case(res, "lora_loaded", lora_loads)

    def metadata():
        plain_meta = sharded_meta(plain_gpt(tp, SAVE_SEEDS[0]))
        return {"plain": plain_meta, **{s: sharded_meta(lora_gpt(tp, s)) for s in STRATEGIES}}

    _case(res, "metadata", metadata)

    def attention_only():
        out = {}
        for s in ("regather", "lowrank"):
            m = lora_gpt(tp, s, targets=ATTN_TARGETS)
            d = os.path.join(root, f"attn-{s}")
            save(m, d)
            back = lora_gpt(tp, s, LOAD_SEEDS, targets=ATTN_TARGETS)
            before = local_weights(back)
            load(back, d)
            out[s] = {"saved": local_weights(m), "before_load": before, "loaded": local_weights(back)}
        return out

    _case(res, "attention_only", attention_only)

    def plain_state_dict():
        from regather.megatron.dense import checkpoint

        out = {"plain_keys": sorted(plain_gpt(tp, SAVE_SEEDS[0]).state_dict())}
        for s_src in STRATEGIES:
            src = lora_gpt(tp, s_src)
            sd = src.state_dict()
            out[f"keys:{s_src}"] = sorted(sd)
            out[f"base_keys:{s_src}"] = sorted(k for k in sd if not checkpoint.is_adapter_key(k))
            for s_dst in STRATEGIES:
                dst = lora_gpt(tp, s_dst, LOAD_SEEDS)
                dst.load_state_dict(sd, strict=True)
                set_strategy(src, s_dst)
                ref = logits(src)
                set_strategy(src, s_src)
                out[f"{s_src}->{s_dst}"] = _on_rank0(rank, {
                    "ref": ref, "logits": logits(dst),
                    "src_adapters": full_adapters(src), "adapters": full_adapters(dst)})
        return out

    _case(res, "plain_state_dict", plain_state_dict)

    _case(res, "pretrained", lambda: _pretrained_into_lora(rank, tp, root))

    def gated_saves():
        out = {}
        for s in GATED_STRATEGIES:
            m = lora_gpt(tp, s, **GATED)
            meta = {k: v for k, v in sharded_meta(m).items() if f".{FC1}." in k}  # every rank's
            save(m, os.path.join(root, f"gated-{s}"))
            refs = {}
            for s_eval in GATED_STRATEGIES:
                set_strategy(m, s_eval)
                refs[s_eval] = logits(m)
            set_strategy(m, s)
            out[s] = {"meta": meta, **(_on_rank0(rank, {"logits": refs, "adapters": full_adapters(m),
                                                        "fc1_b": fc1_b_shards(m)}) or {})}
        return out

    _case(res, "gated_saved", gated_saves)
    _case(res, "gated_loaded", lambda: _gated_loads(rank, tp, root))
    return res


def _gated_loads(rank: int, tp: int, root: str) -> dict:
    """The gated TP=2 checkpoints into gated LoRA models at this TP size (GATED_PAIRS); rank 0's
    results, and fc1's sharded entries."""
    out = {}
    for pair in GATED_PAIRS:
        s_saved, s_load = pair.split("->")
        m = lora_gpt(tp, s_load, LOAD_SEEDS, **GATED)
        load(m, os.path.join(root, f"gated-{s_saved}"))
        fc1_b = fc1_b_shards(m)
        out[pair] = _on_rank0(rank, {"logits": logits(m), "adapters": full_adapters(m), "fc1_b": fc1_b})
    out["meta"] = _on_rank0(rank, {k: v for k, v in sharded_meta(m).items() if f".{FC1}." in k})
    return out


def _pretrained_into_lora(rank: int, tp: int, root: str) -> dict:
    """The plain checkpoint into LoRA-wrapped models (LoRA-B zero), through regather.megatron.dense.checkpoint;
    plus the strictness of load_base_state_dict (a missing and an unexpected base key)."""
    from megatron.core import dist_checkpointing

    from regather.megatron.dense import checkpoint

    d = os.path.join(root, "plain")
    plain = plain_gpt(tp, LOAD_SEEDS[0])
    load(plain, d)  # the unwrapped model at this TP size
    out = {"plain": _on_rank0(rank, logits(plain))}
    for s in STRATEGIES:
        m = lora_gpt(tp, s, LOAD_SEEDS, b_init="zero")
        adapters_before = full_adapters(m)
        load_pretrained_base(m, d)
        out[s] = _on_rank0(rank, {"logits": logits(m), "adapters_before": adapters_before,
                                  "adapters": full_adapters(m)})
    m = lora_gpt(tp, "regather", LOAD_SEEDS, b_init="zero")
    loaded = dist_checkpointing.load(checkpoint.base_only(m.sharded_state_dict()), d)
    gone = next(k for k in sorted(loaded) if k.endswith("linear_qkv.weight"))
    errors = {}
    for name, sd in (("missing", {k: v for k, v in loaded.items() if k != gone}),
                     ("unexpected", {**loaded, "decoder.layers.0.bogus.weight": torch.zeros(1)})):
        try:
            checkpoint.load_base_state_dict(m, sd)
            errors[name] = None
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    out.update(errors=errors, removed_key=gone, loaded_keys=sorted(loaded))
    return out


def load_side(rank: int, world: int, root: str) -> dict:
    """TP=world: reload every checkpoint written by :func:`save_side` (resharding)."""
    import megatron.core

    tp = world
    _setup(tp)
    res: dict = {"megatron": megatron.core.__version__}

    def plain():
        m = plain_gpt(tp, LOAD_SEEDS[0])
        load(m, os.path.join(root, "plain"))
        return _on_rank0(rank, logits(m))

    _case(res, "plain", plain)

    def lora_loads():
        out = {}
        for s_saved in STRATEGIES:
            for s_load in STRATEGIES:
                m = lora_gpt(tp, s_load, LOAD_SEEDS)
                load(m, os.path.join(root, f"lora-{s_saved}"))
                out[f"{s_saved}->{s_load}"] = _on_rank0(rank, {"logits": logits(m),
                                                               "adapters": full_adapters(m)})
        return out

    _case(res, "lora_loaded", lora_loads)
    _case(res, "pretrained", lambda: _pretrained_into_lora(rank, tp, root))
    _case(res, "gated_loaded", lambda: _gated_loads(rank, tp, root))
    return res
