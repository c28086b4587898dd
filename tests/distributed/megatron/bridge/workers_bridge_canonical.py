"""Rank worker: ``regather.CanonicalLoRA`` against Megatron Bridge 0.6.2's
``megatron.bridge.peft.canonical_lora.CanonicalLoRA`` on one tiny megatron-core GPT with GQA
(4 heads, 2 query groups), a gated SwiGLU MLP and no biases (local spec, SP on, fp32).

Bridge initialises its adapters itself; every regather model gets Bridge's adapter weights through
a state dict (``workers_bridge.copy_adapters``: the parameter names must be equal), so all models
compute the same function. One spawn (:func:`canonical_worker`) runs three phases: TP=2, TP=1
(the two ranks become data-parallel replicas), TP=2 again (a checkpoint written at TP=1 loaded
at TP=2). The test process compares.
"""

from __future__ import annotations

import importlib
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
import workers_bridge as W
import workers_bridge_ckpt as C

from regather.tools.cpu.models import TinyGPT, gpt_batch

SHAPE = TinyGPT(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=128, vocab_size=256, seq_length=32)
# s*b = 31 tokens: not divisible by TP=2 (possible without sequence parallelism only)
ODD = TinyGPT(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
              ffn_hidden_size=128, vocab_size=256, seq_length=31)
GATED = {"gated_linear_unit": True, "activation_func": F.silu, "add_bias_linear": False}
NOT_GATED = {"add_bias_linear": False}
TP, MICRO_BATCH, DIM, ALPHA = 2, 2, 8, 16
BASE_SEED, BRIDGE_SEED, MINE_SEED = 1234, 1241, 5
SUBSETS = {"q+v": ["linear_q", "linear_v"], "fc1_up": ["linear_fc1_up"]}
# name -> (sequence_parallel_input_strategy, early_regather)
VARIANTS = {"gather": ("gather", True), "early": ("regather", True), "plain": ("regather", False),
            "lowrank": ("lowrank", True)}
GATE_UP_B = ("mlp.linear_fc1.adapter.adapter_gate.linear_out.weight",
             "mlp.linear_fc1.adapter.adapter_up.linear_out.weight")

_STATE = {"tp": None}


def parallel(tp: int) -> None:
    from regather.tools.cpu.models import init_model_parallel

    if _STATE["tp"] != tp:
        init_model_parallel(tp)
        _STATE["tp"] = tp


def bridge_canonical_cls():
    W.bridge_peft()
    return importlib.import_module("megatron.bridge.peft.canonical_lora").CanonicalLoRA


def bridge_adapter_cls():
    W.bridge_peft()
    return importlib.import_module("megatron.bridge.peft.utils").ParallelLinearAdapter


def base_model(tp: int = TP, config: dict = GATED, sp: bool = True, shape: TinyGPT = SHAPE,
               dtype: torch.dtype = torch.float32):
    from regather.tools.cpu.models import build_gpt

    parallel(tp)  # megatron draws CPU-initialised weights in fp32 whatever params_dtype: fp64 is their cast
    return build_gpt(shape, tp, sequence_parallel=sp, dtype=dtype, seed=BASE_SEED, init_parallel=False,
                     **config)


def bridge_peft(targets=None):
    kw = {} if targets is None else {"target_modules": list(targets)}
    return bridge_canonical_cls()(dim=DIM, alpha=ALPHA, lora_B_init_method="normal", **kw)


def bridge_model(tp: int = TP, targets=None, config: dict = GATED, sp: bool = True, shape: TinyGPT = SHAPE,
                 seed: int = BRIDGE_SEED):
    model = base_model(tp, config, sp, shape)
    torch.manual_seed(seed)  # Bridge's adapter init draws from the default generator
    return bridge_peft(targets)([model], training=True)[0]


