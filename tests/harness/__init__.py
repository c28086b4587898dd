"""The test harness: what only the tests use, kept outside the wheel.

Fakes and stand-ins (:mod:`.te_model`, a model of Transformer Engine's linears that runs on CPU; :mod:`.bridge_env`, the
import-level shims that load Megatron Bridge's PEFT code on a CPU-only Python 3.11, ``sys.modules``
entries included), the Bridge 0.6.2 recipe loader of the Python 3.12 tier (:mod:`.recipes`),
megatron's own training machinery on CPU ranks (:mod:`.megatron_train`, with its ``sys.modules``
stand-in for apex's fused wgrad extension) and its distributed checkpointing (:mod:`.megatron_ckpt`),
the Hugging Face Llama twin of the tiny GPT (:mod:`.hf_llama`), a test matrix split into spawns
(:mod:`.spawn_groups`) and the fp64 comparison rule (:mod:`.numerics`).

Importable as ``tests.harness`` from the tests and from the ranks they spawn (``tests/conftest.py``
puts the repository root on ``sys.path``; spawned ranks inherit it). It builds on the product's CPU
runtime, :mod:`regather.tools.cpu` (the rank launcher, the CPU run-time patches, the tiny models and
the measured loops the ``regather`` command runs); nothing in ``src/`` imports it.
"""
