"""Every code block of the README and the docs, checked against the code (tests/unit/test_doc_snippets.py;
the blocks that need Megatron Bridge in the recipe tier, tests/unit/recipes/test_bridge_docs.py).

The blocks are read from the markdown as it is, so a snippet another change rewrites is checked as it
lands. What a check does:

``python``
    compiled, then run statement by statement in one namespace. A statement that reads a name no earlier
    statement defined (the reader's ``model``, ``cfg``, ``config``) is not run; the classes it constructs from
    defined names still are (``cfg.peft = LoRA(dim=16, ...)`` constructs the ``LoRA``; ``LoRAConverter.Config(...)``
    inside ``model_registry(...)`` is built), not its function calls, which may need a process group. A
    zero-argument function the block defines is called. Every
    block runs at least one statement or call. An import of a framework that is not installed here
    (:data:`OPTIONAL`) raises :class:`Unavailable`: the block is checked in the tier that has it.
``bash``
    every command line (``\\`` continuations joined, comments dropped, ``VAR=value`` prefixes skipped) matches a
    rule: ``regather …`` is parsed by the command's own parser and checked as the command checks it before
    running (``estimate`` and ``doctor`` run: they take a second; ``bench`` builds its spec; ``demo`` parses);
    ``make T`` names a Makefile target; ``pytest`` paths exist; a script path exists; ``pip install`` extras are
    ``pyproject.toml``'s. A line no rule knows fails, naming itself: add a rule rather than leave it unchecked.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import dataclasses
import io
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the markdown files whose blocks are checked
FILES = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
         "benchmarks/gpu/README.md")
#: frameworks a block may import that a tier may not have: such a block is checked where they are
OPTIONAL = ("megatron.bridge", "transformer_engine", "torchtitan", "megatron.core", "peft", "transformers")


class Unavailable(Exception):
    """The block imports a framework not installed in this environment."""


@dataclasses.dataclass(frozen=True)
class Block:
    path: str
    line: int  # of the opening fence
    lang: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"


def blocks(paths=FILES, langs=("python", "bash")) -> list[Block]:
    out = []
    for path in paths:
        lines = (ROOT / path).read_text().splitlines()
        i = 0
        while i < len(lines):
            m = re.match(r"^```(\w*)\s*$", lines[i])
            if m is None:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            if m.group(1) in langs:
                out.append(Block(path, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n"))
            i = end + 1
    return out


# -- python ---------------------------------------------------------------------------------------

def _targets(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _names_read(node: ast.AST) -> set[str]:
    """Names a node reads that are not its own loop, comprehension or lambda variables."""
    bound: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.comprehension | ast.For):
            bound |= _targets(n.target)
        elif isinstance(n, ast.Lambda):
            bound |= {a.arg for a in n.args.args}
        elif isinstance(n, ast.withitem) and n.optional_vars is not None:
            bound |= _targets(n.optional_vars)
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


def _defined(names: set[str], namespace: dict) -> bool:
    return all(n in namespace or hasattr(builtins, n) for n in names)


def _import(stmt: ast.stmt, namespace: dict, block: Block) -> None:
    try:
        exec(compile(ast.Module([stmt], []), block.name, "exec"), namespace)
    except ImportError as exc:
        wanted = stmt.module if isinstance(stmt, ast.ImportFrom) else stmt.names[0].name
        chain, cause = [], exc
        while cause is not None:  # regather.bridge re-raises Bridge's own ImportError with its reason
            chain.append(getattr(cause, "name", None) or "")
            cause = cause.__cause__
        missing = next((m for m in reversed(chain) if m), "?")
        for framework in OPTIONAL:
            if any(m == framework or m.startswith(framework + ".") for m in (*chain, wanted or "")):
                raise Unavailable(f"{block.name} imports {wanted} ({framework}), and {missing} is not installed "
                                  f"here: {exc}") from exc
        raise


def _calls(node: ast.AST, namespace: dict) -> list[ast.Call]:
    """The outermost calls inside ``node`` whose names are all defined."""
    found = []

    def visit(n):
        if isinstance(n, ast.Call) and _defined(_names_read(n), namespace):
            found.append(n)
            return
        for child in ast.iter_child_nodes(n):
            visit(child)

    visit(node)
    return found


def check_python(block: Block, namespace: dict | None = None) -> int:
    """Run ``block`` as the module doc says; returns how many statements and calls ran."""
    tree = ast.parse(block.code, block.name)
    ns = {"__name__": "__doc_snippet__"} if namespace is None else namespace
    ran = 0
    for stmt in tree.body:
        if isinstance(stmt, ast.Import | ast.ImportFrom):
            _import(stmt, ns, block)
        elif isinstance(stmt, ast.FunctionDef | ast.ClassDef) or _defined(_names_read(stmt), ns):
            exec(compile(ast.Module([stmt], []), block.name, "exec"), ns)
            if isinstance(stmt, ast.FunctionDef) and not (stmt.args.args or stmt.args.posonlyargs
                                                          or stmt.args.kwonlyargs):
                ns[stmt.name]()
        else:
            for call in _calls(stmt, ns):
                callee = eval(compile(ast.Expression(call.func), block.name, "eval"), ns)
                if isinstance(callee, type):  # a constructor: its fields are the snippet's to get right
                    eval(compile(ast.Expression(call), block.name, "eval"), ns)
                    ran += 1
            continue
        ran += 1
    return ran


# -- bash -----------------------------------------------------------------------------------------

def commands(block: Block) -> list[list[str]]:
    """The block's command lines as argument lists (continuations joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", block.code)
    out = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value prefixes
            words = words[1:]
        if words:
            out.append(words)
    return out


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.M))


