"""Rank bodies for test_canonical.py: ``regather.CanonicalLoRA`` on a real megatron-core GPT.

The model: 2 layers, h=64, 4 heads in 2 query groups (GQA: q is 64 wide, k and v 32 each),
gated SwiGLU MLP (ffn=128, ``linear_fc1`` 256 wide), no biases, vocab 256, s=32, micro-batch 2,
TP=2 + SP on two gloo ranks; CanonicalLoRA dim=8, alpha=16, LoRA-B "normal" (non-zero, so every
LoRA-A gets a gradient). Every build starts from the same base weights (megatron's CPU init
splits one master weight) and, with the same adapter seed, the same *full* adapter weights at
every TP size (regather's adapters shard full master weights), so models of different TP sizes
and strategies compute the same function.

One spawn (:func:`canonical_suite`) runs everything: the TP=2 cases first, then
``initialize_model_parallel(1)`` (the two ranks become data-parallel replicas) for the TP=1
references and the TP=1 load of the TP=2 distributed checkpoint. The test process compares.
"""

from __future__ import annotations

import logging
import os
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

from regather.core.buffers import ScratchPool
from regather.core.strategies.shared_gather import BACKWARD_SCRATCH, FORWARD_SCRATCH
from regather.tools.cpu.models import TinyGPT, gpt_batch

SHAPE = TinyGPT(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=128, vocab_size=256, seq_length=32)
GATED = {"gated_linear_unit": True, "activation_func": F.silu, "add_bias_linear": False}
NOT_GATED = {"add_bias_linear": False}
MICRO_BATCH, DIM, ALPHA = 2, 8, 16
BASE_SEED, ADAPTER_SEED, OTHER_SEED = 1234, 99, 7
TP = 2
# name -> (sequence_parallel_input_strategy, early_regather)
VARIANTS = {"gather": ("gather", True), "plain": ("regather", False), "early": ("regather", True),
            "lowrank": ("lowrank", True)}
SUBSETS = {"q+v": ["linear_q", "linear_v"], "fc1_up": ["linear_fc1_up"]}
ALL_TARGETS = ["linear_q", "linear_k", "linear_v", "linear_proj", "linear_fc1_up", "linear_fc1_gate", "linear_fc2"]
QKV, FC1 = "self_attention.linear_qkv", "mlp.linear_fc1"
# lean_transients of every build, the gather path included, so that the strategies are compared like
# for like: linear_proj and linear_fc2 are row-parallel targets, whose lean LoRA-B weight gradient is
# summed per sequence shard (another order than the classic gather path's, docs/design.md §3.7)
LEAN = True

_STATE = {"tp": None}


# -- building ------------------------------------------------------------------------------------


def parallel(tp: int) -> None:
    from tests.harness.megatron_train import enable_megatron_training_cpu

    from regather.tools.cpu.models import init_model_parallel

    enable_megatron_training_cpu()  # the fused-wgrad stand-in for gradient_accumulation_fusion
    if _STATE["tp"] != tp:
        init_model_parallel(tp)
        _STATE["tp"] = tp


def base(tp: int = TP, dtype=torch.float32, fuse: bool = False, config: dict = GATED, sp: bool = True,
         shape: TinyGPT = SHAPE):
    from regather.tools.cpu.models import build_gpt

    parallel(tp)
    return build_gpt(shape, tp, sequence_parallel=sp, dtype=dtype, seed=BASE_SEED,
                     gradient_accumulation_fusion=fuse, init_parallel=False, **config)


def canonical(variant: str = "early", tp: int = TP, dtype=torch.float32, fuse: bool = False,
              targets=None, seed: int = ADAPTER_SEED, config: dict = GATED, sp: bool = True,
              shape: TinyGPT = SHAPE, **lora):
    from regather import CanonicalLoRA

    model = base(tp, dtype, fuse, config, sp, shape)
    strategy, early = VARIANTS[variant]
    torch.manual_seed(seed)
    peft = CanonicalLoRA(target_modules=list(targets or ALL_TARGETS), dim=DIM, alpha=ALPHA,
                         lora_B_init_method="normal", sequence_parallel_input_strategy=strategy,
                         early_regather=early, **{"lean_transients": LEAN, **lora})
    model = peft(model, training=True)
    if fuse:  # what megatron DDP gives every trainable parameter
        for p in model.parameters():
            if p.requires_grad:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
                p.grad_added_to_main_grad = False
    return model


