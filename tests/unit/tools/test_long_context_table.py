"""docs/benchmarks.md's long-context table is what its command prints (``python benchmarks/long_context.py``), and
that command's figures are ``regather estimate``'s for the same arguments."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

from regather.tools import cli

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- long-context table: python benchmarks/long_context.py -->", "<!-- end of the long-context table -->"


def _script():
    spec = importlib.util.spec_from_file_location("long_context", ROOT / "benchmarks" / "long_context.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _doc_table() -> str:
    text = DOC.read_text()
    assert START in text and END in text, f"{DOC.name} has lost the long-context table's markers"
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def test_the_doc_carries_what_the_command_prints():
    assert _doc_table() == _script().table().strip(), "re-run python benchmarks/long_context.py into docs/benchmarks.md"


def test_the_command_is_in_the_doc_as_a_block():
    assert "```bash\npython benchmarks/long_context.py\n```" in DOC.read_text()


def test_the_rule_picks_the_layouts():
    """The gather path fits at each first layout, not at half its CP; each extra layout has fewer GPUs and a
    regather strategy that fits there."""
    m = _script()
    found = m.layouts()
    assert {(k, s) for k, s, *_ in found} == {(k, s) for k, *_ in m.MODELS for s in m.LENGTHS}
    for key, seq, tp, cp, why in found:
        rows = m._rows(key, tp, cp, seq)
        if why == "the gather path fits":
            assert m._fits(rows["gather"]["gpu"]["total"])
            if cp > 1:
                assert not m._fits(m._rows(key, tp, cp // 2, seq, ("gather",))["gather"]["gpu"]["total"])
        else:
            assert not m._fits(rows["gather"]["gpu"]["total"]) and any(m._fits(r["gpu"]["total"]) for r in rows.values())


def _gib(cell: str) -> float:
    return float(cell.replace(",", ""))


def test_a_row_is_regather_estimates(capsys):
    """Llama 3 70B, 32k, TP8 x CP2: the table's regather row is what ``regather estimate`` prints for it."""
    assert cli.main(["estimate", "--model", "llama3-70b", "--tp", "8", "--cp", "2", "--seq", "32768",
                     "--strategies", "gather,regather", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    row = next(line for line in _doc_table().splitlines() if line.startswith("| Llama3-70B | 32k | 8 x 2 (16)"))
    gather = [c.strip() for c in row.strip("|").split("|")]
    regather = next(line for line in _doc_table().splitlines()[_doc_table().splitlines().index(row):]
                    if "| regather |" in line)
    cells = [c.strip() for c in regather.strip("|").split("|")]
    for cells_, name in ((gather, "gather"), (cells, "regather")):
        est = doc["strategies"][name]
        assert _gib(cells_[5]) == round(est["lora_kept_bytes"] / 2**30, 2)
        assert _gib(cells_[6]) == round(est["peak"]["peak_over_frozen"] / 2**30, 2)
        assert _gib(cells_[7]) == round(est["gpu"]["total"] / 2**30, 2)
    assert doc["run"]["cp"] == 2 and doc["run"]["local_seq"] == 16384


def test_the_lean_paths_peak_is_below_the_classic_and_full_recompute_keeps_nothing():
    m = _script()
    body = _doc_table().split("With full activation recompute")
    assert len(body) == 2
    for line in body[1].splitlines():
        if re.match(r"\|.*\| (gather \(Bridge|regather) ", line):
            assert [c.strip() for c in line.strip("|").split("|")][4] == "0.00", line  # kept after the forward
    for key, seq, tp, cp, _ in m.layouts():
        rows = m._rows(key, tp, cp, seq)
        assert rows["regather"]["peak"]["peak_over_frozen"] < rows["regather"]["peak_other_output_path"]["peak_over_frozen"]
        assert rows["gather"]["peak"]["lean"] is False and rows["regather"]["peak"]["lean"] is True


README = ROOT / "README.md"
#: the README's peak rows: a ``regather estimate`` command, then kept (GB), peak over frozen (GB), total (GiB)
README_ROW = re.compile(r"^\| [^|]*`(regather estimate [^`]+)` \| te \| modelled \| ([^|]+) GB \| ([^|]+) GB \| "
                        r"([^|]+) GiB \|$")


@pytest.mark.parametrize("line", [line for line in README.read_text().splitlines() if README_ROW.match(line)],
                         ids=lambda line: README_ROW.match(line).group(1))
def test_readme_peak_rows_are_regather_estimates(line, capsys):
    """Each modelled row of the README's peak table is ``regather estimate``'s for its command: gather ->
    regather -> regather-recompute, what LoRA keeps, its peak over the frozen model, the per-GPU total."""
    command, kept, peak, total = README_ROW.match(line).groups()
    assert cli.main(command.split()[1:] + ["--strategies", "gather,regather,regather-recompute", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["strategies"].values()
    assert kept.split(" → ") == [f"{r['lora_kept_bytes'] / 1e9:.3f}" for r in rows]
    assert peak.split(" → ") == [f"{r['peak']['peak_over_frozen'] / 1e9:.3f}" for r in rows]
    assert total.split(" → ") == [f"{r['gpu']['total'] / 2**30:.2f}" for r in rows]


def test_readme_has_modelled_peak_rows():
    assert sum(bool(README_ROW.match(line)) for line in README.read_text().splitlines()) == 2
