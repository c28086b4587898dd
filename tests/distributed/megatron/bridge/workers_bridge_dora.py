"""Rank workers for test_bridge_dora.py: Megatron Bridge 0.6.2's own ``DoRA`` against ``regather.DoRA`` and
``regather.bridge.DoRA`` on the tiny GPT of workers_bridge (local spec, fp32) and on the TE model's GPT.

Bridge initialises its adapters (B drawn "normal", so LoRA-A's gradients are not zero; the magnitude from
Bridge's norm); every other model gets Bridge's adapter weights copied in by parameter name, magnitude
included. The float64 reference is ``regather.DoRA`` on the same model in float64 with the same weights.
"""

from __future__ import annotations

import torch
import workers_bridge as W

from regather.tools.cpu.models import gpt_batch

COLUMN = ["linear_qkv", "linear_fc1"]
ALL = list(W.TARGETS)
ROW = ("linear_proj", "linear_fc2")
ROW_MAGNITUDES = tuple(f"{r}.adapter.weight_magnitude" for r in ROW)


def gpt(tp=W.TP, sp=True, dtype=torch.float32):
    """The tiny GPT of workers_bridge (local spec) at ``tp`` with sequence parallelism ``sp``."""
    from regather.tools.cpu.models import build_gpt

    return build_gpt(W.SHAPE, tp, sequence_parallel=sp and tp > 1, dtype=dtype, seed=W.SEED)


def bridge_dora_cls():
    W.bridge_peft()
    from megatron.bridge.peft.dora import DoRA

    return DoRA


def _kw(targets):
    return dict(target_modules=list(targets), dim=W.DIM, alpha=W.ALPHA, lora_B_init_method="normal")


def bridge_model(targets, tp=W.TP, sp=True, base=None):
    model = base if base is not None else gpt(tp, sp)
    torch.manual_seed(W.SEED + 7)
    return bridge_dora_cls()(**_kw(targets))([model], training=True)[0]


def regather_model(targets, tp=W.TP, sp=True, dtype=torch.float32, base=None, **kw):
    from regather import DoRA

    model = base if base is not None else gpt(tp, sp, dtype)
    torch.manual_seed(W.SEED + 11)
    return DoRA(**_kw(targets), **kw)(model, training=True)


def rb_model(targets, tp=W.TP, sp=True, base=None, **kw):
    import regather.bridge as rb

    model = base if base is not None else gpt(tp, sp)
    peft = rb.DoRA(**_kw(targets), **kw)
    chunks = peft([model], training=True)
    peft.set_params_to_save(chunks)
    return chunks[0], peft


def copy_all(src, dst) -> None:
    """Every adapter weight of ``src`` into ``dst`` (same names: LoRA-A, LoRA-B, ``weight_magnitude``)."""
    W.copy_adapters(src, dst)


def result(model, batch) -> dict:
    res = W.measure(model, batch)
    res["input_grad"] = W.input_grad(model, batch)
    return res


def _whole_row_magnitudes(*models) -> None:
    """Set every row-parallel adapter's magnitude to the same rank-independent value in each model (Bridge
    starts each rank at its own slice norm)."""
    for model in models:
        for name, p in model.named_parameters():
            if name.endswith("weight_magnitude") and any(f".{r}." in name for r in ROW):
                with torch.no_grad():
                    g = torch.Generator().manual_seed(len(name))
                    p.copy_(1.0 + torch.rand(p.shape, generator=g, dtype=torch.float64).to(p.dtype))


def parity_worker(rank: int, world_size: int) -> dict:
    """Bridge's DoRA vs regather's, where Bridge is right (column bases at TP2 ± SP, every base at TP1), and
    the row bases at TP2 + SP (per-slice norm option; the default whole-row norm against float64)."""
    bridge_dora_cls()  # Bridge's PEFT under the shims (tests.harness.bridge_env) before regather.bridge

    batch = gpt_batch(W.SHAPE, W.MICRO_BATCH, seed=3)
    out: dict = {"rank": rank}
    for layout, (tp, sp, targets) in {"tp2sp-column": (2, True, COLUMN), "tp2-column": (2, False, COLUMN),
                                      "tp1-all": (1, False, ALL)}.items():
        reference = bridge_model(targets, tp, sp)
        models = {"bridge": reference, "classic": regather_model(targets, tp, sp),
                  "regather": regather_model(targets, tp, sp, sequence_parallel_input_strategy="regather",
                                             recompute_adapter_inputs=True, recompute_dora_output=True),
                  "rb": rb_model(targets, tp, sp)[0]}
        for model in models.values():
            if model is not reference:
                copy_all(reference, model)
        fp64 = regather_model(targets, tp, sp, dtype=torch.float64)
        copy_all(reference, fp64)
        out[layout] = {name: result(m, batch) for name, m in models.items()}
        out[layout]["fp64"] = result(fp64, batch)
        out[layout]["types"] = sorted({type(m).__module__ + "." + type(m).__name__
                                       for n, m in models["rb"].named_modules() if n.endswith(tuple(targets))})

    # row bases at TP2 + SP: Bridge takes each rank's slice norm and never sums the row magnitude's gradient
    reference = bridge_model(ALL)
    sliced = regather_model(ALL, dora_norm="per_rank_slice")
    copy_all(reference, sliced)
    out["tp2sp-all-slice"] = {"bridge": result(reference, batch), "slice": result(sliced, batch)}
    _whole_row_magnitudes(reference)
    models = {"bridge": reference, "classic": regather_model(ALL),
              "regather": regather_model(ALL, sequence_parallel_input_strategy="regather", recompute_adapter_inputs=True,
                                         recompute_dora_output=True),
              "fp64": regather_model(ALL, dtype=torch.float64)}
    for model in models.values():
        if model is not reference:
            copy_all(reference, model)
    out["tp2sp-all"] = {name: result(m, batch) for name, m in models.items()}
    out["tp2sp-all"]["decisions"] = W.decisions(models["regather"])
    return out


