"""A model with regather's torchtitan adapters: its adapters, their decisions, and attaching them.

- :func:`adapters` / :func:`decisions` / :func:`set_strategy` — every adapter by its module path
  (the path torchtitan's parameter names start with), what each decided, a strategy switch;
- :func:`attach` — once per model, after it is built (the converter's root config does it) or
  adapted by hand: each adapter learns where its gathered input is recorded, which norms may
  have produced its shard, its path, and the model's fallback log (one line per distinct reason,
  :mod:`regather.core.fallback_log`).

:func:`regather.torchtitan.decisions` lists a torchtitan model's adapters; ``regather.decisions``
lists them too, with those of any other front end the model holds.
"""

from __future__ import annotations

from torch import nn

from regather.core import fallback_log
from regather.core.decision import Decision
from regather.core.recompute import compiled
from regather.core.strategies import Strategy
from regather.torchtitan import compat
from regather.torchtitan.adapter import LoRAAdapter
from regather.torchtitan.options import Options
from regather.torchtitan.pairing import watch_colwise_input, watch_redistribution
from regather.torchtitan.producers import norms_near


def adapters(model: nn.Module) -> dict[str, LoRAAdapter]:
    """Every regather adapter of ``model``, by module path (``layers.0.attention.qkv_linear.wqkv``)."""
    return {path: m for path, m in model.named_modules() if isinstance(m, LoRAAdapter)}


def decisions(model: nn.Module) -> dict[str, Decision]:
    """What each adapter decided in its last forward; for one that has not run yet, what it would
    decide from what is known without its input (its pairing with this forward's gather and its
    producers are checked by every forward); for one that ran traced (``torch.compile``), what its
    traced forward runs (:func:`regather.torchtitan.traced.traced_decision`)."""
    return {path: a.decide() if a.traced else (a.last_decision or a.decide()) for path, a in adapters(model).items()}


def set_strategy(model: nn.Module, strategy: Strategy | str) -> None:
    """Switch every adapter of ``model`` to ``strategy`` (gather and regather: the same numerics).
    The switch takes effect with the next forward."""
    strategy = Strategy.parse(strategy)
    for a in adapters(model).values():
        a.options = Options(strategy, a.options.early_regather, a.options.recompute_adapter_inputs)
        a.last_decision = None


def _gathering_ancestor(modules: dict, path: str):
    """The nearest ancestor whose torchtitan sharding config redistributes an input (``attention``,
    ``feed_forward``: their ``in_dst_shardings`` gather the sequence shard), or None."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = modules[".".join(parts[:i])]
        config = compat.sharding_config(module)
        if config is not None and getattr(config, "in_dst_shardings", None):
            return module
    return None


def note_checkpoints(model: nn.Module) -> None:
    """Tell each adapter whether an activation-checkpoint wrapper holds it (torchtitan's SelectiveAC
    and FullAC wrap blocks after the model is built): a compiled forward cannot see the
    checkpoint's hooks, so it reads this (:func:`regather.torchtitan.traced.traced_decision`)."""
    wrapper = compat.checkpoint_wrapper_class()
    inside = {id(a) for m in model.modules() if isinstance(m, wrapper)
              for a in m.modules() if isinstance(a, LoRAAdapter)}
    for a in adapters(model).values():
        a.checkpointed = id(a) in inside


def _note_checkpoints_once(model: nn.Module) -> None:
    """:func:`note_checkpoints` before the model's first forward (activation checkpointing and
    compile are applied between build and the first step)."""
    def first_forward(module, args):
        note_checkpoints(module)
        handle.remove()

    handle = model.register_forward_pre_hook(first_forward)


def attach(model: nn.Module, by_hand: bool = False) -> nn.Module:
    """Attach every adapter of ``model`` (idempotent): its gather site — the gathering ancestor's
    input redistribution (torchtitan), or the linear's own ``ColwiseParallel`` input hook
    (``by_hand``) —, the norms beside it (``recompute_adapter_inputs``), its path and the log."""
    modules = dict(model.named_modules())
    found = adapters(model)
    for path, adapter in found.items():
        if getattr(adapter, "attached", False):
            continue
        adapter.attached = True
        adapter.log_name = path
        if by_hand:
            adapter.site = watch_colwise_input(adapter)
        else:
            owner = _gathering_ancestor(modules, path)
            adapter.site = watch_redistribution(owner) if owner is not None else None
        if adapter.site is not None:
            adapter.site.members.append(adapter)
        if adapter.options.recompute_adapter_inputs:
            adapter.norms = norms_near(modules, path)
            adapter.ticket = compiled.ticket(path)  # its input's rebuild under torch.compile
            compiled.install()
    fallback_log.attach(model, found.values())
    if found and not getattr(model, "_regather_notes_checkpoints", False):
        model._regather_notes_checkpoints = True
        _note_checkpoints_once(model)
    return model