def regather_model(variant: str = "early", tp: int = TP, targets=None, config: dict = GATED, sp: bool = True,
                   shape: TinyGPT = SHAPE, seed: int = MINE_SEED, dtype: torch.dtype = torch.float32,
                   lean_transients: bool | None = None):
    from regather import CanonicalLoRA

    model = base_model(tp, config, sp, shape, dtype)
    strategy, early = VARIANTS[variant]
    torch.manual_seed(seed)  # regather's own init (other than Bridge's): loads must replace it
    kw = {} if targets is None else {"target_modules": list(targets)}
    return CanonicalLoRA(dim=DIM, alpha=ALPHA, lora_B_init_method="normal", sequence_parallel_input_strategy=strategy,
                         early_regather=early, lean_transients=lean_transients, **kw)(model, training=True)


def tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def full(t: torch.Tensor, dim: int) -> torch.Tensor:
    from regather.core.comm import all_gather_dim

    return all_gather_dim(t.detach().contiguous(), tp_group(), dim).clone()


def full_weights(model) -> dict:
    """Every adapter weight as the full tensor (gathered over TP on its partition axis)."""
    out = {}
    for name, p in W.adapter_params(model).items():
        if getattr(p, "tensor_model_parallel", False) and getattr(p, "partition_dim", -1) >= 0 \
                and dist.get_world_size(tp_group()) > 1:
            out[name] = full(p, p.partition_dim)
        else:
            out[name] = p.detach().clone()
    return out


def load_full(model, weights: dict) -> None:
    """Full adapter weights into a TP=1 model (local = full)."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and not [k for k in missing if ".adapter." in k and "_extra_state" not in k], \
        (missing, unexpected)


def logits(model, data=None) -> torch.Tensor:
    """Full-vocabulary logits ``[b, s, V]``; training mode with autograd on (every adapter runs
    its own strategy)."""
    inputs, _, position_ids, mask = data or gpt_batch(SHAPE, MICRO_BATCH, seed=3)
    return full(model(inputs, position_ids, mask).detach(), -1)


def run(model, data=None) -> dict:
    data = data or gpt_batch(SHAPE, MICRO_BATCH, seed=3)
    res = W.measure(model, data)
    res["input_grad"] = W.input_grad(model, data)
    res["x_saved"] = saved_inputs(model, data)
    return res


def saved_inputs(model, data) -> dict:
    """One more forward, recording each storage autograd saves inside an adapter (Bridge's or
    regather's ``ParallelLinearAdapter``) with the adapter's path: the number of ``x_full``
    ``[s, b, h]`` and ``x_local`` ``[s/t, b, h]`` storages per wrapped linear (a storage saved by
    several adapters counts once, under the first)."""
    from regather.megatron.dense.adapter import ParallelLinearAdapter

    kinds = (ParallelLinearAdapter, bridge_adapter_cls())
    current, seen = [None], {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    handles = []
    for path, m in model.named_modules():
        if isinstance(m, kinds):
            handles.append(m.register_forward_pre_hook(lambda mod, args, _p=path: current.__setitem__(0, _p)))
            handles.append(m.register_forward_hook(lambda mod, args, out: current.__setitem__(0, None)))

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if current[0] is not None and key not in params and key not in seen:
            seen[key] = (current[0], tuple(t.shape))
        return t

    inputs, _, position_ids, mask = data
    s, b, h, t = inputs.shape[1], inputs.shape[0], SHAPE.hidden_size, dist.get_world_size(tp_group())
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            model(inputs, position_ids, mask)
    finally:
        for handle in handles:
            handle.remove()
    out: dict = {}
    for path, shape in seen.values():
        wrapper = path.split(".adapter")[0]
        kind = {(s, b, h): "x_full", (s // t, b, h): "x_local"}.get(shape)
        if kind is not None:
            out.setdefault(wrapper, {"x_full": 0, "x_local": 0})[kind] += 1
    return out


def _case(res: dict, name: str, fn) -> None:
    """``fn()``'s result or its traceback under ``name``; the ranks agree before going on."""
    try:
        res[name] = fn()
        err = None
    except Exception:
        err = traceback.format_exc()
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, err)
    if any(errors):
        res[name] = {"error": next(e for e in errors if e)}


def _raises(fn) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ran"


def _save(sharded: dict, directory: str) -> None:
    C._save(sharded, directory)


# -- phase 1: TP=2 -----------------------------------------------------------------------------------


