"""Run megatron-core distributed checkpointing (``dist_checkpointing``) on CPU ranks (gloo).

``megatron.core.dist_checkpointing.save`` / ``load`` with megatron's *default*
strategies (``torch_dist`` save, executed synchronously; the default
``TorchDistLoadShardedStrategy``; ``validate_access_integrity=True``) are what a
CPU user should pick, and they work on gloo once the following is true
(megatron-core 0.16.1 and 0.19.2; :func:`enable_dist_checkpointing_cpu` applies
it, idempotently, and does nothing when CUDA is available):

1. **psutil is installed** (requirement, not a patch). Every writer of the
   ``torch_dist`` save (``FileSystemWriterAsync.write_preloaded_data`` in
   ``strategies/filesystem_async.py``) calls ``_process_memory()``, which raises
   without psutil, *before* its ``try`` block. In 0.16.1 the writer is a forked
   process, so it dies without ``count_queue.task_done()`` and the rank blocks in
   ``count_queue.join()`` (``write_preloaded_data_multiproc``) forever while its
   partners wait in the save's final barrier: the save **hangs** (py-spy: every
   rank in ``JoinableQueue.join`` at filesystem_async.py:308). We raise an
   ``ImportError`` up front instead.
2. **``torch.cuda.synchronize()`` is a no-op for dist_checkpointing** (patch).
   ``FileSystemWriterAsync.preload_tensors`` (the D2H staging every save runs,
   ``non_blocking=True``), the fully-parallel save wrapper
   (``strategies/fully_parallel.py``), the async callers (``async_utils.py``) and
   0.19's ``tensor_aware_state_dict.py`` call it; a CPU build of torch raises
   "Torch not compiled with CUDA enabled". There is no CUDA work to wait for, so
   these modules get a ``torch`` whose ``cuda.synchronize`` does nothing (the
   real ``torch.cuda.synchronize`` is left alone for everyone else).
3. **``torch.cuda.current_device()`` returns the CPU device** (patch, from
   :func:`regather.tools.cpu.megatron_cpu.enable_megatron_cpu`): ``state_dict_saver`` and
   ``async_utils`` build their small agreement tensors with
   ``device=torch.cuda.current_device()``.
4. **The write-results Manager dies with its rank** (patch). Every ``torch_dist``
   save creates, once per process, a ``multiprocessing`` *spawn* ``Manager`` for
   its results queue (``_get_write_results_queue`` in 0.16.1,
   ``get_write_results_queue`` in 0.19.2). It is shut down only by
   multiprocessing's ``atexit`` hook. A rank that ends with ``os._exit`` — as
   :func:`regather.tools.cpu.dist.run_ranks` ranks, torch elastic workers and
   crashing ranks do — leaves that server process running forever, holding the
   rank's inherited stdout/stderr: the checkpoint is written and the ranks have
   exited, but ``python test.py | tail`` or ``subprocess.run(capture_output=True)``
   never sees EOF and looks hung (observed: a save that finished in 4 s kept a
   pipeline open for 633 s until the two orphaned ``Server.serve_forever``
   processes were killed). We start the same Manager with an initializer that
   sets ``PR_SET_PDEATHSIG``, so it is killed when the rank exits.

Not covered (not needed for the default strategies): the fully-parallel *load*
wrapper (``FullyParallelLoadStrategyWrapper``) exchanges shards through
``device="cuda"`` buffers and ``Tensor.cuda()`` (``exchange_utils.py``), and
``cached_metadata=True`` saves build a ``device='cuda'`` tensor
(``state_dict_saver.verify_global_md_reuse``).
"""

from __future__ import annotations

import importlib
import os
import types

import torch

from regather.tools.cpu.dist import die_with_parent

_ENABLED = False

#: dist_checkpointing modules that call ``torch.cuda.synchronize()`` (those present are patched).
_SYNC_MODULES = (
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.tensor_aware_state_dict",
)


def enable_dist_checkpointing_cpu() -> bool:
    """Make ``megatron.core.dist_checkpointing`` save/load run on CPU ranks.

    Returns True when the patches are (or already were) applied, False when CUDA
    is available (nothing is changed then). Raises ``ImportError`` when psutil
    is missing (without it the save hangs, see the module docstring).
    """
    global _ENABLED
    if torch.cuda.is_available():
        return False
    if _ENABLED:
        return True
    try:
        import psutil  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "megatron's torch_dist checkpoint writers need psutil (without it a forked writer dies "
            "before signalling completion and dist_checkpointing.save hangs): pip install psutil"
        ) from exc
    from regather.tools.cpu.megatron_cpu import enable_megatron_cpu

    enable_megatron_cpu()
    _patch_synchronize()
    _patch_results_queue()
    _ENABLED = True
    return True


# -- 2. torch.cuda.synchronize -------------------------------------------------------------------

class _NoSyncCuda(types.ModuleType):
    """``torch.cuda`` with a no-op ``synchronize``; everything else is the real module."""

    def __init__(self):
        super().__init__("torch.cuda")

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(device=None) -> None:
        return None


class _TorchNoSync(types.ModuleType):
    """``torch`` as the patched dist_checkpointing modules see it: ``torch.cuda`` is :class:`_NoSyncCuda`."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _NoSyncCuda()

    def __getattr__(self, name):
        return getattr(torch, name)


def _patch_synchronize() -> None:
    proxy = _TorchNoSync()
    for name in _SYNC_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # 0.16.1 has no tensor_aware_state_dict
            continue
        if getattr(module, "torch", None) is torch:
            module.torch = proxy


# -- 4. the write-results Manager ----------------------------------------------------------------

def _patch_results_queue() -> None:
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    from torch import multiprocessing as mp

    # 0.19.2: get_write_results_queue(mp_mode="spawn"), also re-exported for nvrx/async callers;
    # 0.16.1: _get_write_results_queue(). Both cache the queue in fa._results_queue.
    name = "get_write_results_queue" if hasattr(fa, "get_write_results_queue") else "_get_write_results_queue"
    orig = getattr(fa, name)
    if getattr(orig, "_regather_cpu", False):
        return

    def get_write_results_queue(mp_mode: str = "spawn"):
        if fa._results_queue is None:
            manager = SyncManager(ctx=mp.get_context(mp_mode))
            manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
            fa._results_queue = manager.Queue()  # the proxy keeps the manager alive
        return fa._results_queue

    get_write_results_queue._regather_cpu = True
    get_write_results_queue.__doc__ = orig.__doc__
    setattr(fa, name, get_write_results_queue)
