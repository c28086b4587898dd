"""The recipe tier's skip and offline hub (recipes_tier.py, beside the distributed recipe tests), and the
fixtures its files share."""

import os

import pytest
from recipes_tier import offline_hub, pytest_collection_modifyitems  # noqa: F401  (pytest finds them here)
from tests.harness import recipes as R


@pytest.fixture(scope="module")
def bridge():
    """``regather.bridge``, Megatron Bridge imported first (skips without it)."""
    R.import_bridge()
    import regather.bridge

    return regather.bridge


@pytest.fixture
def environ():
    """``runtime_config_update`` writes the recipe's ``env_vars`` into ``os.environ``: put it back after."""
    saved = dict(os.environ)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)
