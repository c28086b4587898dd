"""Rank bodies for the torchtitan -> Hugging Face PEFT export test (test_titan_peft_hf.py).

One TP=2 run: torchtitan's llama3 debugmodel (2 layers) with regather's LoRAConverter, every
parameter from its name (LoRA-B non-zero, so the adapter changes the logits); its logits; the
export through ``regather.hf.export_peft``; the base weights through torchtitan's own
``Llama3StateDictAdapter.to_hf``. Rank 0 builds the HF twin (``LlamaForCausalLM`` from a config
with torchtitan's conventions: llama3 rope scaling, rms eps 1e-5, untied embeddings) and loads the
export with ``PeftModel.from_pretrained``.
"""

from __future__ import annotations

import copy
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist
from workers_titan import LLAMA3_RUNS

from regather.tools.cpu import torchtitan_models as H
from regather.tools.cpu.torchtitan_models import converter


def hf_config(config):
    """``LlamaConfig`` of a torchtitan llama3 config (the debugmodel's conventions)."""
    from transformers import LlamaConfig

    attention = config.layers[0].attention
    rope = attention.rope
    heads, kv = attention.n_heads, attention.n_kv_heads or attention.n_heads
    return LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.dim,
        intermediate_size=config.layers[0].feed_forward.w1.out_features, num_hidden_layers=len(config.layers),
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=config.dim // heads,
        max_position_embeddings=rope.max_seq_len, rms_norm_eps=config.norm.eps,
        rope_parameters={"rope_type": "llama3", "rope_theta": float(rope.theta), "factor": rope.scaling_factor,
                         "low_freq_factor": rope.low_freq_factor, "high_freq_factor": rope.high_freq_factor,
                         "original_max_position_embeddings": rope.original_max_position_embeddings},
        attention_bias=False, mlp_bias=False, attention_dropout=0.0, hidden_act="silu", tie_word_embeddings=False)


def _logits(model):
    with torch.no_grad():
        inp, _ = H.tokens()
        return model(inp, H.positions()).full_tensor()


def _swap_qk_halves(directory, out_dir):
    """The export with q_proj's LoRA-B rows left in torchtitan's rope layout (not permuted)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(directory, out_dir)
    path = os.path.join(out_dir, "adapter_model.safetensors")
    tensors = load_file(path)
    for key, t in tensors.items():
        if key.endswith("q_proj.lora_B.weight"):
            heads = 16
            n = t.shape[0]  # HF's layout back to the interleaved pairs
            tensors[key] = t.view(heads, 2, n // heads // 2, -1).transpose(1, 2).reshape(n, -1).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


def titan_hf_suite(rank, world_size, root):
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    from regather.hf import export_peft

    pd = H.parallel_dims()
    config = H.model_config(converter(LLAMA3_RUNS["regather+recompute"]))
    model = H.build(config, pd)
    H.step(model)  # one training step first: the export reads the model as training leaves it
    out = {"titan_lora": _logits(model)}
    directory = os.path.join(root, "export")
    tensors = export_peft(model, directory)
    out["keys"] = sorted(tensors)
    base = {k: v.full_tensor() for k, v in model.state_dict().items() if "lora_" not in k}
    hf_base_sd = Llama3StateDictAdapter(config, None).to_hf(base)
    frozen = H.build(H.model_config(converter(None, target_modules=[])), pd)
    out["titan_base"] = _logits(frozen)
    if rank == 0:
        from peft import PeftModel
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        hf = LlamaForCausalLM(hf_config(config)).eval()
        missing = hf.load_state_dict(hf_base_sd, strict=True)
        inp, _ = H.tokens()
        with torch.no_grad():
            out["hf_base"] = hf(input_ids=inp).logits
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            peft = PeftModel.from_pretrained(copy.deepcopy(hf), directory).eval()
        out["warnings"] = [str(w.message) for w in caught]
        with torch.no_grad():
            out["peft"] = peft(input_ids=inp).logits
        bad = os.path.join(root, "unpermuted")
        _swap_qk_halves(directory, bad)
        with torch.no_grad():
            out["peft_unpermuted"] = PeftModel.from_pretrained(copy.deepcopy(hf), bad).eval()(input_ids=inp).logits
        with open(os.path.join(directory, "adapter_config.json")) as f:
            import json

            out["config"] = json.load(f)
        out["missing"] = (list(missing.missing_keys), list(missing.unexpected_keys))
    dist.barrier()
    return out
