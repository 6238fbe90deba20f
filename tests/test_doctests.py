"""The `>>>` examples in the package's docstrings run, and print what they say they print.

One test per module of `nvfp4_jax` (the public faces and every module under `_src`), with
the standard library's `doctest` over the module's own objects: a name a face re-exports is
tested once, in the module that defines it. The examples run on the CPU (the test process's
8 host devices), so what they print must not depend on the platform.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import nvfp4_jax

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _module_names() -> list[str]:
    names = ["nvfp4_jax"]
    for info in pkgutil.walk_packages(nvfp4_jax.__path__, prefix="nvfp4_jax."):
        names.append(info.name)
    return sorted(names)


MODULES = _module_names()


def test_every_module_is_found():
    """The walk sees the faces and the implementation packages (a guard on the listing)."""
    assert "nvfp4_jax.nnx" in MODULES
    assert "nvfp4_jax._src.core.ops" in MODULES
    assert len(MODULES) > 30


@pytest.mark.slow
@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests = [t for t in finder.find(module, name) if t.examples]
    if not tests:
        pytest.skip("no examples")
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    failures = []
    for test in sorted(tests, key=lambda t: t.name):
        result = runner.run(test, out=failures.append, clear_globs=True)
        del result
    summary = runner.summarize(verbose=False)
    assert summary.failed == 0, "".join(failures)
