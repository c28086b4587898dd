"""The front ends of this process, each registered by its package on import, and asked by
:func:`regather.adapters`, :func:`regather.decisions` and :func:`regather.set_strategy`.

A front end (:mod:`regather.megatron`, :mod:`regather.torchtitan`) calls :func:`register` with its
name and a loader: a function returning what lists a model's adapters — an object (a module) with
``adapters(model) -> dict``, ``decisions(model) -> dict`` and ``set_strategy(model, strategy)``.
The loader runs on first use, so importing a front end loads nothing more. A model can only hold
adapters of a front end that was imported, so the registered front ends are all there is to ask.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class FrontEnd(Protocol):
    """What :func:`regather.adapters` / ``decisions`` / ``set_strategy`` need from a front end."""

    def adapters(self, model: Any) -> dict: ...

    def decisions(self, model: Any) -> dict: ...

    def set_strategy(self, model: Any, strategy: Any) -> None: ...


_LOADERS: dict[str, Callable[[], FrontEnd]] = {}


def register(name: str, load: Callable[[], FrontEnd]) -> None:
    """Registers front end ``name``; ``load()`` returns its :class:`FrontEnd` (called on first use).
    Registering a name again (a reloaded package) replaces its loader."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register(name={name!r}): expected the front end's name, a non-empty str")
    if not callable(load):
        raise TypeError(f"register({name!r}, load={load!r}): expected a function returning the front end")
    _LOADERS[name] = load


def registered() -> dict[str, FrontEnd]:
    """Every registered front end by name, in registration order, loaded."""
    return {name: load() for name, load in _LOADERS.items()}