def fp64_twin(model, tp: int = TP, **kw):
    """``model``'s function in fp64 on the gather path, from its weights as they are (fp32 or bf16):
    the reference of results that are not the same GEMMs (tests.harness.numerics); its loss too
    (:func:`forward_loss`)."""
    twin = canonical("gather", tp=tp, dtype=torch.float64, **kw)
    twin.load_state_dict(model.state_dict(), strict=True)
    return twin


def fused_lora(variant: str = "early", tp: int = TP, targets=("linear_qkv", "linear_proj", "linear_fc1",
                                                               "linear_fc2"), dim: int = DIM, alpha: int = ALPHA,
               seed: int = ADAPTER_SEED, **lora):
    """``regather.LoRA`` (one adapter per fused linear) on the same base."""
    from regather import LoRA

    model = base(tp)
    strategy, early = VARIANTS[variant]
    torch.manual_seed(seed)
    return LoRA(target_modules=list(targets), dim=dim, alpha=alpha, lora_B_init_method="normal",
                sequence_parallel_input_strategy=strategy, early_regather=early,
                **{"lean_transients": LEAN, **lora})(model, training=True)


class SpyPool(ScratchPool):
    """Counts leases per purpose (forward / backward gathers of x) and the most in flight at once."""

    def __init__(self):
        super().__init__()
        self.acquired = {FORWARD_SCRATCH: 0, BACKWARD_SCRATCH: 0}
        self.max_in_flight = {FORWARD_SCRATCH: 0, BACKWARD_SCRATCH: 0}

    def acquire(self, purpose, shape, dtype, device):
        lease = super().acquire(purpose, shape, dtype, device)
        self.acquired[purpose] = self.acquired.get(purpose, 0) + 1
        self.max_in_flight[purpose] = max(self.max_in_flight.get(purpose, 0), self.in_flight(purpose))
        return lease

    def snapshot(self) -> dict:
        return {"acquired": dict(self.acquired), "max_in_flight": dict(self.max_in_flight),
                "in_flight": self.in_flight()}


def spy_on(model) -> SpyPool:
    from regather.megatron.dense.model import adapters

    pool = SpyPool()
    for a in adapters(model).values():
        a.pool = pool
    return pool


# -- measuring -----------------------------------------------------------------------------------


def batch(seed: int = 3, shape: TinyGPT = SHAPE, micro_batch: int = MICRO_BATCH):
    return gpt_batch(shape, micro_batch, seed=seed)


def _trainable(model) -> dict:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _clear(model) -> None:
    for p in model.parameters():
        p.grad = None
        if getattr(p, "main_grad", None) is not None:
            p.main_grad.zero_()


def _grads(model, fuse: bool) -> dict:
    return {n: (p.main_grad if fuse else p.grad).detach().clone() for n, p in _trainable(model).items()}


