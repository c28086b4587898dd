"""``regather.estimate``: the analytic byte and communication model behind ``regather estimate``,
under the name ``regather doctor`` cites (``regather.estimate.adapter_input_bytes``).

The code is :mod:`regather.tools.estimate`; this module gives its public names a short home.
"""

from regather.tools.estimate import (
    PRESETS,
    AdapterInput,
    Model,
    Run,
    adapter_input_bytes,
    adapter_inputs,
    as_json,
    check_run,
    comm_changes,
    estimate,
    expert_inputs,
    extra_comm_bytes,
    format_report,
    recompute_summary,
    saved_vs_gather,
)

__all__ = [
    "PRESETS", "AdapterInput", "Model", "Run", "adapter_input_bytes", "adapter_inputs", "as_json", "check_run",
    "comm_changes", "estimate", "expert_inputs", "extra_comm_bytes", "format_report", "recompute_summary",
    "saved_vs_gather",
]
