"""The recipe tier's setup, which the conftest.py of tests/unit/recipes and of tests/distributed/recipes
import (issue 27): Megatron Bridge 0.6.2's PEFT recipes as users run them, on Python 3.12 with the
real Bridge and megatron-core 0.19.2 installed (``.ci/venv312.sh``). Elsewhere (the 3.11 stack of
``make test``) every test in a ``recipes`` folder is skipped with the install hint.

Before any test: the published ``config.json`` of the recipes' three models (``data/``) is laid
into an HF cache in a temporary folder, and this process (and every rank it spawns) is pointed at
it with ``HF_HUB_OFFLINE=1`` (no hub access at test time)."""

import os
import shutil
import tempfile

import pytest
from tests.harness.recipes import INSTALL_HINT, prepare_offline_hub, recipes_available

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def pytest_collection_modifyitems(config, items):
    if recipes_available():
        return
    skip = pytest.mark.skip(reason=INSTALL_HINT)
    for item in items:
        if "recipes" in item.path.parent.parts:
            item.add_marker(skip)


_HUB: list = []  # the hub this process prepared: both recipe folders' conftest.py use this fixture, and
                 # huggingface_hub reads HF_HUB_CACHE once, at its import, so the hub is laid once


@pytest.fixture(scope="session", autouse=True)
def offline_hub():
    if not recipes_available():
        yield None
        return
    if _HUB:
        yield _HUB[0]
        return
    cache = tempfile.mkdtemp(prefix="regather-hf-cache-")
    saved = {k: os.environ.get(k) for k in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                                            "HF_HUB_DISABLE_TELEMETRY")}
    try:
        _HUB.append(prepare_offline_hub(cache, DATA))
        yield _HUB[0]
    finally:
        _HUB.clear()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(cache, ignore_errors=True)