def forward_loss(model, data):
    """Logits ``[b, s, v/t]`` and megatron's vocab-parallel per-token loss. The cross entropy works in
    place on an fp32 input (it leaves the softmax there): it gets a copy, so the logits stay logits in
    every dtype. megatron's runs in fp32 whatever the logits; the fp64 reference's runs in fp64."""
    from megatron.core import tensor_parallel

    inputs, labels, position_ids, mask = data
    logits = model(inputs, position_ids, mask)
    if logits.dtype == torch.float64:
        full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)  # its backward: this rank's part
        per_token = F.cross_entropy(full.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
        return logits, per_token
    return logits, tensor_parallel.vocab_parallel_cross_entropy(logits.float().clone(), labels)


def measure(model, data=None, fuse: bool = False) -> dict:
    """One forward + backward of the mean next-token loss: logits, per-token loss, every trainable
    parameter's gradient (``main_grad`` with fusion), retained bytes per label at the end of forward,
    collective bytes and calls of forward and backward apart, and (a second pass, with the embedding
    output made a leaf) the gradient of the loss w.r.t. the decoder input."""
    from regather.core.accounting import CollectiveBytes, SavedBytes

    data = data or batch()
    _clear(model)
    with CollectiveBytes() as fwd, SavedBytes.for_model(model) as saved:
        logits, per_token = forward_loss(model, data)
    with CollectiveBytes() as bwd:
        per_token.mean().backward()
    out = {"logits": logits.detach().clone(), "loss": per_token.detach().clone(), "grads": _grads(model, fuse),
           "saved": saved.by_label(), "saved_total": saved.total,
           "comm": {"forward": {"bytes": fwd.snapshot(), "calls": dict(fwd.calls)},
                    "backward": {"bytes": bwd.snapshot(), "calls": dict(bwd.calls)}}}
    out["input_grad"] = input_grad(model, data)
    _clear(model)
    return out


def input_grad(model, data) -> torch.Tensor:
    leaf = {}

    def hook(module, args, output):
        leaf["x"] = output.detach().requires_grad_(True)
        return leaf["x"]

    handle = model.embedding.register_forward_hook(hook)
    try:
        _, per_token = forward_loss(model, data)
        per_token.mean().backward()
    finally:
        handle.remove()
    return leaf["x"].grad.detach().clone()


def tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def full(t: torch.Tensor, dim: int) -> torch.Tensor:
    from regather.core.comm import all_gather_dim

    return all_gather_dim(t.detach().contiguous(), tp_group(), dim).clone()


def full_params(model, values: dict | None = None) -> dict:
    """Each adapter parameter (or the given per-parameter tensors, e.g. gradients) as the full
    tensor: gathered over TP along the parameter's partition axis (replicated ones as they are)."""
    out = {}
    for name, p in model.named_parameters():
        if ".adapter." not in name:
            continue
        t = p if values is None else values[name]
        if getattr(p, "tensor_model_parallel", False) and getattr(p, "partition_dim", -1) >= 0:
            out[name] = full(t, p.partition_dim)
        else:
            out[name] = t.detach().clone()
    return out


def load_full(model, weights: dict) -> None:
    """Full adapter weights into a TP=1 model (local = full there)."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and not [k for k in missing if ".adapter." in k and "_extra_state" not in k], \
        (missing, unexpected)


def to_full(res: dict, model) -> dict:
    """A TP=2 measurement in the TP=1 layout: vocab-gathered logits and losses as they are,
    sequence-gathered decoder-input gradient, full gradients."""
    return {"logits": full(res["logits"], -1), "loss": res["loss"], "input_grad": full(res["input_grad"], 0),
            "grads": full_params(model, res["grads"])}


def decisions(model) -> dict:
    from regather import decisions as regather_decisions

    return {path: str(d) for path, d in regather_decisions(model).items()}


def _case(res: dict, name: str, fn) -> None:
    """Record ``fn()``'s result, or its traceback (the tests fail on it by name); the ranks agree
    first so that a case failing on one rank only does not leave the other inside a collective."""
    try:
        res[name] = fn()
        err = None
    except Exception:
        err = traceback.format_exc()
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, err)
    if any(errors):
        res[name] = {"error": next(e for e in errors if e)}


# -- the cases at TP=2 ----------------------------------------------------------------------------


def parity_runs() -> dict:
    """Every variant, fp32 and bf16, with and without gradient-accumulation fusion; the models of
    one dtype compute the same function (same full weights)."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for fuse in (False, True):
            for variant in VARIANTS:
                model = canonical(variant, dtype=dtype, fuse=fuse)
                res = measure(model, fuse=fuse)
                if dtype == torch.float32 and not fuse and variant in ("gather", "early"):
                    res["full"] = to_full(res, model)
                out[(str(dtype).split(".")[-1], fuse, variant)] = res
    out["base_logits"] = forward_loss(base(), batch())[0].detach()  # the frozen model: the adapters' effect
    out["fp64"] = {}
    for dtype in (torch.float32, torch.bfloat16):  # the same function in fp64, from each dtype's weights
        twin = fp64_twin(canonical("gather", dtype=dtype))
        res = measure(twin)
        if dtype == torch.float32:
            res["full"] = to_full(res, twin)
        out["fp64"][str(dtype).split(".")[-1]] = res
    return out


def recompute_runs() -> dict:
    out = {}
    for variant in ("gather", "early", "plain", "lowrank"):
        model = canonical(variant, recompute_adapter_inputs=True)
        res = measure(model)
        res["decisions"] = decisions(model)
        out[variant] = res
    return out


def _zero_missing_b(model, present: dict) -> None:
    """Zero LoRA-B of every adapter whose weights are not in ``present``."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_out.weight") and ".adapter." in name and name not in present:
                p.zero_()


def subset_runs(tp: int = TP) -> dict:
    """A subset of the targets vs the full model with the other adapters' LoRA-B zeroed (the
    subset model gets the full model's weights for its own adapters)."""
    out = {}
    for label, targets in SUBSETS.items():
        reference = canonical("gather", tp=tp)
        donor = {n: p.detach().clone() for n, p in reference.named_parameters() if ".adapter." in n}
        models = {}
        for variant in ("gather", "early", "lowrank") if tp > 1 else ("gather",):
            model = canonical(variant, tp=tp, targets=targets, seed=OTHER_SEED)
            mine = {n for n, _ in model.named_parameters() if ".adapter." in n}
            _missing, unexpected = model.load_state_dict({n: donor[n] for n in mine}, strict=False)
            assert not unexpected, unexpected
            models[variant] = model
        _zero_missing_b(reference, {n for n, _ in models["gather"].named_parameters()})
        res = {"reference": measure(reference), "names": sorted(n for n, _ in models["gather"].named_parameters()
                                                                if ".adapter." in n)}
        if tp > 1:
            twin = fp64_twin(reference, tp=tp)
            res["fp64"] = measure(twin)
            res["fp64"]["full"] = to_full(res["fp64"], twin)
        for variant, model in models.items():
            res[variant] = measure(model)
            res[variant]["decisions"] = decisions(model)
            if variant == "gather" and tp > 1:
                res[variant]["full"] = to_full(res[variant], model)
                res[variant]["weights"] = full_params(model)
        out[label] = res
    return out


def _micro_batch_order(variant: str, order: str) -> dict:
    """Two micro-batches in ``order`` ("f1 f2 b2 b1"): gradients accumulated, the pool watched."""
    model = canonical(variant)
    pool = spy_on(model)
    data = [batch(seed=11), batch(seed=12)]
    losses, after = {}, {}
    for step in order.split():
        i = int(step[1]) - 1
        if step[0] == "f":
            losses[i] = forward_loss(model, data[i])[1].mean()
        else:
            losses[i].backward()
        after[step] = pool.in_flight()
    return {"grads": _grads(model, False), "losses": {i: loss.detach() for i, loss in losses.items()},
            "in_flight_after": after, "pool": pool.snapshot()}


def _retained(variant: str) -> dict:
    """One forward, two backward calls (``retain_graph=True``); megatron's vocab-parallel cross
    entropy overwrites its saved softmax in backward, so the loss is a plain function of the logits."""
    from regather.core.accounting import CollectiveBytes

    model = canonical(variant)
    pool = spy_on(model)
    logits = model(*[batch()[k] for k in (0, 2, 3)])
    loss = logits.float().square().mean()
    grads, gathers, in_flight = [], [], []
    for _ in range(2):
        with CollectiveBytes() as c:
            loss.backward(retain_graph=True)
        grads.append(_grads(model, False))
        gathers.append(c.calls.get("all_gather", 0))
        in_flight.append(pool.in_flight())
    return {"grads": grads, "backward_all_gathers": gathers, "in_flight_after": in_flight, "pool": pool.snapshot()}


def schedule_runs() -> dict:
    out = {}
    for variant in ("gather", "early", "plain"):
        out[("interleaved", variant)] = _micro_batch_order(variant, "f1 f2 b2 b1")
        out[("retain", variant)] = _retained(variant)
    return out


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def decision_runs() -> dict:
    """CanonicalLoRA's decisions against LoRA's on the same base, in the situations that decide."""
    out = {}
    for label, kw in (("early", {}), ("lowrank", {}), ("recompute", {"recompute_adapter_inputs": True})):
        variant = "lowrank" if label == "lowrank" else "early"
        canon, fused = canonical(variant, **kw), fused_lora(variant, **kw)
        data = batch()
        table = {}
        for mode in ("train", "eval", "no_grad"):
            for m in (canon, fused):
                m.train(mode != "eval")
            if mode == "no_grad":
                with torch.no_grad():
                    table[mode] = (decisions(canon), decisions(fused))
            else:
                if label == "recompute" and mode == "train":  # the producer checks run in a forward
                    for m in (canon, fused):
                        forward_loss(m, data)[1].mean().backward()
                    from regather.megatron.dense.model import adapters

                    table["last"] = ({p: str(a.last_decision) for p, a in adapters(canon).items()},
                                     {p: str(a.last_decision) for p, a in adapters(fused).items()})
                table[mode] = (decisions(canon), decisions(fused))
        out[label] = table
    # one member falls back on its own: adapter_k's LoRA-A frozen in both models; the other two
    # members of linear_qkv share one gather; the logged reason names the member
    handler = _Messages()
    logger = logging.getLogger("regather")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        runs = {}
        for variant in ("gather", "early"):
            model = canonical(variant)
            for layer in model.decoder.layers:
                layer.self_attention.linear_qkv.adapter["adapter_k"].linear_in.weight.requires_grad_(False)
            pool = spy_on(model)
            res = measure(model)
            res["decisions"] = decisions(model)
            res["pool"] = pool.snapshot()
            runs[variant] = res
        out["frozen_k"] = runs
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    out["frozen_k_messages"] = [m for m in handler.messages if "linear_k" in m]
    return out


def state_dict_runs() -> dict:
    """Keys of one wrapper; every strategy's state dict loaded strictly into every other."""
    out = {}
    data = batch()
    srcs = {v: canonical(v) for v in ("gather", "early", "lowrank")}
    out["keys"] = [k for k in srcs["early"].state_dict() if k.startswith(f"decoder.layers.0.{QKV}.")]
    out["fc1_keys"] = [k for k in srcs["early"].state_dict() if k.startswith(f"decoder.layers.0.{FC1}.")]
    for v, m in srcs.items():
        out[("logits", v)] = forward_loss(m, data)[0].detach()
    for s, src in srcs.items():
        sd = src.state_dict()
        for d in srcs:
            dst = canonical(d, seed=OTHER_SEED)
            before = forward_loss(dst, data)[0].detach()
            dst.load_state_dict(sd, strict=True)
            written = dst.state_dict()
            out[(s, d)] = {"before": before, "after": forward_loss(dst, data)[0].detach(),
                           "same_state_dict": list(written) == list(sd) and all(
                               torch.equal(written[k], sd[k]) for k in sd if isinstance(sd[k], torch.Tensor))}
    return out


def merge_runs() -> dict:
    from regather.megatron.dense.model import adapters
    from regather.megatron.merge import merge, unmerge

    out = {}
    data = batch()
    for keep in (False, True):
        model = canonical("early")
        weights = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        before = forward_loss(model, data)[0].detach()
        paths = merge(model, keep_original=keep)
        merged = forward_loss(model, data)[0].detach()
        left = len(adapters(model))
        unmerge(model)
        after = forward_loss(model, data)[0].detach()
        restored = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
        out[keep] = {"paths": paths, "before": before, "merged": merged, "after": after, "adapters_when_merged": left,
                     "adapters_after": len(adapters(model)),
                     "weight_err": max((restored[n] - w).abs().max().item() for n, w in weights.items()),
                     "exact_restore": all(torch.equal(restored[n], w) for n, w in weights.items())}
    return out


def dist_checkpoint_save(root: str) -> dict:
    """Save at TP=2 (early regather), reload at TP=2 into gather / lowrank models of other weights;
    the sharded layout of one layer."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    data = batch()
    saver = canonical("early")
    path = os.path.join(root, "canonical_tp2")
    if dist.get_rank() == 0:
        os.makedirs(path)
    dist.barrier()
    dist_checkpointing.save(saver.sharded_state_dict(), path)
    dist.barrier()
    out = {"path": path, "weights": full_params(saver), "logits": full(forward_loss(saver, data)[0].detach(), -1),
           "logits64": full(forward_loss(fp64_twin(saver), data)[0].detach(), -1)}
    layout = {}
    for key, v in saver.sharded_state_dict().items():
        if key.startswith("decoder.layers.0.") and ".adapter." in key and key.endswith(".weight"):
            layout[key] = {"type": type(v).__name__, "key": v.key,
                           **({"global_shape": tuple(v.global_shape), "global_offset": tuple(v.global_offset)}
                              if isinstance(v, ShardedTensor) else {})}
    out["layout"] = layout
    for variant in ("gather", "lowrank"):
        model = canonical(variant, seed=OTHER_SEED)
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path), strict=True)
        out[("tp2", variant)] = {"weights": full_params(model),
                                 "logits": full(forward_loss(model, data)[0].detach(), -1)}
    return out


def not_gated_run(tp: int) -> dict:
    """A non-gated MLP with CanonicalLoRA on linear_fc1_up / linear_fc1_gate: the refusal, and
    that nothing changed before it (modules, requires_grad, the RNG the adapters draw from)."""
    from regather import CanonicalLoRA

    model = base(tp, torch.float32, False, NOT_GATED, True, SHAPE)
    modules = [(n, type(m).__name__) for n, m in model.named_modules()]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    rng = torch.get_rng_state()
    peft = CanonicalLoRA(target_modules=["linear_q", "linear_fc1_up", "linear_fc1_gate"], dim=DIM, alpha=ALPHA)
    try:
        peft(model, training=True)
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"error": error,
            "unchanged": [(n, type(m).__name__) for n, m in model.named_modules()] == modules
            and {n for n, p in model.named_parameters() if p.requires_grad} == trainable
            and torch.equal(torch.get_rng_state(), rng)}


def shape_check_run() -> dict:
    """install_shape_checks on CanonicalLoRA's split wrappers: a forward with equal shapes passes;
    one with a shorter sequence on rank 1 only is named before any collective runs."""
    from regather.megatron.dense.model import install_shape_checks

    model = canonical("early")
    handles = install_shape_checks(model)
    forward_loss(model, batch())
    qkv = model.decoder.layers[0].self_attention.linear_qkv  # a LoRALinearSplit (three adapters)
    local = SHAPE.seq_length // TP - (2 if dist.get_rank() == 1 else 0)  # rank 1: 2 tokens fewer
    try:
        qkv(torch.randn(local, MICRO_BATCH, SHAPE.hidden_size))
        mismatch = None
    except Exception as exc:
        mismatch = f"{type(exc).__name__}: {exc}"
    return {"handles": len(handles), "wrapper": type(qkv).__name__, "mismatch": mismatch}


# -- the cases at TP=1 ----------------------------------------------------------------------------


def _interleave_qkv_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Per-projection ``[o_x, c]`` rows -> megatron's fused qkv rows: per query group, its query
    heads, then its key head, then its value head (``head_dim`` rows each). Written out here, apart
    from regather's own placement code."""
    groups = SHAPE.num_query_groups
    heads_per_group = SHAPE.num_attention_heads // groups
    head_dim = SHAPE.hidden_size // SHAPE.num_attention_heads
    c = q.shape[-1]
    return torch.cat([q.reshape(groups, heads_per_group * head_dim, c), k.reshape(groups, head_dim, c),
                      v.reshape(groups, head_dim, c)], dim=1).reshape(-1, c)


def fused_reference_weights(canon: dict) -> dict:
    """Full CanonicalLoRA weights -> the weights of one fused LoRA of rank 3r computing the same
    function: ``A_f = [A_q; A_k; A_v]``, ``B_f`` block-diagonal with each projection's rows placed
    where megatron's fused layout has them; gate/up: gate rows then up rows; proj/fc2 padded."""
    r = DIM
    out = {}
    for layer in range(SHAPE.num_layers):
        p = f"decoder.layers.{layer}."
        a = lambda wrapper, key: canon[f"{p}{wrapper}.adapter.{key}linear_in.weight"]
        b = lambda wrapper, key: canon[f"{p}{wrapper}.adapter.{key}linear_out.weight"]
        z = torch.zeros_like
        # qkv: the three B's in the three column blocks, rows interleaved by query group
        bq, bk, bv = (b(QKV, f"adapter_{x}.") for x in "qkv")
        out[f"{p}{QKV}.adapter.linear_in.weight"] = torch.cat([a(QKV, f"adapter_{x}.") for x in "qkv"])
        out[f"{p}{QKV}.adapter.linear_out.weight"] = torch.cat(
            [_interleave_qkv_rows(bq, z(bk), z(bv)), _interleave_qkv_rows(z(bq), bk, z(bv)),
             _interleave_qkv_rows(z(bq), z(bk), bv)], dim=1)
        ag, au = a(FC1, "adapter_gate."), a(FC1, "adapter_up.")
        bg, bu = b(FC1, "adapter_gate."), b(FC1, "adapter_up.")
        out[f"{p}{FC1}.adapter.linear_in.weight"] = torch.cat([ag, au, z(ag)])
        out[f"{p}{FC1}.adapter.linear_out.weight"] = torch.cat(
            [torch.cat([bg, z(bg), z(bg)], 1), torch.cat([z(bu), bu, z(bu)], 1)])
        for wrapper in ("self_attention.linear_proj", "mlp.linear_fc2"):
            ai, bo = a(wrapper, ""), b(wrapper, "")
            out[f"{p}{wrapper}.adapter.linear_in.weight"] = torch.cat([ai, z(ai), z(ai)])
            out[f"{p}{wrapper}.adapter.linear_out.weight"] = torch.cat([bo, z(bo), z(bo)], 1)
    assert r * 3 == next(iter(out.values())).shape[0]
    return out


def canonical_grads_from_fused(fused: dict) -> dict:
    """The fused reference's gradients cut back into the canonical parameters' blocks."""
    r = DIM
    groups = SHAPE.num_query_groups
    hpg = SHAPE.num_attention_heads // groups
    hd = SHAPE.hidden_size // SHAPE.num_attention_heads
    ffn = SHAPE.ffn_hidden_size
    out = {}
    for layer in range(SHAPE.num_layers):
        p = f"decoder.layers.{layer}."
        a, b = fused[f"{p}{QKV}.adapter.linear_in.weight"], fused[f"{p}{QKV}.adapter.linear_out.weight"]
        rows = b.reshape(groups, hpg + 2, hd, 3 * r)
        parts = {"q": rows[:, :hpg, :, :r], "k": rows[:, hpg:hpg + 1, :, r:2 * r], "v": rows[:, hpg + 1:, :, 2 * r:]}
        for i, x in enumerate("qkv"):
            out[f"{p}{QKV}.adapter.adapter_{x}.linear_in.weight"] = a[i * r:(i + 1) * r]
            out[f"{p}{QKV}.adapter.adapter_{x}.linear_out.weight"] = parts[x].reshape(-1, r)
        a, b = fused[f"{p}{FC1}.adapter.linear_in.weight"], fused[f"{p}{FC1}.adapter.linear_out.weight"]
        out[f"{p}{FC1}.adapter.adapter_gate.linear_in.weight"] = a[:r]
        out[f"{p}{FC1}.adapter.adapter_up.linear_in.weight"] = a[r:2 * r]
        out[f"{p}{FC1}.adapter.adapter_gate.linear_out.weight"] = b[:ffn, :r]
        out[f"{p}{FC1}.adapter.adapter_up.linear_out.weight"] = b[ffn:, r:2 * r]
        for wrapper in ("self_attention.linear_proj", "mlp.linear_fc2"):
            out[f"{p}{wrapper}.adapter.linear_in.weight"] = fused[f"{p}{wrapper}.adapter.linear_in.weight"][:r]
            out[f"{p}{wrapper}.adapter.linear_out.weight"] = fused[f"{p}{wrapper}.adapter.linear_out.weight"][:, :r]
    return out


def tp1_runs(tp2: dict, root_ckpt: dict) -> dict:
    """TP=1: CanonicalLoRA with the TP=2 models' full weights; the fused rank-3r reference; the
    subsets; the TP=2 distributed checkpoint loaded here."""
    from megatron.core import dist_checkpointing

    out = {}
    data = batch()
    model = canonical("gather", tp=1)
    load_full(model, tp2["weights"])
    res = measure(model)
    out["canonical"] = {k: res[k] for k in ("logits", "loss", "input_grad", "grads")}
    out["canonical_weights_equal"] = all(torch.equal(p.detach(), tp2["weights"][n])
                                         for n, p in model.named_parameters() if ".adapter." in n)
    reference = fused_lora("gather", tp=1, dim=3 * DIM, alpha=3 * ALPHA)
    load_full(reference, fused_reference_weights(tp2["weights"]))
    ref = measure(reference)
    out["fused_reference"] = {"logits": ref["logits"], "loss": ref["loss"], "input_grad": ref["input_grad"],
                              "grads": canonical_grads_from_fused(ref["grads"])}
    out["subsets"] = {}
    for label, targets in SUBSETS.items():
        sub = canonical("gather", tp=1, targets=targets)
        load_full(sub, tp2["subset_weights"][label])
        r = measure(sub)
        out["subsets"][label] = {k: r[k] for k in ("logits", "loss", "input_grad", "grads")}
    model = canonical("early", tp=1, seed=OTHER_SEED)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), root_ckpt["path"]), strict=True)
    out["ckpt"] = {"weights": {n: p.detach().clone() for n, p in model.named_parameters() if ".adapter." in n},
                   "logits": forward_loss(model, data)[0].detach()}
    return out


