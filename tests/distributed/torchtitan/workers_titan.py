"""Rank bodies for the tests against the real torchtitan 0.3.0 (tests/distributed/torchtitan): each builds models
with the harness (regather.tools.cpu.torchtitan_models) and returns what the tests compare, one spawn per file."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from regather.tools.cpu import torchtitan_models as H

# the runs of the llama3 comparison: name -> regather's fields (None: torchtitan's own converter)
LLAMA3_RUNS = {
    "gather": dict(sequence_parallel_input_strategy="gather"),
    "regather": dict(sequence_parallel_input_regather=True),
    "regather-late": dict(sequence_parallel_input_strategy="regather", early_regather=False),
    "gather+recompute": dict(sequence_parallel_input_strategy="gather", recompute_adapter_inputs=True),
    "regather+recompute": dict(sequence_parallel_input_strategy="regather", recompute_adapter_inputs=True),
    "lowrank": dict(sequence_parallel_input_strategy="lowrank"),
    "lowrank+recompute": dict(sequence_parallel_input_strategy="lowrank", recompute_adapter_inputs=True),
}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(dict(level=record.levelno, message=record.getMessage(),
                                 what=getattr(record, "regather_what", None),
                                 reason=getattr(record, "regather_reason", None),
                                 adapters=getattr(record, "regather_adapters", ())))


def _capture_logs() -> _Records:
    handler = _Records()
    logger = logging.getLogger("regather")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    return handler


converter = H.converter  # torchtitan's LoRAConverter.Config (fields None) or regather's


def measure(model, dtype=None) -> dict:
    """One step of ``model``: loss, bytes (total and per label), collectives, LoRA gradients and,
    for a regather model, its decisions."""
    from regather.torchtitan import decisions

    loss, saved, comm = H.step(model, dtype=dtype)
    return dict(loss=loss, saved=saved.total, adapter_input=saved.of("adapter_input"), comm=comm,
                grads=H.lora_grads(model), decisions={p: str(d) for p, d in decisions(model).items()},
                decision_objects=decisions(model))


def llama3_suite(rank, world_size):
    """llama3 debugmodel at TP2 + SP: the frozen model, torchtitan's LoRA, every regather variant,
    and torchtitan's LoRA in fp64 (lowrank's reference); the fallback log's records."""
    pd = H.parallel_dims()
    logs = _capture_logs()
    out = {"frozen": measure(H.build(H.model_config(converter(None, target_modules=[])), pd))}
    out["torchtitan"] = measure(H.build(H.model_config(converter(None)), pd))
    for name, fields in LLAMA3_RUNS.items():
        logs.records.clear()
        out[name] = measure(H.build(H.model_config(converter(fields)), pd))
        out[name]["logs"] = list(logs.records)
    fp64 = H.build(H.model_config(converter(None)), pd, dtype=torch.float64)
    out["torchtitan-fp64"] = measure(fp64, dtype=torch.float64)
    return out


# -- layouts: qwen3, sequence parallelism off, eval / no_grad, activation checkpointing ----------

def _forward_only(model):
    inp, _ = H.tokens()
    return model(inp, H.positions()).full_tensor()


