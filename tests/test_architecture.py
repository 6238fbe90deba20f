"""The package keeps the layering of docs/ARCHITECTURE.md, and the repo stands on its own.

The import graph is read from the source with `ast` (every import statement, at any depth,
so a lazy import inside a function counts), not from what happens to be imported at run time.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nvfp4_jax"


def module_names() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the package."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imports_of(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The package modules `path` imports (a `from m import name` counts as m.name if that is
    a module, else as m)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                for a in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t == "nvfp4_jax" or t.startswith("nvfp4_jax."))
    return found


def layer_table() -> dict[str, int]:
    """Top-level module or package name -> layer, from docs/ARCHITECTURE.md's table."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = text.split("<!-- layers:begin -->")[1].split("<!-- layers:end -->")[0]
    layers = {}
    for layer, modules in re.findall(r"^\| (\d+) \| (.+) \|$", table, re.M):
        for name in re.findall(r"`(\w+)`", modules):
            layers[name] = int(layer)
    return layers


def top_level(module: str) -> str:
    """`nvfp4_jax.kernels._amax` -> `kernels`; the package itself -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def import_graph():
    modules = module_names()
    return modules, {name: imports_of(path, modules) for name, path in modules.items()}


def test_every_module_has_a_layer():
    layers = layer_table()
    modules, _ = import_graph()
    unplaced = sorted({top_level(m) for m in modules} - set(layers))
    assert not unplaced, f"modules missing from docs/ARCHITECTURE.md's layer table: {unplaced}"


def test_no_upward_import():
    layers = layer_table()
    _, graph = import_graph()
    upward = []
    for module, targets in graph.items():
        for target in targets:
            src, dst = top_level(module), top_level(target)
            same_package = src == dst
            if not same_package and layers[dst] >= layers[src]:
                upward.append(
                    f"{module} (layer {layers[src]}) imports {target} (layer {layers[dst]})"
                )
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    _, graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module, path):
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_the_checker_sees_lazy_imports(tmp_path):
    """A function-level import is an import: the graph must contain it."""
    source = tmp_path / "lazy.py"
    source.write_text("def f():\n    from nvfp4_jax import ops\n    return ops\n")
    modules = module_names()
    assert imports_of(source, modules) == {"nvfp4_jax.ops"}


def test_nothing_refers_outside_the_repo():
    """No tracked file may point into the team's shared folder beside the repo."""
    outside = "../" + "shared"
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    hits = []
    for name in files:
        path = ROOT / name
        if path.suffix in (".png", ".safetensors", ".npz", ".npy") or not path.is_file():
            continue
        text = path.read_text(errors="ignore")
        if outside in text or "/work/" + "shared" in text:
            hits.append(name)
    assert not hits, f"files that refer outside the repo: {hits}"


def test_markdown_links_resolve():
    """Every relative link in the repo's Markdown points at a file that exists."""
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.name}: {target}")
    assert not broken, broken


def test_lint_is_clean():
    """ruff (configured in pyproject.toml: complexity limit, no unused noqa) passes."""
    ruff = pytest.importorskip("ruff")
    del ruff
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "nvfp4_jax", "tests", "examples", "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
