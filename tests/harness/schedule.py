"""The order the test files start in under pytest-xdist: the longest first.

``--dist loadfile`` hands a worker one file at a time, in collection order (``--no-loadscope-reorder``: by
default pytest-xdist puts the files with the most tests first, which started a 100-second file of one test
last, with the other worker idle meanwhile). Longest first, the two workers end within about the shortest
file of each other. The costs are the seconds each file took here (:data:`COSTS`, from
``python -m tests.harness.schedule JUNIT.xml``, a ``--junitxml`` report of the whole suite, as make test runs it);
a file not in the table counts :data:`UNKNOWN` seconds. A stale table changes only the order, never what runs.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TABLE = Path(__file__).with_name("costs.json")
UNKNOWN = 10.0


def costs() -> dict[str, float]:
    """Seconds per test file (``tests/...py``), as last measured."""
    try:
        return json.loads(TABLE.read_text())["seconds"]
    except FileNotFoundError:
        return {}


def order(items) -> None:
    """Sort collected pytest items in place: files by cost, the longest first; a file's items keep their order."""
    table = costs()
    first_index: dict[str, int] = {}
    for i, item in enumerate(items):
        first_index.setdefault(item.nodeid.partition("::")[0], i)

    def key(pair):
        i, item = pair
        file = item.nodeid.partition("::")[0]
        return -table.get(file, UNKNOWN), first_index[file], i

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]


def from_junit(path: Path) -> dict[str, float]:
    """Seconds per file from a pytest ``--junitxml`` report (each test's setup, call and teardown)."""
    import xml.etree.ElementTree as ET

    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(path).iter("testcase"):
        classname = case.get("classname", "")
        parts = classname.split(".")
        # classname is the module's dotted path, a class name after it for a test in a class
        for n in range(len(parts), 0, -1):
            file = "/".join(parts[:n]) + ".py"
            if (ROOT / file).exists():
                seconds[file] += float(case.get("time") or 0)
                break
    return {f: round(s, 1) for f, s in sorted(seconds.items())}


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m tests.harness.schedule JUNIT.xml [JUNIT.xml ...]  (rewrites tests/harness/costs.json)",
              file=sys.stderr)
        return 2
    seconds: dict[str, float] = {}
    for path in argv:
        seconds.update(from_junit(Path(path)))
    TABLE.write_text(json.dumps({"how": "seconds per file, pytest --junitxml (tests.harness.schedule)",
                                 "seconds": seconds}, indent=1) + "\n")
    print(f"{TABLE.relative_to(ROOT)}: {len(seconds)} files, {sum(seconds.values()):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
