"""Imports run downhill: core <- artifacts, kernels <- runtime <- train <- pipelines' rooms (capture <-
reference, bench <- commands) <- the CLI face; the engine plugins sit on the runtime.

Every ``import``/``from ... import`` of a project module in the source tree (module level or inside a
function: a lazy import is still a dependency; the engine plugins' relative imports too) is read from the
syntax tree and checked against the layer rules below; import cycles between modules are refused too, and
the serving paths (``dsaindex serve``, ``runtime``, the engine plugins) must not reach training code or the
reference-model product through any chain of imports. The checker is tested on a planted violation first,
so a broken checker cannot pass silently.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUBPACKAGES = ("artifacts", "kernels", "runtime", "train", "pipelines")
ROOMS = ("capture", "reference", "bench", "commands")  # pipelines' subpackages, each its own layer
ENGINES = ("sglang", "vllm")  # engines/<name>/dsaindex_<name>
_BELOW_PIPELINES = {"core", "artifacts", "kernels", "runtime", "train"}
# layer -> layers it may import (besides itself)
ALLOWED = {
    "core": set(),
    "artifacts": {"core"},
    "kernels": {"core"},
    "runtime": {"core", "artifacts", "kernels"},
    "train": {"core", "artifacts", "kernels", "runtime"},
    "capture": _BELOW_PIPELINES,
    "reference": _BELOW_PIPELINES | {"capture"},
    "bench": _BELOW_PIPELINES | {"capture"},
    "commands": _BELOW_PIPELINES | {"capture", "reference", "bench"},
    "face": _BELOW_PIPELINES | {"capture", "reference", "bench", "commands"},
    "engines": {"core", "artifacts", "kernels", "runtime"},
}
# what a server runs: nothing of these may import training or the reference product, directly or not
SERVING = ("dsaindex.runtime", "dsaindex.pipelines.commands.serve", "dsaindex_sglang", "dsaindex_vllm")
NOT_SERVED = ("train", "reference")


def module_name(path: Path, root: Path) -> str:
    """``train/codebooks.py`` -> ``dsaindex.train.codebooks``; ``dsaindex/score.py`` -> ``dsaindex.score``;
    ``engines/vllm/dsaindex_vllm/op.py`` -> ``dsaindex_vllm.op``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if parts[0] == "engines":
        return ".".join(parts[2:])
    return ".".join(parts if parts[0] == "dsaindex" else ["dsaindex", *parts])


def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[0].startswith("dsaindex_"):
        return "engines"
    if len(parts) > 2 and parts[1] == "pipelines" and parts[2] in ROOMS:
        return parts[2]
    if len(parts) > 1 and parts[1] == "pipelines":
        return "commands"  # the package's own __init__: the top of pipelines
    if len(parts) > 1 and parts[1] in SUBPACKAGES:
        return parts[1]
    if len(parts) > 1 and parts[1] in ("cli", "__main__"):
        return "face"
    return "core"


def source_files(root: Path) -> list[Path]:
    files = [p for p in (root / "dsaindex").glob("*.py")]
    for sub in SUBPACKAGES:
        files += [p for p in (root / sub).rglob("*.py") if "reference_model" not in p.parts]
    for engine in ENGINES:
        files += list((root / "engines" / engine / f"dsaindex_{engine}").rglob("*.py"))
    return sorted(files)


def imports_of(path: Path, module: str, known: set[str]) -> set[str]:
    """The project modules ``path`` (module ``module``) imports (``from a import b`` counts ``a.b`` when
    that is a module; relative imports are resolved against ``module``)."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("dsaindex"):
                origin = node.module
            else:
                continue
            found.add(origin)
            found |= {f"{origin}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("dsaindex")}
    return {m for m in found if m in known}


def import_graph(root: Path) -> tuple[dict[str, set[str]], dict[str, Path]]:
    files = source_files(root)
    names = {module_name(p, root): p for p in files}
    return {m: imports_of(p, m, set(names)) - {m} for m, p in names.items()}, names


def reach(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module ``start`` imports directly or through others -> the module that imports it first."""
    seen: dict[str, str] = {}
    todo = [start]
    while todo:
        node = todo.pop()
        for dep in sorted(graph.get(node, ())):
            if dep not in seen and dep != start:
                seen[dep] = node
                todo.append(dep)
    return seen


