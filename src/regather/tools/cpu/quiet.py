"""Framework chatter kept out of what ``regather demo``, ``bench`` and ``doctor --build`` print.

Each message below is about how the frameworks are installed or about regather's own measuring,
never about the run a user asked for, and each rank used to print it again:

======================================================== ==================================================
message                                                  where from, and how it is kept out
======================================================== ==================================================
``Transformer Engine and Apex are not installed`` /      megatron-core, at import, in every process that
``Apex is not installed. Falling back to Torch Norm``    imports it: a ``warnings`` filter (:data:`FILTERS`),
                                                         installed before the forkserver's preload imports
                                                         megatron (this module is its first preload)
``DTensor random operators may not have complete         DTensor, at every model built on a CPU mesh (the
support on cpu device mesh``                             tiny models set their weights themselves): a filter
``Torchinductor does not support code generation for     Inductor, compiling torchtitan's rope under
complex operators``                                      ``--compile`` on CPU: a filter
``USDT: … SyncActivityProfilerHandler … profiler_start`` the profiler's own log (kineto), at every region
/ ``profiler_stop``                                      :class:`~regather.core.allocated.AllocatedBytes`
                                                         measures: ``KINETO_LOG_LEVEL`` (:data:`ENVIRONMENT`),
                                                         read when a process first profiles
``resource_tracker: There appear to be 2 leaked          multiprocessing's resource tracker, when the command
semaphore objects``                                      exits after ``--compile``: the ``torch.fx``
                                                         interpreter's progress bar (tqdm) makes a
                                                         multiprocessing lock in each rank, which ends with
                                                         ``os._exit`` before unregistering it: a rank's tqdm
                                                         keeps its thread lock only (:func:`quiet_rank`)
``[W … CPUAllocator.cpp] Memory block of unknown size    c10, once per rank, when a region frees a block
was allocated before the profiling started``             allocated before it (which AllocatedBytes leaves
                                                         out by design): ``TORCH_CPP_LOG_LEVEL``, read when
                                                         torch loads, so only the command sets it, before
                                                         its ranks start (:func:`quiet_command`)
``is_opaque_value is deprecated, use is_custom_class_obj torch 2.14's own partitioner calls its deprecated
instead``                                                function, once per compiled graph per rank, under
                                                         ``--compile``: a filter on the logger
                                                         ``torch._library.opaque_object`` (:data:`LOG_FILTERS`)
======================================================== ==================================================

A value already in the environment wins: ``KINETO_LOG_LEVEL=0`` or ``TORCH_CPP_LOG_LEVEL=INFO`` shows
everything again. Errors are not filtered: a rank that fails reports its traceback. Torch-free.
"""

from __future__ import annotations

import logging
import os
import warnings

#: (message regex, category) of the warnings filtered out.
FILTERS = (
    (r".*Transformer Engine and Apex are not installed", UserWarning),
    (r"Apex is not installed", UserWarning),
    (r"DTensor random operators may not have complete support on cpu device mesh", UserWarning),
    (r"Torchinductor does not support code generation for complex operators", UserWarning),
)
#: (logger, text) of the log records dropped.
LOG_FILTERS = (("torch._library.opaque_object", "is_opaque_value is deprecated"),)
#: Set (where unset) for the ranks: kineto logs nothing below this level (6: its ``USDT`` lines too).
ENVIRONMENT = {"KINETO_LOG_LEVEL": "6"}
#: Set (where unset) by the command before its ranks start: c10's warnings off, its errors kept.
COMMAND_ENVIRONMENT = {**ENVIRONMENT, "TORCH_CPP_LOG_LEVEL": "ERROR"}


class _Drop(logging.Filter):
    """Drops the records whose message contains ``text``."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def filter_warnings() -> None:
    """Install :data:`FILTERS` and :data:`LOG_FILTERS` in this process (idempotent: ``warnings`` keeps
    one copy of each; a logger gets each drop once)."""
    for message, category in FILTERS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, text in LOG_FILTERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.text == text for f in logger.filters):
            logger.addFilter(_Drop(text))


def quiet_rank() -> None:
    """In a rank, before it runs anything: the filters, :data:`ENVIRONMENT`, and tqdm without a
    multiprocessing lock (a rank writes no progress bar from several processes; its ``os._exit`` would
    leave the lock's semaphore to the resource tracker, which warns about it at the command's exit)."""
    filter_warnings()
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    import importlib.util

    if importlib.util.find_spec("tqdm") is not None:
        from tqdm.std import TqdmDefaultWriteLock

        if not hasattr(TqdmDefaultWriteLock, "mp_lock"):  # tqdm makes one only where none is set
            TqdmDefaultWriteLock.mp_lock = None


def quiet_command() -> None:
    """In the ``regather`` command, before any rank starts: the filters and
    :data:`COMMAND_ENVIRONMENT`, which the ranks (and the forkserver they fork from) inherit."""
    filter_warnings()
    for name, value in COMMAND_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


filter_warnings()  # imported first by the forkserver (regather.tools.cpu.dist.PRELOAD)
