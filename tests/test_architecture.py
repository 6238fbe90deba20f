"""The package keeps the layering of docs/ARCHITECTURE.md, and the repo stands on its own.

The import graph is read from the source with `ast` (every import statement, at any depth,
so a lazy import inside a function counts), not from what happens to be imported at run time.
"""

from __future__ import annotations

import ast
import glob
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


def layer_table() -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    """From docs/ARCHITECTURE.md's table: package -> layer, and (package, module) -> rank
    inside its package (`<` separates ranks; modules of one rank do not import each other)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = text.split("<!-- layers:begin -->")[1].split("<!-- layers:end -->")[0]
    layers, ranks = {}, {}
    for layer, package, modules in re.findall(r"^\| (\d+) \| `(\w+)` \| (.+) \|$", table, re.M):
        layers[package] = int(layer)
        for rank, group in enumerate(modules.split("<")):
            for name in re.findall(r"`(\w+)`", group):
                ranks[(package, name)] = rank
    return layers, ranks


def unit(module: str) -> tuple[str, str] | None:
    """`nvfp4_jax._src.core.kernels._amax` -> ("core", "kernels"); `_version` -> ("", "");
    a public face (`nvfp4_jax`, `nvfp4_jax.nnx`, ...) -> None."""
    parts = module.split(".")
    if parts[1:2] == ["_version"]:
        return ("", "")
    if parts[1:2] != ["_src"]:
        return None
    if len(parts) < 4:
        return ("", "")  # the `_src` packages' empty __init__ files
    return (parts[2], parts[3])


def import_graph():
    modules = module_names()
    return modules, {name: imports_of(path, modules) for name, path in modules.items()}


def test_every_module_has_a_layer():
    layers, ranks = layer_table()
    modules, _ = import_graph()
    units = {unit(m) for m in modules} - {None, ("", "")}
    unplaced = sorted(f"{p}.{m}" for p, m in units if (p, m) not in ranks)
    assert not unplaced, f"modules missing from docs/ARCHITECTURE.md's layer table: {unplaced}"
    assert set(layers) >= {p for p, _ in units}


def import_allowed(src, dst, layers, ranks) -> bool:
    """May unit `src` import unit `dst`? (Faces may import anything.)"""
    if src is None:
        return True
    if dst is None:
        return False  # the implementation never imports the public faces
    if dst == ("", ""):
        return True  # `_version` and the empty `_src` packages
    if src == dst:
        return True  # inside one module's package (kernels/, reference/, hf/, ...)
    if src[0] != dst[0]:
        return layers[dst[0]] < layers[src[0]]
    return ranks[dst] < ranks[src]


def test_no_upward_import():
    layers, ranks = layer_table()
    _, graph = import_graph()
    upward = [
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if not import_allowed(unit(module), unit(target), layers, ranks)
    ]
    assert not upward, "\n".join(upward)


def test_the_faces_only_re_export():
    """A public face holds imports, `__all__` and its docstring: no code of its own."""
    for module, path in module_names().items():
        if unit(module) is not None or module.endswith("_version"):
            continue
        tree = ast.parse(path.read_text())
        extra = [
            type(node).__name__
            for node in tree.body
            if not isinstance(node, (ast.Import, ast.ImportFrom))
            and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
            and not (isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__all__"])
            and not (module == "nvfp4_jax" and _is_register_call(node))
            and not _is_launcher(node)
        ]
        assert not extra, f"{module} has code besides re-exports: {extra}"


def _is_launcher(node) -> bool:
    """`if __name__ == "__main__": main()`: a face run with `python -m` (nvfp4_jax.maxtext)."""
    return (
        isinstance(node, ast.If)
        and ast.unparse(node.test) == "__name__ == '__main__'"
        and [ast.unparse(n) for n in node.body] == ["main()"]
        and not node.orelse
    )


def _is_register_call(node) -> bool:
    """`kernels.register()` in `nvfp4_jax/__init__.py`: the native targets, registered at
    import so that a `jax.export`ed function runs in a fresh process."""
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and ast.unparse(node.value) == "kernels.register()"
    )


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
    docs = [p for p in sorted((ROOT / "docs").rglob("*.md")) if "_build" not in p.parts]
    for doc in [ROOT / "README.md", *docs]:
        text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)  # code blocks
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken


# A repository path in a file's text: a top-level folder of the repo, then path characters.
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:nvfp4_jax|ffi|tests|docs|scripts|examples|benchmarks|\.ci)/[\w./-]*\w)"
)


def _names_a_repo_path(text: str) -> bool:
    """Whether `text` (a path found by REPO_PATH) names something of the repository: a file
    or folder, a module without its `.py`, a module's attribute (`tests/helpers.heavy_tailed`)
    or the start of file names (`benchmarks/results/cpu_`)."""
    path = ROOT / text
    if path.exists() or path.with_name(path.name + ".py").exists():
        return True
    module, _, attribute = text.rpartition(".")
    if attribute.isidentifier() and (ROOT / f"{module}.py").is_file():
        return True
    return path.parent.is_dir() and any(path.parent.glob(glob.escape(path.name) + "*"))


def test_repository_paths_named_in_files_exist():
    """A comment, docstring or page that names a repository path names one that exists (the
    move into `_src/` left comments naming the old paths). Generated folders (`docs/_build`)
    and placeholders (`..._DATE.txt`, a name's start ending in `_`) are not paths."""
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    suffixes = (".py", ".cc", ".h", ".cu", ".cuh", ".sh", ".md", ".toml", ".txt", ".cfg")
    stale = []
    for name in files:
        if not name.endswith(suffixes) or not (ROOT / name).is_file():
            continue
        for match in REPO_PATH.finditer((ROOT / name).read_text(errors="ignore")):
            text = match.group(1).rstrip(".")
            if text.startswith("docs/_build") or re.search(r"[A-Z]{3,}|_$", text):
                continue
            if not _names_a_repo_path(text):
                stale.append(f"{name}: {text}")
    assert not stale, f"paths that do not exist in the repository: {stale}"


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


def test_no_module_imports_another_modules_private_names():
    """`from m import _name` only inside m's own package (a package's private helpers)."""
    found = []
    for module, path in module_names().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0):
                continue
            if not node.module.startswith("nvfp4_jax"):
                continue
            package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
            same_package = node.module == package or node.module.startswith(package + ".")
            private = [a.name for a in node.names if a.name.startswith("_")]
            private = [n for n in private if n not in ("__version__",)]
            if private and not same_package:
                found.append(f"{module} imports {private} from {node.module}")
    assert not found, "\n".join(found)