def _extras() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^(\w+)\s*=", section, re.M))


def _regather(words: list[str]) -> str:
    """Parse and check a ``regather`` command line as the command does before it runs anything."""
    from regather.tools.cli import build_parser

    args = build_parser().parse_args(words[1:])
    if args.command in ("estimate", "doctor") and not getattr(args, "build", False):
        with contextlib.redirect_stdout(io.StringIO()):
            status = args.func(args)
        if args.command == "estimate" and status != 0:
            raise AssertionError(f"{' '.join(words)}: exit status {status}")
        return "ran"
    if args.command == "bench" and not args.render:
        from regather.tools.bench.cli import spec_from_args

        spec_from_args(args)
        return "spec built"
    if args.command == "doctor":
        from regather.tools.doctor.cli import setup_from_args

        setup_from_args(args)
    return "parsed"


def check_command(words: list[str]) -> str:
    """Check one command line; returns what was done, or raises naming the line."""
    line = " ".join(words)
    exe = words[0]
    if exe == "regather":
        return _regather(words)
    if exe == "make":
        unknown = [t for t in words[1:] if not t.startswith("-") and t not in _make_targets()]
        assert not unknown, f"{line}: no Makefile target {unknown}"
        return "target exists"
    if exe.endswith("python") or exe == "python":
        rest = words[1:]
        if rest[:2] == ["-m", "pytest"]:
            paths = [w.split("::")[0] for w in rest[2:] if not w.startswith("-") and ("/" in w or w.endswith(".py"))]
            missing = [p for p in paths if not (ROOT / p).exists()]
            assert not missing, f"{line}: no such test path {missing}"
            return "test paths exist"
        script = next((w for w in rest if w.endswith(".py")), None)
        assert script and (ROOT / script).exists(), f"{line}: no such script {script}"
        return "script exists"
    if exe == "pip":
        for word in words:
            m = re.match(r"^\.\[([\w,]+)\]$", word)
            if m:
                unknown = set(m.group(1).split(",")) - _extras()
                assert not unknown, f"{line}: pyproject.toml has no extra {sorted(unknown)}"
        return "extras exist"
    if "/" in exe:
        assert (ROOT / exe).exists(), f"{line}: no such file {exe}"
        return "file exists"
    raise AssertionError(f"{line}: no rule checks this command (tests/harness/doc_snippets.py)")


def check_bash(block: Block) -> list[str]:
    return [check_command(words) for words in commands(block)]