def check_tree(root: Path) -> list[str]:
    """Every violation in the tree at ``root``: wrong-way imports, cycles and serving paths that reach
    training code, one line each."""
    graph, names = import_graph(root)
    problems = []
    for module, deps in sorted(graph.items()):
        mine = layer_of(module)
        for dep in sorted(deps):
            theirs = layer_of(dep)
            if theirs != mine and theirs not in ALLOWED[mine]:
                problems.append(f"{names[module].relative_to(root)}: {mine} imports {theirs} ({dep})")
    for module in sorted(m for m in graph if m.startswith(SERVING)):
        via = reach(graph, module)
        for dep in sorted(d for d in via if layer_of(d) in NOT_SERVED):
            chain = [dep]
            while chain[-1] != module and chain[-1] in via:
                chain.append(via[chain[-1]])
            problems.append(f"serving path {module} reaches {layer_of(dep)} code: " + " <- ".join(chain))
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
    for folder in ("dsaindex", *SUBPACKAGES, *(f"pipelines/{room}" for room in ROOMS),
                   *(f"engines/{e}/dsaindex_{e}" for e in ENGINES)):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "dsaindex" / "score.py").write_text("X = 1\n")
    (tmp_path / "train" / "codebooks.py").write_text("from dsaindex.score import X\n")
    (tmp_path / "runtime" / "loader.py").write_text("def f():\n    from dsaindex.train.codebooks import X\n")
    (tmp_path / "kernels" / "a.py").write_text("import dsaindex.kernels.b\n")
    (tmp_path / "kernels" / "b.py").write_text("from dsaindex.kernels import a\n")
    # each import is downhill, but the chain takes `serve` to the reference trainer
    (tmp_path / "pipelines" / "reference" / "train.py").write_text("from dsaindex.score import X\n")
    (tmp_path / "pipelines" / "commands" / "runtime.py").write_text("from dsaindex.pipelines.reference.train import X\n")
    (tmp_path / "pipelines" / "commands" / "serve.py").write_text("from dsaindex.pipelines.commands import runtime\n")
    # an engine plugin's relative imports close a cycle; another reaches the pipelines
    vllm = tmp_path / "engines" / "vllm" / "dsaindex_vllm"
    (vllm / "__init__.py").write_text("")
    (vllm / "op.py").write_text("from .plugin import ENV\n")
    (vllm / "plugin.py").write_text("def f():\n    from dsaindex_vllm.op import install\nENV = 1\n")
    (tmp_path / "engines" / "sglang" / "dsaindex_sglang" / "hooks.py").write_text(
        "from dsaindex.pipelines.commands.serve import runtime\n")
    problems = check_tree(tmp_path)
    expected = [
        "runtime imports train (dsaindex.train.codebooks)",
        "engines imports commands (dsaindex.pipelines.commands.serve)",
        "serving path dsaindex.runtime.loader reaches train code: dsaindex.train.codebooks <- dsaindex.runtime.loader",
        "serving path dsaindex.pipelines.commands.serve reaches reference code: dsaindex.pipelines.reference.train"
        " <- dsaindex.pipelines.commands.runtime <- dsaindex.pipelines.commands.serve",
        "cycle: dsaindex.kernels.a -> dsaindex.kernels.b -> dsaindex.kernels.a",
        "cycle: dsaindex_vllm.op -> dsaindex_vllm.plugin -> dsaindex_vllm.op",
    ]
    for line in expected:
        assert any(line in p for p in problems), (line, problems)
    # sglang's hooks reach reference code through serve too; nothing else (train -> core is downhill)
    assert len(problems) == len(expected) + 1, problems


def test_imports_run_downhill_without_cycles():
    problems = check_tree(ROOT)
    assert not problems, "\n".join(problems)


def test_every_room_is_checked():
    layers = {layer_of(module_name(p, ROOT)) for p in source_files(ROOT)}
    assert layers == set(ALLOWED), sorted(set(ALLOWED) ^ layers)


def test_a_checkout_root_on_sys_path_shadows_no_installed_package():
    """``python -m ...`` from a checkout puts its root on sys.path, whose ``kernels/`` folder would shadow
    Hugging Face's ``kernels`` package (transformers imports it when installed): importing dsaindex takes
    the root off the path, and ``kernels`` is then not the checkout's folder."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = ("import os, sys, importlib.util; import dsaindex; root = os.getcwd(); "
            "print(any(os.path.realpath(p or '.') == root for p in sys.path)); "
            "spec = importlib.util.find_spec('kernels'); "
            "print(spec is not None and spec.origin == os.path.join(root, 'kernels', '__init__.py'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"], out.stdout