def parity(out: dict) -> None:
    reference = bridge_model()
    out["bridge_names"] = sorted(W.adapter_params(reference))
    models = {"bridge/gather": reference}
    for variant in VARIANTS:
        models[f"regather/{variant}"] = regather_model(variant)
        W.copy_adapters(reference, models[f"regather/{variant}"])
    for variant in ("early", "plain"):  # the classic output, Bridge's bits (regather is lean by default)
        models[f"regather/{variant}-classic"] = regather_model(variant, lean_transients=False)
        W.copy_adapters(reference, models[f"regather/{variant}-classic"])
    # the same function in fp64 from the same weights: the reference of lowrank and of the lean row
    # adapters' LoRA-B weight gradients (other summation orders than the gather path's;
    # tests.harness.numerics)
    models["fp64"] = regather_model("gather", dtype=torch.float64)
    W.copy_adapters(reference, models["fp64"])
    for name, model in models.items():
        out[name] = run(model)
        if name in ("bridge/gather", "regather/early"):
            out[name]["decisions"] = W.decisions(model) if name.startswith("regather") else None
    out["frozen_logits"] = logits(base_model())
    out["bridge_logits"] = logits(reference)  # full vocabulary, for the TP=1 comparison
    out["bridge_full_weights"] = full_weights(reference)


def state_dicts(out: dict) -> None:
    from regather.megatron.dense import checkpoint

    data = gpt_batch(SHAPE, MICRO_BATCH, seed=3)
    bridge = bridge_model()
    bsd = bridge.state_dict()
    ref = logits(bridge, data)
    out["bridge_keys"] = list(bsd)
    for variant in ("gather", "early", "lowrank"):
        model = regather_model(variant)
        before = logits(model, data)
        model.load_state_dict(bsd, strict=True)
        msd = model.state_dict()
        if variant == "lowrank":  # its reference: Bridge's weights in an fp64 model
            ref64 = regather_model("gather", dtype=torch.float64)
            ref64.load_state_dict(bsd, strict=True)
            out["bridge->fp64"] = logits(ref64, data)
        out[f"bridge->{variant}"] = {
            "before": before, "after": logits(model, data), "ref": ref, "keys": list(msd),
            "same_mapping": msd.keys() == bsd.keys() and all(
                torch.equal(msd[k], bsd[k]) for k in bsd if isinstance(bsd[k], torch.Tensor))}
    # regather -> Bridge, the way Bridge loads: the base into the unwrapped model (pretrained),
    # the adapters through Bridge's filter with strict=False (resume)
    peft = bridge_peft()
    mine = regather_model("early", seed=MINE_SEED + 1)
    mine_logits, msd = logits(mine, data), mine.state_dict()
    unwrapped = base_model()
    report = unwrapped.load_state_dict(checkpoint.base_only(msd), strict=True)
    target = peft([unwrapped], training=True)[0]
    before = logits(target, data)
    filtered = {k: v for k, v in msd.items() if peft.adapter_key_filter(k) and "_extra_state" not in k}
    loaded = target.load_state_dict(filtered, strict=False)
    out["regather->bridge"] = {"base_missing": list(report.missing_keys), "base_unexpected": list(report.unexpected_keys),
                               "missing_adapter_keys": sorted(k for k in loaded.missing_keys if ".adapter." in k),
                               "unexpected": list(loaded.unexpected_keys), "n_filtered": len(filtered),
                               "before": before, "after": logits(target, data), "ref": mine_logits}


def subsets(out: dict) -> None:
    """Bridge with a subset of q/k/v or gate/up; regather's subset against Bridge's full model with
    the other adapters' LoRA-B zeroed (a correct reference Bridge can run)."""
    for label, targets in SUBSETS.items():
        res = {"bridge": _raises(lambda: logits(bridge_model(targets=targets)))}
        reference = bridge_model()
        models = {v: regather_model(v, targets=targets) for v in ("gather", "early")}
        names = set(W.adapter_params(models["gather"]))
        donor = W.adapter_params(reference)
        with torch.no_grad():
            for name, p in donor.items():
                if name not in names and name.endswith("linear_out.weight"):
                    p.zero_()
        for m in models.values():
            m.load_state_dict({n: donor[n].detach().clone() for n in names}, strict=False)
        res["reference"] = run(reference)
        for v, m in models.items():
            res[v] = run(m)
        res["names"] = sorted(names)
        out[label] = res


