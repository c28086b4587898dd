"""The Megatron Bridge snippets of the README and docs/bridge.md, run as written on the real Bridge 0.6.2
(this tier: its recipe function reads the model's published config.json from the offline hub), and what
``import regather.bridge`` says where Bridge is installed and Transformer Engine is not (Bridge 0.6.2 imports
TE at module level). The rest of the docs' blocks: tests/unit/test_doc_snippets.py."""

import os
import subprocess
import sys

import pytest
from tests.harness import doc_snippets as D
from tests.harness import recipes as R

pytestmark = pytest.mark.timeout(600)

BRIDGE_BLOCKS = [b for b in D.blocks(langs=("python",)) if "bridge" in b.code and "import" in b.code
                 and ("regather.bridge" in b.code or "megatron.bridge" in b.code)]


def test_the_bridge_snippets_are_found():
    assert {b.path for b in BRIDGE_BLOCKS} >= {"README.md", "docs/bridge.md"}, BRIDGE_BLOCKS


@pytest.mark.parametrize("block", BRIDGE_BLOCKS, ids=lambda b: b.name)
def test_bridge_snippet_runs_as_written(block):
    R.import_bridge()  # the tier's Transformer Engine stand-in while Bridge's lora_layers executes
    namespace: dict = {"__name__": "__doc_snippet__"}
    ran = D.check_python(block, namespace)
    assert ran >= 3, block.name
    cfg = namespace.get("cfg")
    if cfg is not None:  # a recipe's ConfigContainer with regather's LoRA in it
        from regather.bridge import LoRA

        assert isinstance(cfg.peft, LoRA), type(cfg.peft)


def test_import_without_transformer_engine_names_it():
    """Bridge installed, TE not: the error says Bridge imports TE, not that Bridge is missing."""
    code = "import importlib.util as u, sys; sys.exit(3 if u.find_spec('transformer_engine') else 0)"
    if subprocess.run([sys.executable, "-c", code], env=dict(os.environ)).returncode == 3:
        pytest.skip("Transformer Engine is installed here")
    done = subprocess.run([sys.executable, "-c", "import regather.bridge"], capture_output=True, text=True,
                          env=dict(os.environ), timeout=300)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "imports Transformer Engine at module level" in last and "regather.LoRA" in last, last
    assert "pip install megatron-bridge" not in last
