"""The training loop: the micro-batches of each step through ``get_forward_backward_func()``, and what a test compares.

:func:`run_steps` returns per-step losses, fp32 ``main_grad`` s, parameters, and the LoRA
weights each adapter's forward actually read. With the distributed optimizer only a rank's
shard of ``main_grad`` is reduced; :func:`reduced_main_grads` all-gathers the shards into full
copies to compare.
"""

from __future__ import annotations

from typing import Any

import torch

from regather.tools.cpu.models import gpt_batch
from tests.harness.megatron_train.spec import TrainSpec


def step_batches(spec: TrainSpec, step: int, dp_rank: int) -> list:
    """The micro-batches of one step: different per DP replica, the same on its TP/PP ranks."""
    return [gpt_batch(spec.shape, spec.micro_batch, seed=10_000 * step + 100 * i + dp_rank)
            for i in range(spec.num_microbatches)]


def _forward_step(data_iterator, model):
    tokens, labels, position_ids, mask = next(data_iterator)
    output = model(tokens, position_ids, mask, labels=labels)

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def _unwrap(chunk):
    return chunk.module if hasattr(chunk, "module") else chunk


def _trainable(model: list) -> dict:
    return {f"chunk{i}.{n}": p for i, m in enumerate(model) for n, p in _unwrap(m).named_parameters()
            if p.requires_grad}


def _sharded_views(model: list) -> dict:
    """name -> function giving a tensor in the Bridge (rank-sharded) layout.

    A low-rank adapter's LoRA-A is replicated ``[r, h]``; its TP rank's rows are what the
    gather path holds as ``[r/t, h]``, so results are recorded in that layout to compare."""
    from regather.core.strategies.lowrank import shard_rows
    from regather.megatron.dense.model import adapters

    views = {}
    for i, chunk in enumerate(model):
        for path, adapter in adapters(_unwrap(chunk)).items():
            if adapter.replicated_a:
                rows = shard_rows(adapter.dim, adapter.tp_rank, adapter.tp_size)
                views[f"chunk{i}.{path}.adapter.linear_in.weight"] = lambda t, rows=rows: t[rows]
    return views


def _snapshot(tensors: dict, views: dict) -> dict:
    return {n: views.get(n, _same)(t.detach()).clone() for n, t in tensors.items()}


def _same(t):
    return t


def reduced_main_grads(model: list, named: dict) -> dict:
    """name -> the DP-reduced gradient, full size, after ``finalize_model_grads``.

    Without the distributed optimizer that is ``main_grad`` itself (all-reduced). With it,
    megatron reduce-scatters each bucket: a rank's ``main_grad`` is reduced only inside its
    own shard of the bucket and holds its local partial sum elsewhere, so the shards are
    all-gathered over the bucket's DP group (into copies; training state untouched) to give
    every rank the full reduced gradient, comparable across runs whose bucket layouts differ.
    """
    import torch.distributed as dist
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    grads = {n: p.main_grad for n, p in named.items()}
    by_param = {id(p): n for n, p in named.items()}
    for chunk in model:
        if not chunk.ddp_config.use_distributed_optimizer:
            continue
        for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            size = group.intra_distributed_optimizer_instance_size
            rank = group.intra_distributed_optimizer_instance_rank
            for bucket in group.buckets:
                full = torch.empty_like(bucket.grad_data)
                local = shard_buffer(bucket.grad_data, size)[rank].contiguous()
                dist.all_gather_into_tensor(full, local, group=group.intra_distributed_optimizer_instance_group)
                base = bucket.grad_data.data_ptr()
                for param in bucket.params:
                    offset = (param.main_grad.data_ptr() - base) // param.main_grad.element_size()
                    grads[by_param[id(param)]] = full[offset:offset + param.numel()].view(param.shape)
    return grads


def _record_used_weights(model: list, store: dict) -> list:
    """Forward hooks on every adapter: the LoRA weights its forward read, per call."""
    from regather.core.strategies.lowrank import shard_rows
    from regather.megatron.dense.model import adapters

    handles = []
    for i, chunk in enumerate(model):
        for path, adapter in adapters(_unwrap(chunk)).items():
            key = f"chunk{i}.{path}"

            def hook(module, args, output, key=key):
                a = module.linear_in.weight.detach()
                if module.replicated_a:  # Bridge layout, as the gather path holds it
                    a = a[shard_rows(module.dim, module.tp_rank, module.tp_size)]
                store.setdefault(key, []).append((a.clone(), module.linear_out.weight.detach().clone()))

            handles.append(adapter.register_forward_hook(hook))
    return handles


