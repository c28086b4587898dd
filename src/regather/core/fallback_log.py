"""One log line per distinct fallback reason of a model, with the number of adapters it covers.

An adapter that cannot run what was asked (a strategy, or ``recompute_adapter_inputs``) runs
the classic path and says why once. In a model, many adapters share a reason — every expert
adapter of a MoE model (48 layers x 32 local experts = 1,536 on Qwen3-30B-A3B at EP4), every
``linear_proj`` — so a line per adapter would bury the one that matters. ``regather.LoRA``
gives every adapter of a model one :class:`FallbackLog`; an adapter *reports* its first
fallback there, and the model's forward hook *flushes* the log: each reason not logged before
becomes one record::

    LoRA: regather requested, using the gather path on 1536 adapters: expert linear: its input
    is the token dispatcher's output, not a sequence shard (decoder.layers.0.mlp.experts.
    local_experts.0.linear_fc1 and 1535 more; regather.decisions(model) lists them)

at the level the adapters asked for (INFO for what the feature excludes by design or the
moment decides — eval, ``no_grad``, row-parallel, experts —, WARNING for what may surprise a
user). A reason is logged once per model, counted over the adapters that reported it in the
forward where it first appeared; later adapters with the same reason are not logged again.
An adapter built outside ``regather.LoRA`` (no log attached) logs its own line, as before.

Every record carries the facts as attributes, for handlers and tests that want more than the
text: ``record.regather_what``, ``record.regather_reason``, ``record.regather_adapters`` (the
paths of every adapter the line covers, in report order) and ``record.regather_details`` (path ->
the measured detail of that adapter's reason, e.g. ``max |diff| 1.2e-07``, for the adapters that
have one). A reason is keyed by its sentence alone (:class:`regather.core.decision.Reason`): the
numbers a reason carries differ per layer and per machine, so they never make a second line.
"""

from __future__ import annotations

import logging

from regather.core.decision import described, detail_of

logger = logging.getLogger("regather")


class FallbackLog:
    """The pending and already-logged fallback reasons of one model."""

    def __init__(self) -> None:
        self._pending: dict[tuple[str, str], tuple[int, list[str], dict[str, str]]] = {}
        self._logged: set[tuple[str, str]] = set()

    def report(self, what: str, reason: str, path: str, level: int) -> None:
        """``what`` (e.g. ``"regather requested, using the gather path"``) happened to the adapter
        at ``path`` because of ``reason``; logged at the next :meth:`flush` unless already logged."""
        key = (what, str(reason))  # the sentence: a reason's measured detail never makes a new line
        if key in self._logged:
            return
        old_level, paths, details = self._pending.setdefault(key, (level, [], {}))
        if path not in paths:
            paths.append(path)
        detail = detail_of(reason)
        if detail is not None:
            details.setdefault(path, detail)
        self._pending[key] = (max(old_level, level), paths, details)

    def flush(self) -> None:
        """One record per pending reason; called after each forward of the model."""
        pending, self._pending = self._pending, {}
        for (what, reason), (level, paths, details) in pending.items():
            self._logged.add((what, reason))
            n = len(paths)
            where = paths[0] if n == 1 else f"{paths[0]} and {n - 1} more; regather.decisions(model) lists them"
            logger.log(level, "LoRA: %s on %d adapter%s: %s (%s)", what, n, "" if n == 1 else "s", reason, where,
                       extra=_extra(what, reason, paths, details))

    def logged(self) -> set[tuple[str, str]]:
        return set(self._logged)


def report(log: FallbackLog | None, what: str, reason: str, path: str, level: int) -> None:
    """Report to the model's log, or log this adapter's own line when it has none."""
    if log is not None:
        log.report(what, reason, path, level)
    else:
        detail = detail_of(reason)
        logger.log(level, "LoRA adapter on %s: %s: %s", path, what, described(reason),
                   extra=_extra(what, str(reason), [path], {} if detail is None else {path: detail}))


def _extra(what: str, reason: str, paths: list[str], details: dict) -> dict:
    return {"regather_what": what, "regather_reason": reason, "regather_adapters": tuple(paths),
            "regather_details": dict(details)}


def attach(model, adapters) -> FallbackLog:
    """Give ``adapters`` (an iterable) the model's log, creating it and its flush hook once."""
    log = getattr(model, "_regather_fallback_log", None)
    if log is None:
        log = FallbackLog()
        model._regather_fallback_log = log
        model.register_forward_hook(lambda module, args, output: log.flush(), always_call=True)
    for adapter in adapters:
        adapter.fallback_log = log
    return log