def dist_checkpoints_tp2(out: dict, root: str) -> None:
    """Gated GPT, TP=2: each side saves a full checkpoint the way it saves (Bridge: its model section;
    regather: ``{"model": sharded_state_dict()}``); each loads both the way it loads (regather: strict
    ``load_state_dict``; Bridge: its ``load_peft_adapter_checkpoint``, adapters only)."""
    from tests.harness.bridge_env import import_bridge_checkpointing

    bridge_ckpt = import_bridge_checkpointing()
    import megatron.bridge.peft.utils as bridge_utils

    bridge = bridge_model()
    mine = regather_model("early", seed=MINE_SEED + 1)
    out["bridge_weights"], out["mine_weights"] = full_weights(bridge), full_weights(mine)
    out["bridge_logits"], out["mine_logits"] = logits(bridge), logits(mine)
    _save(bridge_ckpt._generate_model_state_dict([bridge]), f"{root}/bridge_tp2")
    _save({"model": mine.sharded_state_dict()}, f"{root}/regather_tp2")
    peft = bridge_peft()
    for source in ("bridge_tp2", "regather_tp2"):
        model = regather_model("gather", seed=MINE_SEED + 2)
        model.load_state_dict(C._dist_load(model, f"{root}/{source}"), strict=True)
        out[f"{source}->regather"] = {"weights": full_weights(model), "logits": logits(model)}
        target = bridge_model(seed=BRIDGE_SEED + 2)
        bridge_utils.load_peft_adapter_checkpoint([target], f"{root}/{source}", peft, fully_parallel_load=False)
        out[f"{source}->bridge"] = {"weights": full_weights(target), "logits": logits(target)}


def not_gated_tp2(out: dict) -> None:
    bridge = bridge_model(targets=["linear_fc1_up", "linear_fc1_gate"], config=NOT_GATED)
    out["weights"] = full_weights(bridge)
    out["bridge"] = logits(bridge)
    out["frozen"] = logits(base_model(config=NOT_GATED))
    try:  # regather refuses these targets on a non-gated fc1 (regather.megatron.canonical._require_gated)
        regather_model("gather", targets=["linear_fc1_up", "linear_fc1_gate"], config=NOT_GATED)
        out["regather"] = None
    except ValueError as exc:
        out["regather"] = str(exc)


def odd_tokens_tp2(out: dict) -> None:
    """TP=2 without SP, one sequence of 31 tokens."""
    data = gpt_batch(ODD, 1, seed=3)
    out["bridge"] = _raises(lambda: logits(bridge_model(sp=False, shape=ODD), data))
    bridge = bridge_model(sp=False, shape=ODD)
    mine = regather_model("early", sp=False, shape=ODD)
    W.copy_adapters(bridge, mine)
    out["weights"] = full_weights(bridge)
    out["regather"] = logits(mine, data)
    out["decisions"] = W.decisions(mine)


# -- phase 2: TP=1 -----------------------------------------------------------------------------------