def _coords() -> dict:
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
            "dp": ps.get_data_parallel_rank(), "last_stage": ps.is_pipeline_last_stage(ignore_virtual=True),
            "ep": ps.get_expert_model_parallel_rank(), "etp": ps.get_expert_tensor_parallel_rank(),
            "edp": ps.get_expert_data_parallel_rank()}



def run_steps(spec: TrainSpec, model: list, optimizer, config) -> dict:
    """``spec.steps`` steps on the built, wrapped ``model`` (see
    :func:`tests.harness.megatron_train.build.train` for what it returns)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from regather.megatron.dense.model import adapters

    named = _trainable(model)
    views = _sharded_views(model)
    coords = _coords()
    out: dict[str, Any] = {"coords": coords, "loss": [], "main_grad": [], "param": [], "used": [],
                           "used_consistent": [], "grad_norm": []}
    out["initial_param"] = _snapshot(named, views)
    used: dict = {}
    handles = _record_used_weights(model, used)
    # Megatron-LM (training.py, train()): with the distributed optimizer and overlapped param
    # gather, the forward pre-hooks (and param_sync_func) are off for the first step and on after.
    prehooks = spec.ddp.use_distributed_optimizer and spec.ddp.overlap_param_gather
    param_sync_func = config.param_sync_func
    if prehooks:
        for m in model:
            m.disable_forward_pre_hook(param_sync=False)
        config.param_sync_func = None
    forward_backward = get_forward_backward_func()
    out["schedule"] = forward_backward.__name__
    out["buckets"] = [sum(len(buffer.buckets) for buffer in m.buffers) for m in model]
    # which trainable parameters DDP put in its expert-parallel buffers (reduced over expert DP)
    by_param = {id(p): n for n, p in named.items()}
    out["expert_buffer_params"] = sorted(by_param[id(p)] for i, m in enumerate(model)
                                         for buffer in getattr(m, "expert_parallel_buffers", [])
                                         for p in buffer.params if id(p) in by_param)
    out["layers"] = [[layer.layer_number for layer in _unwrap(m).decoder.layers] for m in model]
    for step in range(spec.steps):
        batches = step_batches(spec, step, coords["dp"])
        iters = [iter(batches) for _ in model]
        for m in model:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        used.clear()
        reduced = forward_backward(
            forward_step_func=_forward_step,
            data_iterator=iters if len(model) > 1 else iters[0],
            model=model if len(model) > 1 else model[0],
            num_microbatches=spec.num_microbatches,
            seq_length=spec.shape.seq,
            micro_batch_size=spec.micro_batch,
            forward_only=False,
        )
        out["loss"].append([r["loss"].item() for r in reduced] if coords["last_stage"] else None)
        out["main_grad"].append(_snapshot(reduced_main_grads(model, named), views))
        update_ok, grad_norm, _ = optimizer.step()
        if not update_ok:
            raise RuntimeError(f"step {step}: megatron's optimizer skipped the update")
        out["grad_norm"].append(float(grad_norm) if grad_norm is not None else None)
        out["param"].append(_snapshot(named, views))
        out["used"].append({k: v[0] for k, v in used.items()})
        out["used_consistent"].append({k: all(torch.equal(a, v[0][0]) and torch.equal(b, v[0][1]) for a, b in v)
                                       for k, v in used.items()})
        if prehooks and step == 0:
            for m in model:
                m.enable_forward_pre_hook()
            config.param_sync_func = param_sync_func
    if prehooks:  # Megatron-LM before eval / checkpointing: hooks off, params synchronised
        for m in model:
            m.disable_forward_pre_hook(param_sync=True)
    out["final_param"] = _snapshot(named, views)
    for h in handles:
        h.remove()
    out["decisions"] = {f"chunk{i}.{path}": str(a.last_decision)
                        for i, m in enumerate(model) for path, a in adapters(_unwrap(m)).items()}
    return out
