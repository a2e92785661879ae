"""The package's layers (issue 23): ``minirsi.core`` imports nothing from the rest of minirsi,
each sub-package keeps its rule, and no import circle joins two sub-packages or two modules.

Read from the source with ``ast`` (every import statement, at module level, in a function or
under ``if TYPE_CHECKING``), not from what importing happens to load: a lazy import inside a
function is an arrow too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "minirsi"
SUBPACKAGES = ("core", "env", "engine", "run")
TOP_LEVEL = {"__init__.py", "cli.py", "config.py"}

# sub-package -> the nodes it may import (besides itself)
ALLOWED = {
    "core": set(),
    "env": set(),
    "engine": {"core", "env", "config"},
    "run": {"core", "env", "engine", "config"},
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> list[tuple[str, int]]:
    """Every ``minirsi`` module or package ``path`` imports, with the line of the import."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names if alias.name.split(".")[0] == "minirsi"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "minirsi":
                continue
            # ``from minirsi.core import fdr`` imports the module minirsi.core.fdr
            for alias in node.names:
                candidate = f"{module}.{alias.name}"
                target = candidate if _exists(candidate) else module
                out.append((target, node.lineno))
    return out


def _exists(module: str) -> bool:
    p = PACKAGE.parent.joinpath(*module.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def node_of(module: str) -> str:
    """The layer a module belongs to: a sub-package name, or a top-level module's name."""
    parts = module.split(".")
    if len(parts) == 1:
        return "minirsi"  # the package itself
    return parts[1]  # "core", "env", "engine", "run", or "config", "cli"


def source_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def arrows() -> list[tuple[str, str, str]]:
    """(from node, to node, "file:line") for every import between two different nodes."""
    out = []
    for path in source_files():
        src = node_of(_module_name(path))
        for target, line in imported_modules(path):
            dst = node_of(target)
            if dst != src:
                out.append((src, dst, f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"))
    return out


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``edges`` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_the_top_level_holds_only_the_cli_and_the_config_loader():
    flat = {p.name for p in PACKAGE.glob("*.py")}
    assert flat == TOP_LEVEL, f"a new module belongs in one of {SUBPACKAGES}: {sorted(flat - TOP_LEVEL)}"
    for sub in SUBPACKAGES:
        assert (PACKAGE / sub / "__init__.py").is_file()


def test_the_parser_sees_the_arrows_it_checks():
    """Not vacuous: known arrows are found (module level, function level, ``from x import module``)."""
    found = {(a, b) for a, b, _ in arrows()}
    assert {("run", "core"), ("run", "engine"), ("engine", "core"), ("engine", "env"), ("config", "core")} <= found
    # a lazy import inside a function: evaluate's ``from minirsi.engine import rollout``
    lazy = imported_modules(PACKAGE / "run" / "evaluate.py")
    assert any(target == "minirsi.engine.rollout" for target, _ in lazy)


@pytest.mark.parametrize("sub", SUBPACKAGES)
def test_each_subpackage_keeps_its_rule(sub):
    allowed = ALLOWED[sub] | {sub}
    bad = [where for src, dst, where in arrows() if src == sub and dst not in allowed]
    assert not bad, f"minirsi.{sub} may import only {sorted(allowed)}:\n" + "\n".join(bad)


def test_core_imports_nothing_from_the_rest_of_minirsi():
    """The rule the issue names: a module in minirsi/core/ imports only minirsi.core."""
    bad = []
    for path in sorted((PACKAGE / "core").rglob("*.py")):
        for target, line in imported_modules(path):
            if not (target == "minirsi.core" or target.startswith("minirsi.core.")):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not bad, "minirsi.core must not import the rest of minirsi:\n" + "\n".join(bad)


def test_no_import_circle_between_subpackages():
    edges: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for src, dst, at in arrows():
        edges.setdefault(src, set()).add(dst)
        where.setdefault((src, dst), at)
    cycle = find_cycle(edges)
    assert cycle is None, "import circle " + " -> ".join(cycle) + ":\n" + "\n".join(
        where[(a, b)] for a, b in zip(cycle, cycle[1:]))


def test_no_import_circle_between_modules():
    """Module by module too (the recipe, its stages and the run directory once imported each
    other's ``RunConfig``, two of them under ``TYPE_CHECKING``): a package's ``__init__`` is
    left out, as re-exporting its own modules is not a circle."""
    edges: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for path in source_files():
        if path.name == "__init__.py":
            continue
        src = _module_name(path)
        for target, line in imported_modules(path):
            if target != src and _exists(target) and not (PACKAGE.parent.joinpath(*target.split(".")) / "__init__.py").is_file():
                edges.setdefault(src, set()).add(target)
                where.setdefault((src, target), f"{path.relative_to(PACKAGE.parent)}:{line}")
    assert len(edges) > 25  # not vacuous: most modules import another
    cycle = find_cycle(edges)
    assert cycle is None, "import circle " + " -> ".join(cycle) + ":\n" + "\n".join(
        where[(a, b)] for a, b in zip(cycle, cycle[1:]))


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None