def te_worker(rank: int, world_size: int) -> dict:
    """Bridge's DoRA and regather's on the TE model's GPT (column bases, TP2 + SP), each TE behaviour: the
    decoder input's gradient against float64, and the flags each asks TE for."""
    bridge_dora_cls()
    from tests.harness.bridge_env import bridge_sees_te_model
    from tests.harness.te_model import BEHAVIOURS, build_te_gpt, te_behaviour
    from workers_bridge_te import flags_seen

    batch = gpt_batch(W.SHAPE, W.MICRO_BATCH, seed=3)
    out: dict = {"rank": rank}
    base = lambda dtype=torch.float32: build_te_gpt(W.SHAPE, W.TP, sequence_parallel=True, dtype=dtype,
                                                    seed=W.SEED)
    with te_behaviour("te<=2.3"), bridge_sees_te_model(BEHAVIOURS["te<=2.3"].version):  # TP1: all four linears
        reference = bridge_model(ALL, base=build_te_gpt(W.SHAPE, 1, sequence_parallel=False, seed=W.SEED))
        mine = regather_model(ALL, base=build_te_gpt(W.SHAPE, 1, sequence_parallel=False, seed=W.SEED))
        copy_all(reference, mine)
        out["tp1"] = {"bridge": result(reference, batch), "classic": result(mine, batch)}
    for name, behaviour in BEHAVIOURS.items():
        with te_behaviour(behaviour), bridge_sees_te_model(behaviour.version):
            reference = bridge_model(COLUMN, base=base())
            models = {"bridge": reference, "classic": regather_model(COLUMN, base=base()),
                      "rb/regather": rb_model(COLUMN, base=base(), sequence_parallel_input_strategy="regather",
                                              recompute_adapter_inputs=True, recompute_dora_output=True)[0],
                      "rb/lowrank": rb_model(COLUMN, base=base(), sequence_parallel_input_strategy="lowrank",
                                             recompute_dora_output=True)[0]}
            for model in models.values():
                if model is not reference:
                    copy_all(reference, model)
            fp64 = regather_model(COLUMN, base=base(torch.float64))
            copy_all(reference, fp64)
            seen = {v: flags_seen(m) for v, m in models.items()}
            out[name] = {"results": {v: result(m, batch) for v, m in models.items()}, "fp64": result(fp64, batch),
                         "flags": {v: sorted(set(f)) for v, f in seen.items()}}
    return out


# -- checkpoints ---------------------------------------------------------------------------------------