def tp1_phase(res: dict, root: str) -> dict:
    import megatron.bridge.peft.utils as bridge_utils

    out: dict = {}
    data = gpt_batch(SHAPE, MICRO_BATCH, seed=3)
    # (a): Bridge's own CanonicalLoRA at TP=1 on the TP=2 model's full weights
    bridge = bridge_model(tp=1)
    load_full(bridge, res["parity"]["bridge_full_weights"])
    out["bridge"] = {"logits": logits(bridge, data)}
    mine = regather_model("gather", tp=1)
    load_full(mine, res["parity"]["bridge_full_weights"])
    out["regather"] = {"logits": logits(mine, data)}
    # the TP=1 / TP=2 comparisons are other summation orders: their references, the same functions in
    # fp64 at TP=1 (tests.harness.numerics): Bridge's TP=2 weights, the odd-token model's, regather's
    # checkpointed ones
    out["fp64"] = _fp64_logits(res["parity"]["bridge_full_weights"], data)
    # a correct reference for the TP=2 runs Bridge cannot do: Bridge at TP=1
    odd = gpt_batch(ODD, 1, seed=3)
    bridge_odd = bridge_model(tp=1, sp=False, shape=ODD)
    load_full(bridge_odd, res["odd_tokens"]["weights"])
    out["bridge_odd"] = logits(bridge_odd, odd)
    out["fp64_odd"] = _fp64_logits(res["odd_tokens"]["weights"], odd, sp=False, shape=ODD)
    out["fp64_mine"] = _fp64_logits(res["ckpt"]["mine_weights"], data)
    ng = bridge_model(tp=1, targets=["linear_fc1_up", "linear_fc1_gate"], config=NOT_GATED)
    load_full(ng, res["not_gated"]["weights"])
    out["bridge_not_gated"] = logits(ng)
    # (b): the TP=2 dist checkpoints at TP=1
    peft = bridge_peft()
    for source in ("bridge_tp2", "regather_tp2"):
        target = bridge_model(tp=1, seed=BRIDGE_SEED + 2)
        bridge_utils.load_peft_adapter_checkpoint([target], f"{root}/{source}", peft, fully_parallel_load=False)
        out[f"{source}->bridge"] = {"weights": full_weights(target), "logits": logits(target, data)}
        model = regather_model("gather", tp=1, seed=MINE_SEED + 2)
        model.load_state_dict(C._dist_load(model, f"{root}/{source}"), strict=True)
        out[f"{source}->regather"] = {"weights": full_weights(model), "logits": logits(model, data)}
    # a Bridge checkpoint written at TP=1 (its SwiGLU factory is the identity there), from Bridge's
    # TP=2 weights, for phase 3
    from tests.harness.bridge_env import import_bridge_checkpointing

    saver = bridge_model(tp=1)
    load_full(saver, res["ckpt"]["bridge_weights"])
    _save(import_bridge_checkpointing()._generate_model_state_dict([saver]), f"{root}/bridge_tp1")
    return out


def _fp64_logits(weights: dict, data, **kw) -> torch.Tensor:
    """The logits of the gather path at TP=1 in fp64 with the full adapter ``weights`` (the base
    model's weights are the fp32 draws', cast)."""
    model = regather_model("gather", tp=1, dtype=torch.float64, **kw)
    load_full(model, weights)
    return logits(model, data)


# -- phase 3: TP=2 again -----------------------------------------------------------------------------


def tp2_from_tp1(res: dict, root: str) -> dict:
    import megatron.bridge.peft.utils as bridge_utils

    model = regather_model("early", seed=MINE_SEED + 3)
    model.load_state_dict(C._dist_load(model, f"{root}/bridge_tp1"), strict=True)
    target = bridge_model(seed=BRIDGE_SEED + 3)
    bridge_utils.load_peft_adapter_checkpoint([target], f"{root}/bridge_tp1", bridge_peft(), fully_parallel_load=False)
    return {"regather": {"weights": full_weights(model), "logits": logits(model)},
            "bridge": {"weights": full_weights(target), "logits": logits(target)}}


def canonical_worker(rank: int, world_size: int, root: str) -> dict:
    import megatron.core
    from tests.harness.megatron_ckpt import enable_dist_checkpointing_cpu

    enable_dist_checkpointing_cpu()
    W.bridge_peft()
    res: dict = {"rank": rank, "version": megatron.core.__version__}

    def phase(name, fn):
        out: dict = {}
        _case(res, name, lambda: (fn(out), out)[1])

    phase("parity", parity)
    phase("state_dict", state_dicts)
    phase("subsets", subsets)
    phase("ckpt", lambda out: dist_checkpoints_tp2(out, root))
    phase("not_gated", not_gated_tp2)
    phase("odd_tokens", odd_tokens_tp2)
    parallel(1)
    _case(res, "tp1", lambda: tp1_phase(res, root))
    parallel(TP)
    _case(res, "tp2_from_tp1", lambda: tp2_from_tp1(res, root))
    return res
