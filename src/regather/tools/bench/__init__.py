"""``regather bench``: measure the strategies on a real megatron-core GPT (docs/design.md §7).

- :mod:`~regather.tools.bench.runner` — spawn ranks, run every strategy side by side, summarise
- :mod:`~regather.tools.bench.report` — terminal table, markdown, JSON and PNG chart
- :mod:`~regather.tools.bench.cli`    — the sub-command
- :mod:`~regather.tools.bench.moe`    — ``--moe``: the variants on megatron's MoE layers (TP x EP x ETP), summarised
- :mod:`~regather.tools.bench.moe_report` — its tables, markdown and JSON
- :mod:`~regather.tools.bench.titan`  — ``--torchtitan``: regather's torchtitan front end against torchtitan's own
  LoRA on its llama3 (TP + SP), bytes per adapter kind, summarised
- :mod:`~regather.tools.bench.titan_report` — its tables, markdown and JSON
"""