def ckpt_worker(rank: int, world_size: int, root: str) -> dict:
    """Checkpoints both ways, TP2 + SP, DoRA on all four linears (the per-slice norm, so the functions are
    Bridge's; the whole-row model loads the same entries): state dicts (strict into regather, the Bridge way
    back) and megatron ``dist_checkpointing`` (Bridge's own save filter and loader), and a TP2 checkpoint into
    TP1 (column bases: the magnitude resharded from its two halves)."""
    import workers_bridge_ckpt as C
    from tests.harness.bridge_env import import_bridge_checkpointing
    from tests.harness.megatron_ckpt import enable_dist_checkpointing_cpu

    from regather.megatron.dense import checkpoint

    enable_dist_checkpointing_cpu()
    peft_cls = bridge_dora_cls()

    def diff(a, b, rank):
        """workers_bridge_ckpt._diff without the row magnitudes' gradients (Bridge's are each rank's part,
        regather's their TP sum: test_row_bases_at_tp2_per_slice_option_is_bridges_forward)."""
        keep = lambda r: {**r, "grads": {n: g for n, g in r["grads"].items() if not n.endswith(ROW_MAGNITUDES)}}
        return C._diff(keep(a), keep(b), rank)

    bridge_ckpt = import_bridge_checkpointing()
    import megatron.bridge.peft.utils as bridge_utils

    batch = gpt_batch(W.SHAPE, W.MICRO_BATCH, seed=3)
    peft = peft_cls(**_kw(ALL))
    out: dict = {"rank": rank}

    # state dicts: Bridge -> regather (strict, every strategy), regather writes Bridge's back
    bridge = bridge_model(ALL)
    bsd = bridge.state_dict()
    ref = C._outputs(bridge, batch)
    out["bridge_magnitude_keys"] = sorted(k for k in bsd if k.endswith("weight_magnitude"))
    out["bridge_magnitude_shapes"] = {k: tuple(bsd[k].shape) for k in out["bridge_magnitude_keys"]}
    for strategy in ("gather", "regather", "lowrank"):
        model = regather_model(ALL, dora_norm="per_rank_slice", sequence_parallel_input_strategy=strategy)
        before = diff(C._outputs(model, batch), ref, rank)
        model.load_state_dict(bsd, strict=True)
        out[f"sd bridge->{strategy}"] = {"before": before, "after": diff(C._outputs(model, batch), ref, rank),
                                         "writes_bridge_state_dict": C._same_state(model.state_dict(), bsd)}
    whole = regather_model(ALL)
    out["sd bridge->whole-row"] = C._load_report(whole.load_state_dict(bsd, strict=True))

    # regather -> Bridge, the Bridge way: base into the unwrapped model, adapters through its filter
    mine = regather_model(ALL, dora_norm="per_rank_slice")  # the gather path: Bridge's function bit for bit
    with torch.no_grad():  # other adapter weights than Bridge's init: the load must carry them
        for name, p in mine.named_parameters():
            if ".adapter." in name:
                p.mul_(1.25)
    _whole_row_magnitudes(mine)  # the per-slice init differs per rank; a replicated entry is saved from one
    mine_out, msd = C._outputs(mine, batch), mine.state_dict()
    base = gpt()
    out["sd base->unwrapped"] = C._load_report(base.load_state_dict(checkpoint.base_only(msd), strict=True))
    target = bridge_model(ALL, base=base)
    filtered = {k: v for k, v in msd.items() if peft.adapter_key_filter(k) and "_extra_state" not in k}
    report = C._load_report(target.load_state_dict(filtered, strict=False))
    out["sd regather->bridge"] = {**report, "diff": diff(C._outputs(target, batch), mine_out, rank),
                                  "magnitudes": sorted(k for k in filtered if k.endswith("weight_magnitude"))}

    # dist_checkpointing. Bridge's own round trip first: a row magnitude is declared replicated, so one rank's
    # copy is saved; Bridge starts each rank at its own slice norm, so its rank 1 loads rank 0's values
    C._save(bridge_ckpt.apply_peft_adapter_filter_to_state_dict(bridge_ckpt._generate_model_state_dict([bridge]),
                                                                peft), f"{root}/bridge_init")
    again = bridge_model(ALL)
    bridge_utils.load_peft_adapter_checkpoint([again], f"{root}/bridge_init", peft, fully_parallel_load=False)
    out["dist bridge->bridge"] = diff(C._outputs(again, batch), ref, rank)
    row_m = lambda m: {n: p.detach().clone() for n, p in m.named_parameters() if n.endswith(ROW_MAGNITUDES)}
    out["bridge row magnitudes"] = {"saved": row_m(bridge), "loaded": row_m(again)}
    # then with rank-independent row magnitudes: Bridge saves (full, adapter-only), regather loads; regather
    # saves, Bridge loads
    _whole_row_magnitudes(bridge)
    ref = C._outputs(bridge, batch)
    C._save(bridge_ckpt._generate_model_state_dict([bridge]), f"{root}/bridge_full")
    C._save(bridge_ckpt.apply_peft_adapter_filter_to_state_dict(bridge_ckpt._generate_model_state_dict([bridge]),
                                                                peft), f"{root}/bridge_adapters")
    for strategy in ("gather", "regather", "lowrank"):
        model = regather_model(ALL, dora_norm="per_rank_slice", sequence_parallel_input_strategy=strategy)
        model.load_state_dict(C._dist_load(model, f"{root}/bridge_full"), strict=True)
        full = diff(C._outputs(model, batch), ref, rank)
        model = regather_model(ALL, dora_norm="per_rank_slice", sequence_parallel_input_strategy=strategy)
        bridge_utils.load_peft_adapter_checkpoint([model], f"{root}/bridge_adapters", peft, fully_parallel_load=False)
        out[f"dist bridge->{strategy}"] = {"full": full, "bridge_loader": diff(C._outputs(model, batch), ref, rank)}
    C._save({"model": mine.sharded_state_dict()}, f"{root}/regather_full")
    base = gpt()
    base.load_state_dict(C._dist_load(base, f"{root}/regather_full"), strict=True)
    target = bridge_model(ALL, base=base)
    bridge_utils.load_peft_adapter_checkpoint([target], f"{root}/regather_full", peft, fully_parallel_load=False)
    out["dist regather->bridge"] = diff(mine_out, C._outputs(target, batch), rank)

    # TP2 -> TP1 (column bases: their magnitude is TP-sharded)
    bridge = bridge_model(COLUMN)
    tp2 = C._outputs(bridge, batch)
    C._save(bridge_ckpt._generate_model_state_dict([bridge]), f"{root}/bridge_column")
    model = regather_model(COLUMN, tp=1, sp=False)
    model.load_state_dict(C._dist_load(model, f"{root}/bridge_column"), strict=True)
    out["dist tp2->tp1 loss diff"] = float((C._outputs(model, batch)["loss"] - tp2["loss"]).abs().max())
    return out
