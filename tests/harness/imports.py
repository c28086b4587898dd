"""What a test file imports, read from the code (``ast``), not guessed: the modules it reaches through
every ``import`` in it (at module level or inside a function), the rank bodies and harness modules it
uses, and the regather modules those import, transitively; and the framework and torch names each of
them uses. :mod:`tests.harness.tiers` decides from these which CI tier runs a test.

Followed: ``import a.b`` (and the packages ``a``, ``a.b`` it runs), ``from a import b`` (``a.b`` where
that is a module), relative imports, ``importlib.import_module("literal")``, the names a package hands
out lazily from a module-level ``__getattr__`` (``regather.LoRA`` -> ``regather.megatron.lora``: the
package's table of module strings), the sub-commands :mod:`regather.tools.cli` imports by name (a
module-level dict whose values are module names), and the ``regather`` command run as a subprocess
(``python -m regather``, the console script: :mod:`regather.__main__`). Not followed: a name built at
run time (``import_module(f"...")`` with a variable part) other than those tables — the reason the
callers treat an unresolved closure as reaching more, never less, where it matters.
"""

from __future__ import annotations

import ast
import functools
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
TESTS = ROOT / "tests"
_TOPS = {TESTS / "unit", TESTS / "distributed"}
_IMPORT_LINE = re.compile(r"^\s*(import [\w.]+|from [\w.]+ import )", re.M)


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


@functools.lru_cache(maxsize=1)
def local_modules() -> dict[str, Path]:
    """Every module this repository defines, by the name it is imported under: ``regather.*`` (src),
    ``tests.*`` (the harness, conftests), and the helpers beside the tests (``workers_*``,
    ``integration_checks``, ...), which tests/conftest.py puts on the path by folder."""
    out: dict[str, Path] = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in sorted(TESTS.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
        if path.parent not in _TOPS and path.parent != TESTS and (TESTS / "harness") not in path.parents \
                and path.stem != "__init__":
            out.setdefault(path.stem, path)  # a folder on the path: the helper by its bare name
    return out


@functools.lru_cache(maxsize=1)
def _names_by_path() -> dict[Path, str]:
    """Each file's full dotted name (``tests.distributed.core.workers_core``, not its bare alias)."""
    out: dict[Path, str] = {}
    for name, path in local_modules().items():
        if "." in name or path not in out:
            out[path] = name if "." in name or path not in out else out[path]
    return out


def _module_of(path: Path) -> str:
    """``path``'s module name; a file outside the index (a test's own example) is a top-level module."""
    return _names_by_path().get(path, path.stem)


@functools.cache
def _lazy_table(package: str) -> dict[str, str]:
    """``name -> module`` a package hands out from a module-level ``__getattr__``: the module-level dict
    whose values are module names (absolute, or relative to the package)."""
    path = local_modules().get(package)
    if path is None or path.name != "__init__.py":
        return {}
    tree = _parse(path)
    if not any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body):
        return {}
    return _module_dicts(tree, package)


def _module_dicts(tree: ast.Module, package: str) -> dict[str, str]:
    """Module-level ``{key: "module"}`` dicts: key -> the local module each string names."""
    out: dict[str, str] = {}
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if not isinstance(value, ast.Dict):
            continue
        for key, val in zip(value.keys, value.values):
            if not (isinstance(val, ast.Constant) and isinstance(val.value, str)):
                continue
            for name in (val.value, f"{package}.{val.value}"):
                if name in local_modules():
                    out[key.value if isinstance(key, ast.Constant) else name] = name
                    break
    return out


def _absolute(module: str | None, level: int, here: str, is_package: bool) -> str:
    if level == 0:
        return module or ""
    base = here.split(".")
    base = base[: len(base) - level + (1 if is_package else 0)]
    return ".".join(base + ([module] if module else []))


@functools.cache
def direct(path: Path) -> tuple[frozenset[str], frozenset[str]]:
    """(the modules ``path`` imports, the dotted external names it uses: ``torch.compile``,
    ``torch.autograd.graph.saved_tensors_hooks``, ``torch._C._autograd``...)."""
    tree = _parse(path)
    here = _module_of(path)
    is_package = path.name == "__init__.py"
    imported: set[str] = set()
    bound: dict[str, str] = {}  # local name -> the module or name it is bound to
    for node in [*ast.walk(tree), *_code_in_strings(tree)]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                imported.add(alias.name)
                bound[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, here, is_package)
            imported.add(base)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                lazy = _lazy_table(base).get(alias.name)
                imported.add(lazy or full)
                bound[alias.asname or alias.name] = full
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name == "import_module":
                imported.add(node.args[0].value)
    if not _lazy_table(here):  # a lazy package's table counts per name asked for (above), not as a whole
        imported.update(_module_dicts(tree, here if is_package else here.rpartition(".")[0]).values())
    used: set[str] = set(imported)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = []
            inner = node
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in bound:
                dotted = ".".join([bound[inner.id], *reversed(chain)])
                used.add(dotted)
                package = bound[inner.id]
                lazy = _lazy_table(package).get(chain[-1])
                if lazy:
                    imported.add(lazy)
    if _runs_the_command(tree):
        imported.add("regather.__main__")
    return frozenset(imported), frozenset(used)


def _code_in_strings(tree: ast.Module) -> list[ast.AST]:
    """The nodes of the Python source a string constant holds (the code a test runs in a fresh
    interpreter, ``python -c CODE``): any string with an import statement on a line of its own."""
    out: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _IMPORT_LINE.search(node.value):
            try:
                out.extend(ast.walk(ast.parse(textwrap.dedent(node.value))))
            except SyntaxError:
                continue
    return out


def _runs_the_command(tree: ast.Module) -> bool:
    """Runs ``regather`` in a subprocess: ``-m regather`` in an argument list, or the console script
    found by name (``shutil.which("regather")``, :mod:`regather_console`)."""
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    return "regather" in strings and ("-m" in strings or "which" in names)


def resolve(name: str) -> list[str]:
    """The local modules importing ``name`` runs: each package on the way, then the module."""
    parts = name.split(".")
    return [m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in local_modules()]


@functools.cache
def closure(path: Path, *, through_src: bool = True) -> tuple[frozenset[str], frozenset[str]]:
    """(the local modules ``path`` reaches, the external dotted names any of them uses). With
    ``through_src=False`` the walk stops at regather's own modules (what the test and its helpers
    use themselves)."""
    mods = local_modules()
    seen: set[str] = set()
    external: set[str] = set()
    todo = [path]
    done_paths: set[Path] = set()
    while todo:
        p = todo.pop()
        if p in done_paths:
            continue
        done_paths.add(p)
        imported, used = direct(p)
        external.update(u for u in used if not resolve(u))
        for name in imported:
            for module in resolve(name):
                if module in seen:
                    continue
                seen.add(module)
                if not through_src and module.split(".")[0] == "regather":
                    continue
                todo.append(mods[module])
    return frozenset(seen), frozenset(external)


def test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if (TESTS / "harness") not in p.parents)