def layouts_suite(rank, world_size):
    """qwen3 (dense) against torchtitan's LoRA; llama3 with SP off, with FullAC, in eval and under
    no_grad (the classic path, bit-identical, with the reasons); the hand-parallelized model."""
    from torchtitan.distributed.activation_checkpoint import FullAC

    from regather.torchtitan import decisions

    pd = H.parallel_dims()
    logs = _capture_logs()
    out = {}
    for name, fields in (("frozen", None), ("torchtitan", None), ("regather", LLAMA3_RUNS["regather"]),
                         ("regather+recompute", LLAMA3_RUNS["regather+recompute"])):
        conv = converter(None, target_modules=[]) if name == "frozen" else converter(fields)
        out[f"qwen3/{name}"] = measure(H.build(H.model_config(conv, model="qwen3"), pd))
    for sp in (False,):
        out["nosp/torchtitan"] = measure(H.build(H.model_config(converter(None), enable_sp=sp), pd))
        logs.records.clear()
        out["nosp/regather"] = measure(H.build(H.model_config(converter(LLAMA3_RUNS["regather+recompute"]),
                                                              enable_sp=sp), pd))
        out["nosp/regather"]["logs"] = list(logs.records)

    def full_ac(model):
        model.parallelize(pd)
        FullAC.Config().build().apply(model)
        return model

    out["ac/torchtitan"] = measure(H.build(H.model_config(converter(None)), pd, parallelize=full_ac))
    out["ac/regather"] = measure(H.build(H.model_config(converter(LLAMA3_RUNS["regather+recompute"])), pd,
                                         parallelize=full_ac))
    modes = {}
    for name, fields in (("torchtitan", None), ("regather", LLAMA3_RUNS["regather"])):
        model = H.build(H.model_config(converter(fields)), pd)
        with torch.no_grad():
            modes[f"no_grad/{name}"] = _forward_only(model)
            no_grad = decisions(model) if fields else None
        model.eval()
        modes[f"eval/{name}"] = _forward_only(model)
        if fields:
            modes["decisions"] = dict(no_grad={p: str(d) for p, d in no_grad.items()},
                                      eval={p: str(d) for p, d in decisions(model).items()})
    out["modes"] = modes
    out["hand"] = hand_suite(rank, world_size)
    return out


# -- a model parallelized by hand ------------------------------------------------------------------

