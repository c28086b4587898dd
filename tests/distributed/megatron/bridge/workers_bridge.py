"""Rank workers for the tests against the real Megatron Bridge (spawned by run_ranks).

One tiny megatron-core GPT (``regather.tools.cpu.models.build_gpt``: local spec, TP=2 + SP,
fp32, same base weights on every build) is adapted by Bridge's ``LoRA``, by ``regather.LoRA``
and by ``regather.bridge.LoRA``. Bridge initialises its adapters itself; every other model
gets Bridge's adapter weights copied in by parameter name (the name sets must be equal), so
all models compute the same function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from regather.tools.cpu.models import TinyGPT, build_gpt, gpt_batch

SHAPE = TinyGPT(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                vocab_size=256, seq_length=32)
TP, MICRO_BATCH, DIM, ALPHA = 2, 2, 8, 16
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
SEED = 1234
# SwiGLU MLP (Qwen / Llama): pass as ``config=GATED``; linear_fc1's LoRA-B is [gate_i; up_i] per rank
GATED = {"gated_linear_unit": True, "activation_func": F.silu}


def bridge_peft():
    from tests.harness.bridge_env import import_bridge_peft

    return import_bridge_peft()


def base_model(tp: int = TP, config: dict | None = None, dtype=torch.float32):
    """``config``: TransformerConfig overrides (e.g. ``GATED``)."""
    return build_gpt(SHAPE, tp, sequence_parallel=True, dtype=dtype, seed=SEED, **(config or {}))


def bridge_lora(regather: bool, **kw):
    # B initialised non-zero ("normal"), so LoRA-A's gradients are not all zero
    return bridge_peft().LoRA(target_modules=list(TARGETS), dim=DIM, alpha=ALPHA, lora_B_init_method="normal",
                              sequence_parallel_input_regather=regather, **kw)


def bridge_model(regather: bool, tp: int = TP, config: dict | None = None, **kw):
    model = base_model(tp, config)
    torch.manual_seed(SEED + 7)  # Bridge's adapter init draws from the default generator
    return bridge_lora(regather, **kw)([model], training=True)[0]


def regather_model(strategy: str, tp: int = TP, adapter_seed: int = SEED + 11, config: dict | None = None,
                   dtype=torch.float32, **kw):
    from regather import LoRA

    model = base_model(tp, config, dtype)
    torch.manual_seed(adapter_seed)  # regather's adapter init (an init other than Bridge's)
    return LoRA(target_modules=list(TARGETS), dim=DIM, alpha=ALPHA, sequence_parallel_input_strategy=strategy,
                **kw)(model, training=True)


def adapter_params(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if ".adapter." in n}


def copy_adapters(src, dst) -> None:
    """Copy the adapter weights of ``src`` into ``dst`` by parameter name (same names required).
    A replicated (lowrank) LoRA-A is filled through its load hook from the rank shard."""
    s, d = adapter_params(src), adapter_params(dst)
    assert s.keys() == d.keys(), sorted(set(s) ^ set(d))
    missing, unexpected = dst.load_state_dict({n: p.detach().clone() for n, p in s.items()}, strict=False)
    assert not unexpected and all(".adapter." not in k for k in missing), (missing, unexpected)


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def measure(model, batch) -> dict:
    """Forward + backward of the next-token loss. Returns logits, per-token loss, the
    trainable parameters' gradients, the retained bytes at the end of forward
    (total and LoRA-A input part), and the collective bytes/calls of forward + backward."""
    from megatron.core import tensor_parallel

    from regather.core.accounting import ADAPTER_INPUT, CollectiveBytes, SavedBytes

    inputs, labels, position_ids, mask = batch
    for p in model.parameters():
        p.grad = None
    with CollectiveBytes() as comm, SavedBytes.for_model(model) as saved:
        logits = model(inputs, position_ids, mask)  # [b, s, v/t]
        # fp32 for bf16 (as before); an fp64 reference model stays fp64
        per_token = tensor_parallel.vocab_parallel_cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels)
        forward_comm = comm.snapshot()
        per_token.mean().backward()
    return {
        "logits": logits.detach().clone(),
        "loss": per_token.detach().clone(),
        "grads": {n: p.grad.detach().clone() for n, p in trainable(model).items()},
        "saved": saved.total,
        "saved_adapter_input": saved.of(ADAPTER_INPUT),
        "comm": comm.snapshot(),
        "comm_forward": forward_comm,
        "calls": dict(comm.calls),
    }


def input_grad(model, batch) -> torch.Tensor:
    """The gradient of the loss w.r.t. the decoder input (the embedding output, made a leaf)."""
    from megatron.core import tensor_parallel

    inputs, labels, position_ids, mask = batch
    leaf = {}

    def hook(module, args, out):
        leaf["x"] = out.detach().requires_grad_(True)
        return leaf["x"]

    handle = model.embedding.register_forward_hook(hook)
    try:
        for p in model.parameters():
            p.grad = None
        logits = model(inputs, position_ids, mask)
        tensor_parallel.vocab_parallel_cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)),
                                                     labels).mean().backward()
    finally:
        handle.remove()
    for p in model.parameters():
        p.grad = None
    return leaf["x"].grad.detach().clone()


def decisions(model) -> dict[str, str]:
    from regather import decisions as regather_decisions

    return {path: str(d) for path, d in regather_decisions(model).items()}


# -- workers ----------------------------------------------------------------------------


def parity_worker(rank: int, world_size: int) -> dict:
    """Bridge gather / regather vs regather gather / regather / lowrank, and regather.bridge.LoRA
    applied through Bridge's PEFT entry point, all from Bridge's adapter weights."""
    bridge_peft()
    import regather.megatron.bridge as rb

    batch = gpt_batch(SHAPE, MICRO_BATCH, seed=3)
    out: dict = {"rank": rank}
    reference = bridge_model(regather=False)
    models = {"bridge/gather": reference, "bridge/regather": bridge_model(regather=True)}
    copy_adapters(reference, models["bridge/regather"])
    for strategy in ("gather", "regather", "lowrank"):
        models[f"regather/{strategy}"] = regather_model(strategy)
        copy_adapters(reference, models[f"regather/{strategy}"])
    # regather's path with the classic output, Bridge 0.6.2's bits (regather is lean by default)
    models["regather/regather-classic"] = regather_model("regather", lean_transients=False)
    copy_adapters(reference, models["regather/regather-classic"])

    # regather.bridge.LoRA through Bridge's protocol: a list of chunks, Bridge's freeze_model,
    # set_params_to_save, adapter_key_filter
    for strategy, kw in (("regather", dict(sequence_parallel_input_regather=True)),
                         ("lowrank", dict(sequence_parallel_input_strategy="lowrank"))):
        peft = rb.LoRA(target_modules=list(TARGETS), dim=DIM, alpha=ALPHA, **kw)
        chunks = peft([base_model()], training=True)
        peft.set_params_to_save(chunks)
        model = chunks[0]
        copy_adapters(reference, model)
        models[f"rb/{strategy}"] = model
        inputs, _, position_ids, mask = batch
        with torch.no_grad():
            with peft.disable_adapter(chunks):  # Bridge's context manager: the frozen base alone
                disabled = model(inputs, position_ids, mask)
            enabled = model(inputs, position_ids, mask)
            frozen = base_model()(inputs, position_ids, mask)
        out[f"rb/{strategy}/disable_adapter"] = {"disabled": disabled, "enabled": enabled, "frozen": frozen}
        state = model.state_dict()
        out[f"rb/{strategy}/protocol"] = {
            "is_bridge_lora": isinstance(peft, bridge_peft().LoRA),
            "returned_list": isinstance(chunks, list) and len(chunks) == 1,
            "training": model.training,
            "params_to_save": sorted(peft.params_to_save),
            "trainable": sorted(trainable(model)),
            "filtered_keys": sorted(k for k in state if peft.adapter_key_filter(k) and "_extra_state" not in k),
            "wrapper_types": sorted({type(m).__module__ + "." + type(m).__name__
                                     for n, m in model.named_modules() if n.endswith(tuple(TARGETS))}),
        }
    classic = rb.LoRA(target_modules=list(TARGETS), dim=DIM, alpha=ALPHA, sequence_parallel_input_regather=True,
                      lean_transients=False)
    models["rb/regather-classic"] = classic([base_model()], training=True)[0]
    copy_adapters(reference, models["rb/regather-classic"])
    # the same function in float64 (the weights of regather/gather, which holds Bridge's adapters): the
    # reference of the lean row adapters' other summation order (tests.harness.numerics)
    models["fp64"] = regather_model("gather", dtype=torch.float64)
    models["fp64"].load_state_dict(models["regather/gather"].state_dict(), strict=True)
    out["bridge_trainable"] = sorted(trainable(reference))
    for name, model in models.items():
        res = measure(model, batch)
        res["input_grad"] = input_grad(model, batch)
        out[name] = res
    for name in ("regather/regather", "regather/lowrank", "rb/regather", "rb/lowrank"):
        out[name]["decisions"] = decisions(models[name])
    return out


def mcore016_worker(rank: int, world_size: int) -> dict:
    """Bridge gather / regather vs regather gather / regather under whichever megatron-core is
    on the path (the 0.16.1 test runs this without the 0.19.2 directory). Returns the largest
    absolute differences, the retained bytes and the reduce-scatter calls."""
    import megatron.core
    from tests.harness.bridge_env import installed_shims

    bridge_peft()
    batch = gpt_batch(SHAPE, MICRO_BATCH, seed=3)
    reference = bridge_model(regather=False)
    # regather's path with the classic output: Bridge 0.6.2's bits with the row-parallel targets too
    # (lean, the default, sums their LoRA-B weight gradient in another order: test_bridge_parity)
    models = {"bridge/gather": reference, "bridge/regather": bridge_model(regather=True),
              "regather/gather": regather_model("gather"),
              "regather/regather": regather_model("regather", lean_transients=False)}
    for _name, model in models.items():
        if model is not reference:
            copy_adapters(reference, model)
    res = {name: measure(model, batch) for name, model in models.items()}
    ref = res["bridge/gather"]

    def diff(r) -> float:
        d = [(r["logits"] - ref["logits"]).abs().max(), (r["loss"] - ref["loss"]).abs().max()]
        d += [(r["grads"][n] - g).abs().max() for n, g in ref["grads"].items()]
        return float(max(d))

    return {"version": megatron.core.__version__, "shims": installed_shims(),
            "max_diff": {n: diff(r) for n, r in res.items()}, "n_grads": len(ref["grads"]),
            "saved": {n: r["saved"] for n, r in res.items()},
            "reduce_scatter_calls": {n: r["calls"]["reduce_scatter"] for n, r in res.items()}}
