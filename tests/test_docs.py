"""The documentation covers the public API, and its docstring check works.

`docs/api/*.md` documents every public name of `tests/public_api.txt` under the path users
import it from; `docs/conf.py` turns a documented object without a docstring into a build
warning (the build runs with -W in `scripts/test.sh`, so that fails the test command).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api"
LISTING = ROOT / "tests" / "public_api.txt"

# `.. autofunction:: nvfp4_jax.quantize`, `.. py:data:: nvfp4_jax.BLOCK_SIZE`, ...
DIRECTIVE = re.compile(
    r"^\s*\.\. (?:auto(?:module|class|function|data|exception)|py:(?:data|function|class))"
    r"::\s+([\w.]+)",
    re.MULTILINE,
)
MEMBERS = re.compile(r"^\s*\.\. autoclass::\s+([\w.]+)\n((?:\s+:[\w-]+:.*\n)*)", re.MULTILINE)


def documented() -> set[str]:
    """Every full name an API page documents, with the methods named in `:members:`."""
    names = set()
    for page in sorted(API.glob("*.md")):
        text = page.read_text()
        names.update(DIRECTIVE.findall(text))
        for cls, options in MEMBERS.findall(text):
            for option in re.findall(r":members:\s*(.*)", options):
                names.update(f"{cls}.{m.strip()}" for m in option.split(",") if m.strip())
    return names


def public_names() -> list[str]:
    """`module:qualname` of every public name, as `module.qualname`."""
    rows = [line.split()[0] for line in LISTING.read_text().splitlines() if line.strip()]
    return [row.replace(":", ".") for row in rows]


def test_every_public_name_is_in_the_api_reference():
    missing = [name for name in public_names() if name not in documented()]
    assert not missing, f"public names missing from docs/api/*.md: {missing}"


def test_the_api_reference_documents_only_public_names():
    """No page documents an `_src` path or a name the listing does not know."""
    faces = {line.split(":")[0] for line in LISTING.read_text().splitlines() if line.strip()}
    known = set(public_names()) | faces
    extra = sorted(n for n in documented() if n not in known)
    assert not extra, f"docs/api/*.md documents names that are not public: {extra}"


def test_every_api_page_is_in_the_toctree():
    index = (API / "index.md").read_text()
    pages = {p.stem for p in API.glob("*.md")} - {"index"}
    missing = [p for p in sorted(pages) if not re.search(rf"^{re.escape(p)}$", index, re.M)]
    assert not missing, missing


def _conf():
    pytest.importorskip("sphinx")
    spec = importlib.util.spec_from_file_location("nvfp4_docs_conf", ROOT / "docs" / "conf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_empty_docstring_is_a_warning(monkeypatch):
    conf = _conf()
    warnings = []
    monkeypatch.setattr(conf._logger, "warning", lambda *args: warnings.append(args))

    def undocumented():
        pass

    conf._warn_on_empty_docstrings(None, "function", "pkg.undocumented", undocumented, {}, [])
    assert warnings and "has no docstring" in warnings[0][0]
    warnings.clear()
    conf._warn_on_empty_docstrings(None, "function", "pkg.f", undocumented, {}, ["Does it."])
    assert not warnings


def test_a_generated_dataclass_docstring_counts_as_empty(monkeypatch):
    @dataclasses.dataclass
    class Point:
        x: int

    conf = _conf()
    warnings = []
    monkeypatch.setattr(conf._logger, "warning", lambda *args: warnings.append(args))
    lines = Point.__doc__.splitlines()
    conf._warn_on_empty_docstrings(None, "class", "pkg.Point", Point, {}, lines)
    assert warnings


def test_docstring_text_becomes_rst():
    conf = _conf()
    lines = [
        "Takes `NameRule`s and max |x|.",
        "",
        "| a | b |",
        "| 1 | 2 |",
        "",
        ">>> abs(-1) | 0",
        "1",
    ]
    conf._docstring_to_rst(None, "function", "f", None, {}, lines)
    assert lines[0] == r"Takes \ ``NameRule``\ s and max \|x\|."
    assert "::" in lines and "    | a | b |" in lines
    assert ">>> abs(-1) | 0" in lines
