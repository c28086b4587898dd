"""The recipe tier's skip and offline hub (recipes_tier.py, beside the distributed recipe tests)."""

from recipes_tier import offline_hub, pytest_collection_modifyitems  # noqa: F401  (pytest finds them here)
