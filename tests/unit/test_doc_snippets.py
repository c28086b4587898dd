"""Every code block in README.md, docs/*.md and benchmarks/gpu/README.md runs against the code: Python blocks
statement by statement (what the reader must supply — a model, a config — left out), command lines parsed and
checked by the command they name (tests/harness/doc_snippets.py says how). A block that needs a framework
this environment lacks is skipped here and checked in the tier that has it (Megatron Bridge:
tests/unit/recipes/test_bridge_docs.py)."""

import pytest

from tests.harness import doc_snippets as D

pytestmark = pytest.mark.timeout(300)

BLOCKS = D.blocks()


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=lambda b: b.name)
def test_python_block_runs(block):
    try:
        ran = D.check_python(block)
    except D.Unavailable as exc:
        pytest.skip(str(exc))
    assert ran >= 1, f"{block.name}: nothing of the block could run (its imports missing?)"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "bash"], ids=lambda b: b.name)
def test_command_lines_are_the_commands(block):
    assert D.check_bash(block)


def test_every_block_is_checked():
    """A fence in another language (or none) would go unchecked: say which."""
    every = D.blocks(langs=("", "python", "bash", "sh", "shell", "console", "text", "yaml", "json", "toml"))
    assert {b.lang for b in every} <= {"python", "bash"}, sorted({(b.lang, b.name) for b in every
                                                                   if b.lang not in ("python", "bash")})