# -- the spawn -------------------------------------------------------------------------------------


def canonical_suite(rank: int, world_size: int, root: str) -> dict:
    import megatron.core
    from tests.harness.megatron_ckpt import enable_dist_checkpointing_cpu

    enable_dist_checkpointing_cpu()
    parallel(TP)
    res: dict = {"rank": rank, "version": megatron.core.__version__}
    _case(res, "parity", parity_runs)
    _case(res, "recompute", recompute_runs)
    _case(res, "subsets", subset_runs)
    _case(res, "schedules", schedule_runs)
    _case(res, "decisions", decision_runs)
    _case(res, "state_dict", state_dict_runs)
    _case(res, "merge", merge_runs)
    _case(res, "ckpt", lambda: dist_checkpoint_save(root))
    _case(res, "not_gated_tp2", lambda: not_gated_run(TP))
    _case(res, "shape_checks", shape_check_run)
    tp2 = {"weights": full_params(canonical("early")), "subset_weights": {}}
    if "error" not in res["subsets"]:
        tp2["subset_weights"] = {label: r["gather"]["weights"] for label, r in res["subsets"].items()}
    parallel(1)
    _case(res, "tp1", lambda: tp1_runs(tp2, res["ckpt"]))
    _case(res, "not_gated_tp1", lambda: not_gated_run(1))
    return res
