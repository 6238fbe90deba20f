"""Sphinx configuration of the nvfp4_jax documentation (built by `bash scripts/docs.sh`).

The pages are MyST Markdown; the API reference is generated from the docstrings of the
public names (autodoc, Google style through napoleon). The build runs with warnings as
errors, and `_warn_on_empty_docstrings` turns a documented public object without a
docstring into a warning. Nothing is fetched over the network (no intersphinx).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import pathlib
import re
import sys

from docutils import nodes
from sphinx import addnodes
from sphinx.transforms import SphinxTransform
from sphinx.util import logging

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# The package reads no flags at import; keep JAX on the host CPU and quiet.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import nvfp4_jax  # noqa: E402  (after the path is set)

project = "nvfp4_jax"
author = "the nvfp4_jax authors"
copyright = "2026, the nvfp4_jax authors"
release = nvfp4_jax.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]

# MyST: anchors for headings down to level 3, so pages link to each other's sections.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "dollarmath"]

# Docstrings are Google style, written as plain text with Markdown-like `code` spans and
# tables; `_docstring_to_rst` makes reStructuredText of them after napoleon has read them.
default_role = "code"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_member_order = "bysource"
autodoc_class_signature = "mixed"
# Each name is documented where users import it, not under `nvfp4_jax._src`.
add_module_names = True
python_use_unqualified_type_names = True

html_theme = "furo"
html_title = f"nvfp4_jax {release}"
html_static_path: list[str] = []
html_show_sourcelink = False

_logger = logging.getLogger("nvfp4_jax.docs")


def _generated_dataclass_doc(obj, lines: list[str]) -> bool:
    """True when a dataclass's only docstring is the one `dataclasses` writes (its signature)."""
    if not (isinstance(obj, type) and dataclasses.is_dataclass(obj)):
        return False
    return "\n".join(lines).strip().startswith(obj.__name__ + "(")


# A single-backtick span that is not part of a role (`:func:`x``) or a double-backtick one.
_CODE_SPAN = re.compile(r"(?<![`:\w\\])`([^`\n]+)`(?![`_])")
_TABLE_ROW = re.compile(r"^\s*\|.*\|\s*$")


def _inline_to_rst(line: str) -> str:
    """One line of prose: code spans as literals that may touch letters, `|` as itself."""
    out, last = [], 0
    for match in _CODE_SPAN.finditer(line):
        out.append(line[last : match.start()].replace("|", "\\|"))
        out.append(f"\\ ``{match.group(1)}``\\ ")
        last = match.end()
    out.append(line[last:].replace("|", "\\|"))
    return "".join(out)


def _verbatim_lines(lines: list[str]) -> list[bool]:
    """Which lines to keep as they are: doctest blocks and the bodies of `::` blocks."""
    keep, in_doctest, literal_indent = [], False, None
    for line in lines:
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if literal_indent is not None and stripped and indent <= literal_indent:
            literal_indent = None
        in_doctest = bool(stripped) and (in_doctest or stripped.startswith(">>>"))
        keep.append(in_doctest or literal_indent is not None)
        if not keep[-1] and (stripped.endswith("::") or stripped.startswith(".. code-block::")):
            literal_indent = indent
    return keep


def _docstring_to_rst(app, what, name, obj, options, lines):
    """Makes reStructuredText of a docstring written as plain text.

    The docstrings are read on GitHub and in `help()` as well, so they are written as text:
    `code` spans that touch the next letter (`NameRule`s), `max |x|`, and tables drawn with
    `|` (kept as preformatted blocks). Doctest and literal blocks are left as they are.
    """
    del app, what, name, obj, options
    result: list[str] = []
    in_table = False
    for line, verbatim in zip(lines, _verbatim_lines(lines), strict=True):
        is_row = not verbatim and bool(_TABLE_ROW.match(line))
        if is_row and not in_table:
            if result and result[-1].strip():
                result.append("")
            result.extend([" " * (len(line) - len(line.lstrip())) + "::", ""])
        elif in_table and not is_row and line.strip():
            result.append("")
        in_table = is_row
        if is_row:
            result.append("    " + line)
        else:
            result.append(line if verbatim else _inline_to_rst(line))
    lines[:] = result


def _warn_on_empty_docstrings(app, what, name, obj, options, lines):
    """A documented function, class or method without a docstring is a warning (-W fails)."""
    del app, options
    if what not in ("function", "class", "method", "classmethod", "staticmethod", "exception"):
        return
    if not "".join(lines).strip() or _generated_dataclass_doc(obj, lines):
        where = inspect.getsourcefile(obj) if inspect.isfunction(obj) else None
        _logger.warning(
            "%s %s has no docstring%s", what, name, f" (defined in {where})" if where else ""
        )


class RepositoryLinks(SphinxTransform):
    """Links from a page to a file or folder of the repository outside `docs/`.

    The pages are also read on GitHub, where `[the tests](../tests/io/test_hf_export.py)` opens the
    file. In the HTML site MyST makes a plain file a download; this transform does the same
    for a Markdown file outside the docs (MyST would look for a page) and shows a folder as
    its repository path (a site cannot list a folder). A link to something that does not
    exist is left to MyST, which warns.
    """

    default_priority = 100

    def apply(self, **kwargs):
        """Rewrites the document's links that leave the docs folder."""
        del kwargs
        srcdir = pathlib.Path(self.env.srcdir).resolve()
        for node in list(self.document.findall(addnodes.pending_xref)):
            if node.get("reftype") != "myst":
                continue
            target = self._outside_path(node, srcdir)
            if target is None:
                continue
            if target.is_dir():
                text = target.relative_to(ROOT).as_posix() + "/"
                node.replace_self(nodes.literal(text, text))
            elif target.is_file():
                link = addnodes.download_reference(
                    refdomain=None,
                    reftarget=os.path.relpath(target, self._doc_dir(srcdir)),
                    refdoc=self.env.docname,
                    reftype="myst",
                    refexplicit=True,
                )
                link += node.children
                node.replace_self(link)

    def _doc_dir(self, srcdir):
        return (srcdir / self.env.docname).parent

    def _outside_path(self, node, srcdir):
        """The repository path a link names when it lies outside the docs, else None."""
        if node.get("refdomain") == "doc":
            target = pathlib.Path(node["reftarget"] + ".md")
            if not target.is_absolute():
                return None
        elif node.get("refdomain") is None:
            target = self._doc_dir(srcdir) / node["reftarget"].split("#", 1)[0]
        else:
            return None
        target = target.resolve()
        if target.is_relative_to(srcdir) or not target.is_relative_to(ROOT):
            return None
        return target if target.exists() else None


def setup(app):
    """Connects the docstring check and the repository links."""
    app.connect("autodoc-process-docstring", _warn_on_empty_docstrings)
    app.connect("autodoc-process-docstring", _docstring_to_rst)
    app.add_transform(RepositoryLinks)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
