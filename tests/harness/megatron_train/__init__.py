"""Train a LoRA GPT through megatron-core's own training machinery, on CPU ranks.

``regather.tools.cpu.train`` drives the model with a hand-written loop. A user's
Megatron-LM / Megatron Bridge run does not: it wraps every model chunk in
megatron's ``DistributedDataParallel``, builds the optimizer with
``get_megatron_optimizer``, runs micro-batches through
``get_forward_backward_func()`` (no pipelining, 1F1B, interleaved) and reduces
gradients in ``finalize_model_grads``. :func:`train` does exactly that, with the
hooks Megatron-LM's ``training.py`` installs (``no_sync_func``,
``grad_sync_func``, ``param_sync_func``, ``finalize_model_grads_func``,
``grad_scale_func``, forward pre-hooks off for the first step with
``overlap_param_gather``), and returns what a test compares: per-step losses,
fp32 ``main_grad`` s, parameters, and the LoRA weights each adapter's forward
actually read.

One module per thing it builds:

- :mod:`.cpu`   — :func:`enable_megatron_training_cpu`: the run-time patches this needs on a machine
  without CUDA (docs/design.md §8), on top of :func:`regather.tools.cpu.megatron_cpu.enable_megatron_cpu` (§6)
- :mod:`.spec`  — :class:`TrainSpec` (strategy, topology, megatron options, sizes), :data:`STRATEGIES`
- :mod:`.build` — parallel state, model chunks with LoRA, DDP, optimizer, Megatron-LM's hooks;
  :func:`train`, :func:`train_agreed`
- :mod:`.loop`  — the steps through ``get_forward_backward_func()`` and what they record

Facts this harness relies on (megatron-core 0.16.1 and 0.19.2, gloo):
gloo's batched ``isend/irecv`` mixed up tensors with a virtual pipeline, so
``batch_p2p_comm`` is off there (docs/design.md §8); megatron's DDP turns bucketing off
on pipeline stages > 0 and for model chunks > 0 (as Megatron-LM asks).
"""

from tests.harness.megatron_train.build import (
    build_model_chunks,
    build_optimizer,
    install_training_hooks,
    lora_config,
    release_training,
    setup_parallel,
    teardown_parallel,
    train,
    train_agreed,
    warm_up,
    wrap_ddp,
)
from tests.harness.megatron_train.cpu import FUSED_WGRAD_STANDIN, TRAINING_MODULES, enable_megatron_training_cpu
from tests.harness.megatron_train.loop import reduced_main_grads, run_steps, step_batches
from tests.harness.megatron_train.spec import STRATEGIES, DDPOptions, TrainSpec

__all__ = [
    "FUSED_WGRAD_STANDIN", "STRATEGIES", "TRAINING_MODULES", "DDPOptions", "TrainSpec", "build_model_chunks",
    "build_optimizer", "enable_megatron_training_cpu", "install_training_hooks", "lora_config", "reduced_main_grads",
    "release_training", "run_steps", "setup_parallel", "step_batches", "teardown_parallel", "train", "train_agreed",
    "warm_up", "wrap_ddp",
]
