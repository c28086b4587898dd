"""Hugging Face interop: PEFT adapters in and out (:mod:`regather.hf.peft_io`), the HF module
names and megatron row layouts both directions share (:mod:`regather.hf.layout`), and what
``adapter_config.json`` holds (:mod:`regather.hf.peft_config`); a torchtitan model's LoRA export
(:mod:`regather.hf.torchtitan_peft`, reached through :func:`export_peft` too). Needs neither
``peft`` nor ``transformers``; ``safetensors`` reads and writes the weights."""

from regather.hf.peft_config import UnsupportedAdapter
from regather.hf.peft_io import export_peft, hf_state_dict, load_peft, peft_config, read_peft

__all__ = ["UnsupportedAdapter", "export_peft", "hf_state_dict", "load_peft", "peft_config", "read_peft"]
