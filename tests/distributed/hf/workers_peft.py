"""Rank bodies for HF PEFT export/import and merge/unmerge (GQA attention, gated MLP, TP=2)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from regather import LoRA, Strategy, adapters
from regather.tools.cpu.models import TinyGPT, build_gpt, gpt_batch, gpt_loss

SHAPE = TinyGPT(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=96, seq_length=16)


def gated_gpt(t, dtype=torch.float32):
    return build_gpt(SHAPE, t, True, dtype, seed=1234, gated_linear_unit=True, activation_func=F.silu)


def lora_model(t, strategy, seed=99, dtype=torch.float32, **kw):
    model = gated_gpt(t, dtype)
    torch.manual_seed(seed)
    return LoRA(dim=8, alpha=16, lora_B_init_method="normal", sequence_parallel_input_strategy=strategy,
                **kw)(model, training=True)


def logits(model, batch):
    inputs, _, position_ids, mask = batch
    with torch.no_grad():
        return model(inputs, position_ids, mask).detach()


def train(model, steps=2):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    for step in range(steps):
        opt.zero_grad()
        gpt_loss(model, gpt_batch(SHAPE, 2, seed=step)).backward()
        opt.step()
    return model


def peft_roundtrip(rank, t, out_dir):
    from regather.hf import export_peft, load_peft, read_peft

    res = {"exported": {}, "loaded": {}}
    batch = gpt_batch(SHAPE, 2, seed=7)
    trained = {}
    for st in Strategy:
        # lean on every strategy, gather too, so that the exports compare like for like (a lean row-parallel
        # adapter sums LoRA-B's weight gradient in another order than the classic gather path's,
        # docs/design.md §3.7)
        model = train(lora_model(t, st.value, lean_transients=True))
        d = os.path.join(out_dir, st.value)
        res["exported"][st.value] = export_peft(model, d, base_model_name_or_path="tiny-gpt")
        model.eval()
        trained[st.value] = logits(model, batch)
    res["trained_logits"] = trained
    tensors, config = read_peft(os.path.join(out_dir, "gather"))
    res["file_keys"] = sorted(tensors)
    res["file_shapes"] = {k: tuple(v.shape) for k, v in tensors.items()}
    res["config"] = config
    # load the gather-trained adapter into fresh models with every strategy
    for st in Strategy:
        fresh = lora_model(t, st.value, seed=5)
        loaded = load_peft(fresh, os.path.join(out_dir, "gather"))
        fresh.eval()
        res["loaded"][st.value] = {"paths": loaded, "logits": logits(fresh, batch)}
    # independent check of the q/k/v split with megatron's own get_query_key_value_tensors
    model = lora_model(t, "gather", seed=5)
    load_peft(model, os.path.join(out_dir, "gather"))
    attn = model.decoder.layers[0].self_attention
    ad = attn.linear_qkv.adapter
    x_local = torch.randn(SHAPE.seq_length // t, 2, SHAPE.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        q1, k1, v1 = attn.get_query_key_value_tensors(x_local)[:3]
        scale, ad.scale = ad.scale, 0.0
        q0, k0, v0 = attn.get_query_key_value_tensors(x_local)[:3]
        ad.scale = scale
    x_full = torch.cat([torch.empty_like(x_local) for _ in range(t)])
    dist.all_gather_into_tensor(x_full, x_local.contiguous())
    p = "base_model.model.model.layers.0.self_attn"
    heads, groups, hd = SHAPE.num_attention_heads, SHAPE.num_query_groups, SHAPE.hidden_size // SHAPE.num_attention_heads
    expect = {}
    for name, n in (("q", heads), ("k", groups), ("v", groups)):
        a, b = tensors[f"{p}.{name}_proj.lora_A.weight"], tensors[f"{p}.{name}_proj.lora_B.weight"]
        delta = (x_full @ a.t() @ b.t()) * scale  # HF PEFT: B(A(x)) * alpha / r
        delta = delta.view(x_full.shape[0], x_full.shape[1], n, hd).chunk(t, dim=2)[rank]
        expect[name] = delta
    res["qkv_check"] = {"q": (q1 - q0, expect["q"]), "k": (k1 - k0, expect["k"]), "v": (v1 - v0, expect["v"])}
    return res


def merge_roundtrip(rank, t):
    from regather.megatron.merge import merge, merged, unmerge

    res = {}
    batch = gpt_batch(SHAPE, 2, seed=7)
    for st in Strategy:
        model = train(lora_model(t, st.value), steps=1)
        model.eval()
        base = {n: p.detach().clone() for n, p in model.named_parameters() if ".to_wrap." in n}
        before = logits(model, batch)
        paths = merge(model)
        merged_logits = logits(model, batch)
        n_lora = sum(1 for m in model.modules() if type(m).__name__ == "LoRALinear")
        back = unmerge(model)
        after = logits(model, batch)
        weight_err = max((p.detach() - base[n]).abs().max().item()
                         for n, p in model.named_parameters() if n in base)
        snap = {n: p.detach().clone() for n, p in model.named_parameters() if n in base}
        merge(model, keep_original=True)
        unmerge(model)
        exact = all(torch.equal(p.detach(), snap[n]) for n, p in model.named_parameters() if n in base)
        res[st.value] = {"before": before, "merged": merged_logits, "after": after, "paths": paths,
                         "unmerged": back, "lora_left_when_merged": n_lora, "weight_err": weight_err,
                         "exact_restore": exact, "still_merged": merged(model),
                         "lora_after": len(adapters(model))}
    # dropout in training mode: refused before anything changes
    model = lora_model(t, "regather", dropout=0.1)
    keys = sorted(model.state_dict())
    try:
        merge(model)
        res["dropout_error"] = None
    except ValueError as exc:
        res["dropout_error"] = str(exc)
    res["dropout_unchanged"] = keys == sorted(model.state_dict()) and len(adapters(model)) == 8
    return res
