"""Imports run downhill: core <- artifacts, kernels <- runtime <- train <- pipelines <- the CLI face.

Every ``import``/``from ... import`` of a ``dsaindex`` module in the source tree (module level or inside a
function: a lazy import is still a dependency) is read from the syntax tree and checked against the
layer rules below; import cycles between modules are refused too. The checker is tested on a planted
violation first, so a broken checker cannot pass silently.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUBPACKAGES = ("artifacts", "kernels", "runtime", "train", "pipelines")
# layer -> layers it may import (besides itself)
ALLOWED = {
    "core": set(),
    "artifacts": {"core"},
    "kernels": {"core"},
    "runtime": {"core", "artifacts", "kernels"},
    "train": {"core", "artifacts", "kernels", "runtime"},
    "pipelines": {"core", "artifacts", "kernels", "runtime", "train"},
    "face": {"core", "artifacts", "kernels", "runtime", "train", "pipelines"},
}


def module_name(path: Path, root: Path) -> str:
    """``train/pq.py`` -> ``dsaindex.train.pq``; ``dsaindex/score.py`` -> ``dsaindex.score``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts if parts[0] == "dsaindex" else ["dsaindex", *parts])


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in SUBPACKAGES:
        return parts[1]
    if len(parts) > 1 and parts[1] in ("cli", "__main__"):
        return "face"
    return "core"


def source_files(root: Path) -> list[Path]:
    files = [p for p in (root / "dsaindex").glob("*.py")]
    for sub in SUBPACKAGES:
        files += [p for p in (root / sub).rglob("*.py") if "reference_model" not in p.parts]
    return sorted(files)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports (``from a import b`` counts ``a.b`` when that is a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dsaindex"):
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("dsaindex")}
    return {m for m in found if m in known}


def check_tree(root: Path) -> list[str]:
    """Every violation in the tree at ``root``: wrong-way imports and cycles, one line each."""
    files = source_files(root)
    names = {module_name(p, root): p for p in files}
    graph = {m: imports_of(p, set(names)) - {m} for m, p in names.items()}
    problems = []
    for module, deps in sorted(graph.items()):
        mine = layer_of(module)
        for dep in sorted(deps):
            theirs = layer_of(dep)
            if theirs != mine and theirs not in ALLOWED[mine]:
                problems.append(f"{names[module].relative_to(root)}: {mine} imports {theirs} ({dep})")
    # cycles: depth-first search, a back edge closes one
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                problems.append("cycle: " + " -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return problems


def test_the_checker_catches_planted_violations(tmp_path):
    for folder in ("dsaindex", *SUBPACKAGES):
        (tmp_path / folder).mkdir()
    (tmp_path / "dsaindex" / "score.py").write_text("X = 1\n")
    (tmp_path / "train" / "pq.py").write_text("from dsaindex.score import X\n")
    (tmp_path / "runtime" / "loader.py").write_text("def f():\n    from dsaindex.train.pq import X\n")
    (tmp_path / "kernels" / "a.py").write_text("import dsaindex.kernels.b\n")
    (tmp_path / "kernels" / "b.py").write_text("from dsaindex.kernels import a\n")
    problems = check_tree(tmp_path)
    assert any("runtime imports train (dsaindex.train.pq)" in p for p in problems), problems
    assert any(p.startswith("cycle:") and "dsaindex.kernels.a" in p for p in problems), problems
    assert len(problems) == 2, problems  # train -> core is downhill


def test_imports_run_downhill_without_cycles():
    problems = check_tree(ROOT)
    assert not problems, "\n".join(problems)


def test_every_subpackage_is_checked():
    layers = {layer_of(module_name(p, ROOT)) for p in source_files(ROOT)}
    assert layers == {"core", "face", *SUBPACKAGES}
