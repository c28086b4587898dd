"""HF PEFT export/import (kept here for compatibility; the code is in :mod:`regather.hf`).

:func:`export_peft` writes ``adapter_model.safetensors`` + ``adapter_config.json``;
:func:`load_peft` loads a PEFT adapter into a LoRA-wrapped, TP-sharded megatron-core model.
See :mod:`regather.hf.peft_io` for what loads into which config and what is refused, and
:mod:`regather.hf.layout` for the module names and row layouts.
"""

from regather.hf.layout import (  # noqa: F401
    DEFAULT_NAMES,
    gated_fc1_shard,
    merge_qkv,
    split_gated_fc1,
    split_qkv,
)
from regather.hf.peft_config import UnsupportedAdapter  # noqa: F401
from regather.hf.peft_io import (  # noqa: F401
    CONFIG_NAME,
    PREFIX,
    WEIGHTS_NAME,
    export_peft,
    hf_state_dict,
    load_peft,
    peft_config,
    read_peft,
)
