"""Hugging Face interop: PEFT adapters in and out (:mod:`regather.hf.peft_io`), the HF module
names and megatron row layouts both directions share (:mod:`regather.hf.layout`), and what
``adapter_config.json`` holds (:mod:`regather.hf.peft_config`); a torchtitan model's LoRA export
(:mod:`regather.hf.torchtitan_peft`, reached through :func:`export_peft` too). Needs neither
``peft`` nor ``transformers``; ``safetensors`` reads and writes the weights.

This package is the home of every name the former ``regather.peft_export`` module had (removed
while 0.2.0 was developed, never released): the PEFT functions, the file and key names, the layout helpers."""

from regather.hf.layout import DEFAULT_NAMES, gated_fc1_shard, merge_qkv, split_gated_fc1, split_qkv
from regather.hf.peft_config import UnsupportedAdapter
from regather.hf.peft_io import (
    CONFIG_NAME,
    PREFIX,
    WEIGHTS_NAME,
    export_peft,
    hf_state_dict,
    load_peft,
    peft_config,
    read_peft,
)

__all__ = [
    "CONFIG_NAME", "DEFAULT_NAMES", "PREFIX", "WEIGHTS_NAME", "UnsupportedAdapter", "export_peft", "gated_fc1_shard",
    "hf_state_dict", "load_peft", "merge_qkv", "peft_config", "read_peft", "split_gated_fc1", "split_qkv",
]
