"""Running megatron-core and torchtitan on CPU ranks (gloo): what ``regather demo`` and ``regather
bench`` run, and the runtime the tests build on.

- :mod:`.dist` — :func:`~.dist.run_ranks`, the gloo rank launcher (with :mod:`.rank_progress`, its
  stall check);
- :mod:`.megatron_cpu`, :mod:`.moe_cpu`, :mod:`.torchtitan_cpu` — the run-time patches megatron-core,
  its MoE layers and torchtitan need without CUDA (docs/design.md §6, §9), applied by an explicit
  call (:func:`~.megatron_cpu.enable_megatron_cpu`, :func:`~.moe_cpu.enable_moe_cpu`,
  :func:`~.torchtitan_cpu.enable_torchtitan_cpu`) from a CPU run, never on import. One of them puts a
  module into ``sys.modules``: torchtitan's Triton all-to-all kernels, a stub that raises if called,
  and only when ``triton`` is not installed (:mod:`.torchtitan_cpu`);
- :mod:`.models`, :mod:`.moe_models`, :mod:`.torchtitan_models` — the tiny real models the demo and
  the benchmark build (megatron-core ``GPTModel``, its MoE layers, torchtitan's llama3 / qwen3);
  :mod:`.fake_te_grouped` — CPU stand-ins for Transformer Engine's grouped expert linears, for
  ``regather bench --moe --experts grouped`` (TE's expert structure without TE);
- :mod:`.train`, :mod:`.moe_train`, :mod:`.torchtitan_train` — the measured training loops.

Nothing in the library (core, ops, the front ends, hf) imports this package, and importing it
patches nothing. The test-only harness (fakes, Bridge shims, megatron's training machinery and
checkpointing on CPU) is not part of the package: it lives beside the tests, in ``tests/harness``.
"""