D, FF = 256, 768


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(D)
        self.w1 = torch.nn.Linear(D, FF, bias=False)
        self.w3 = torch.nn.Linear(D, FF, bias=False)
        self.w2 = torch.nn.Linear(FF, D, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block() for _ in range(H.LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _hand_model(mesh, fields: dict | None, parallel: bool = True):
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from regather.torchtitan import apply_lora

    torch.manual_seed(0)
    model = _Net()
    if parallel:
        for block in model.layers:
            parallelize_module(block, mesh, {"norm": SequenceParallel(),
                                             "w1": ColwiseParallel(input_layouts=Shard(1)),
                                             "w3": ColwiseParallel(input_layouts=Shard(1)),
                                             "w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
    if fields is not None:
        apply_lora(model, ["w1", "w2", "w3"], rank=8, alpha=16.0, **fields)
    else:
        for p in model.parameters():  # SequenceParallel re-registers the norms' weights as trainable
            p.requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = H.value_for(name, tuple(p.shape))
            if hasattr(p, "device_mesh"):
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
            else:
                p.copy_(full)
    return model


def hand_suite(rank, world_size):
    """The hand-parallelized model: frozen, gather, regather (+recompute), lowrank; loss, LoRA and
    input gradients, bytes, decisions; and a model left unparallelized (plain weights)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from regather.core.accounting import SavedBytes
    from regather.torchtitan import decisions

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    x_full = torch.randn(H.B, H.S, D, generator=torch.Generator().manual_seed(7))
    out = {}
    runs = {"frozen": None, "gather": dict(sequence_parallel_input_strategy="gather"),
            "regather": dict(sequence_parallel_input_strategy="regather"),
            "regather+recompute": dict(sequence_parallel_input_strategy="regather", recompute_adapter_inputs=True),
            "lowrank": dict(sequence_parallel_input_strategy="lowrank")}
    for name, fields in runs.items():
        model = _hand_model(mesh, fields)
        x = x_full.chunk(world_size, dim=1)[rank].clone().requires_grad_(True)
        with SavedBytes.for_model(model) as saved:
            y = model(DTensor.from_local(x, mesh, [Shard(1)]))
        loss = (y.full_tensor() ** 2).mean()
        loss.backward()
        out[name] = dict(loss=loss.detach(), saved=saved.total, dx=x.grad.clone(),
                         grads={n: p.grad.full_tensor() for n, p in model.named_parameters() if p.requires_grad},
                         decisions={p: str(d) for p, d in decisions(model).items()})
    plain = _hand_model(mesh, runs["regather"], parallel=False)
    plain(x_full.clone().requires_grad_(True)).sum().backward()
    out["plain"] = {p: str(d) for p, d in decisions(plain).items()}
    dist.barrier()
    return out


# -- training steps and checkpoints ----------------------------------------------------------------

STEPS = 3
TRAINED = {"torchtitan": None, "gather": LLAMA3_RUNS["gather"], "regather": LLAMA3_RUNS["regather"],
           "regather+recompute": LLAMA3_RUNS["regather+recompute"], "lowrank": LLAMA3_RUNS["lowrank"]}


def _train(model) -> dict:
    """``STEPS`` steps through torchtitan's own optimizer section of ``Trainer.train_step``:
    ``clip_grad_norm_``, the AdamW ``OptimizersContainer``, the LR schedulers."""
    from torch.distributed.tensor import DTensor, Replicate
    from torchtitan.components.optimizer import LRSchedulersContainer

    from regather.tools.cpu.torchtitan_train import clip_and_step
    from regather.tools.cpu.torchtitan_train import optimizers as adamw

    optimizers = adamw(model, lr=8e-4)
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                              min_lr_factor=0.0).build(optimizers=optimizers, training_steps=10)
    losses = []
    for _ in range(STEPS):
        optimizers.zero_grad()
        losses.append(H.step(model)[0])
        clip_and_step(model, optimizers, 1.0)
        schedulers.step()
    weights = {n: p.detach().full_tensor() for n, p in model.named_parameters() if p.requires_grad}
    drift = 0.0  # replicated LoRA weights must stay the same on every TP rank
    for p in model.parameters():
        if p.requires_grad and isinstance(p, DTensor) and tuple(p.placements) == (Replicate(),):
            local = p.detach().to_local().clone()
            every = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(every, local)
            drift = max(drift, max((e - local).abs().max().item() for e in every))
    return dict(losses=torch.stack(losses), weights=weights, drift=drift)


def _lora_state(model) -> dict:
    return {k: v for k, v in model.state_dict().items() if "lora_" in k}


def _full(sd) -> dict:
    return {k: v.full_tensor() for k, v in sd.items()}


def checkpoints(pd, directory: str) -> dict:
    """torchtitan's LoRA state dict into regather's model under every strategy (``strict=True``)
    and back, and through torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp

    titan = H.build(H.model_config(converter(None)), pd)
    ref = _full(_lora_state(titan))
    dcp.save(titan.state_dict(), checkpoint_id=directory)
    out = {"keys": sorted(ref)}
    for name in ("gather", "regather", "lowrank"):
        fields = dict(sequence_parallel_input_strategy=name)
        ours = H.build(H.model_config(converter(fields)), pd)
        for p in ours.parameters():  # other values first, so that a load that does nothing shows
            if p.requires_grad:
                with torch.no_grad():
                    p.zero_()
        strict = ours.load_state_dict(titan.state_dict(), strict=True)
        into = _full(_lora_state(ours))
        via_dcp = H.build(H.model_config(converter(fields)), pd)
        sd = via_dcp.state_dict()
        dcp.load(sd, checkpoint_id=directory)
        via_dcp.load_state_dict(sd, strict=True)
        back = H.build(H.model_config(converter(None)), pd)
        back.load_state_dict(ours.state_dict(), strict=True)
        out[name] = dict(keys=sorted(into), missing=list(strict.missing_keys), unexpected=list(strict.unexpected_keys),
                         loaded=all(torch.equal(into[k], ref[k]) for k in ref),
                         dcp=all(torch.equal(v, ref[k]) for k, v in _full(_lora_state(via_dcp)).items()),
                         back=all(torch.equal(v, ref[k]) for k, v in _full(_lora_state(back)).items()))
    return out


def training_suite(rank, world_size, directory: str):
    """A few optimizer steps for torchtitan's LoRA and regather's variants; checkpoints."""
    pd = H.parallel_dims()
    out = {name: _train(H.build(H.model_config(converter(fields)), pd)) for name, fields in TRAINED.items()}
    out["checkpoints"] = checkpoints(pd, directory)
    return out


# -- FSDP2 x TP through torchtitan's parallelize_llama -------------------------------------------

def fsdp_suite(rank, world_size):
    """parallelize_llama (TP via Module.parallelize, then FSDP2 per block and root) at
    dp_shard = world_size / 2 x TP2: frozen, torchtitan's LoRA, regather (+recompute)."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.llama3.parallelize import parallelize_llama

    from regather.tools.cpu.torchtitan_cpu import sum_reduction_for_gloo

    dp_shard = world_size // 2
    pd = H.parallel_dims(tp=2, dp_shard=dp_shard)

    def parallelize(model):
        parallelism = ParallelismConfig(tensor_parallel_degree=2, data_parallel_shard_degree=dp_shard,
                                        spmd_backend="partial_dtensor")
        model = parallelize_llama(model, parallel_dims=pd, training=TrainingConfig(mixed_precision_param="float32"),
                                  parallelism=parallelism, compile_config=CompileConfig(), ac_config=None,
                                  dump_folder="/tmp")
        sum_reduction_for_gloo(model)
        return model

    out = {}
    for name, fields in (("frozen", None), ("torchtitan", None), ("regather", LLAMA3_RUNS["regather"]),
                         ("regather+recompute", LLAMA3_RUNS["regather+recompute"])):
        conv = converter(None, target_modules=[]) if name == "frozen" else converter(fields)
        out[name] = measure(H.build(H.model_config(conv), pd, parallelize=parallelize))
    return out


# -- frozen stays frozen: which parameters train after parallelize, per backend --------------------

def _trains(model, pd) -> dict:
    """One step of ``model``: which parameters require grad, which torchtitan's optimizer holds,
    which got a gradient; the loss and the LoRA gradients."""
    from regather.tools.cpu.torchtitan_train import optimizers

    opts = optimizers(model, lr=1e-3)
    loss, _, _ = H.step(model, count=False)
    return dict(trainable=sorted(n for n, p in model.named_parameters() if p.requires_grad),
                optimized=sum(len(g["params"]) for opt in opts for g in opt.param_groups),
                with_grad=sorted(n for n, p in model.named_parameters() if p.grad is not None),
                loss=loss, grads={n: g for n, g in H.lora_grads(model).items() if "lora_" in n})


def frozen_suite(rank, world_size):
    """torchtitan 0.3.0's LoRA as it is (``keep_frozen=False``), with its #4267 applied, and
    regather's (recipe) on partial_dtensor and spmd_types through ``Module.parallelize`` (both
    torch versions), and on spmd_types through parallelize_llama with FSDP2 where torch runs it."""
    out = {}
    regather = LLAMA3_RUNS["regather+recompute"]
    for backend in ("partial_dtensor", "spmd_types"):
        pd = H.parallel_dims(backend=backend)
        out[backend] = {
            "torchtitan-0.3.0": _trains(H.build(H.model_config(converter(None)), pd, keep_frozen=False), pd),
            "torchtitan-4267": _trains(H.build(H.model_config(converter(None)), pd), pd),
            "regather": _trains(H.build(H.model_config(converter(regather)), pd, keep_frozen=False), pd),
        }
    if not H.fsdp_unsupported("spmd_types"):
        pd = H.parallel_dims(backend="spmd_types")
        fsdp = H.parallelize_llama(pd)
        out["spmd_types+fsdp"] = {
            "torchtitan-0.3.0": _trains(H.build(H.model_config(converter(None)), pd, fsdp, keep_frozen=False), pd),
            "regather": _trains(H.build(H.model_config(converter(regather)), pd, fsdp, keep_frozen=False), pd),
        }
    return out
