"""Every public name keeps working at the path users import it from, with its signature.

`tests/public_api.txt` lists them: one line per name, `module:qualname  signature`. It was
written from the package before the move into `nvfp4_jax/_src/` (issue 33) and is the
contract of the public faces: a name may be added to it, never dropped or changed without a
deprecation. `python tests/test_public_api.py --write` rewrites it from the installed package
(review the diff: every removed or changed line is a break for users).
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import sys
import types

import pytest

LISTING = pathlib.Path(__file__).with_name("public_api.txt")

# The public faces: the package, every module of its `__all__`, and `nvfp4_jax.qwix` and
# `nvfp4_jax.maxtext` with its `export` and `load` (optional: they import qwix and MaxText only
# when used).
FACES = (
    "nvfp4_jax",
    "nvfp4_jax.checkpoint",
    "nvfp4_jax.diagnostics",
    "nvfp4_jax.distributed",
    "nvfp4_jax.gemm",
    "nvfp4_jax.hf",
    "nvfp4_jax.kernels",
    "nvfp4_jax.kv_cache",
    "nvfp4_jax.layers",
    "nvfp4_jax.layout",
    "nvfp4_jax.linen",
    "nvfp4_jax.maxtext",
    "nvfp4_jax.maxtext.export",
    "nvfp4_jax.maxtext.load",
    "nvfp4_jax.nnx",
    "nvfp4_jax.ops",
    "nvfp4_jax.ptq",
    "nvfp4_jax.qwix",
    "nvfp4_jax.reference",
    "nvfp4_jax.rules",
)

# Methods users call on public classes (docs and examples name them).
METHODS = (
    "nvfp4_jax:NVFP4Array.dequantize",
    "nvfp4_jax:SRSeed.from_key",
    "nvfp4_jax:QuantSpec.replace",
    "nvfp4_jax.nnx:Linear.from_quantized",
    "nvfp4_jax.nnx:Experts.from_quantized",
    "nvfp4_jax.linen:Dense.__call__",
    "nvfp4_jax.linen:Experts.__call__",
)


def _signature(value) -> inspect.Signature | str:
    """The signature to describe, or the text for a value that has none of its own."""
    if isinstance(value, types.ModuleType) or not callable(value):
        return ""
    if not str(getattr(value, "__module__", "")).startswith("nvfp4_jax"):
        return "(external)"  # another library's object re-exported: its signature is its own
    try:
        return inspect.signature(value)
    except (TypeError, ValueError):
        return ""


def signature_of(value) -> str:
    """A callable's parameters as text: names, kinds and the defaults that are literals
    (other defaults show as `...`, since their reprs vary across JAX versions); '' for
    constants and modules; `(external)` for another library's callable (JAX's
    `PartitionSpec` changes its parameters from version to version)."""
    signature = _signature(value)
    if isinstance(signature, str):
        return signature
    if isinstance(value, type) and [p.kind for p in signature.parameters.values()] == [
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.VAR_KEYWORD,
    ]:
        # nnx modules hide `__init__` behind their metaclass.
        init = inspect.signature(value.__init__)
        signature = init.replace(parameters=list(init.parameters.values())[1:])
    parts, star_done = [], False
    for parameter in signature.parameters.values():
        kind = parameter.kind
        if kind is parameter.VAR_POSITIONAL:
            parts.append("*" + parameter.name)
            star_done = True
            continue
        if kind is parameter.VAR_KEYWORD:
            parts.append("**" + parameter.name)
            continue
        if kind is parameter.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        text = parameter.name
        if parameter.default is not parameter.empty:
            default = parameter.default
            literal = default is None or isinstance(default, (bool, int, float, str))
            text += "=" + (repr(default) if literal else "...")
        parts.append(text)
        if kind is parameter.POSITIONAL_ONLY:
            parts.append("/")
    return "(" + ", ".join(parts) + ")"


def resolve(entry: str):
    module_name, qualname = entry.split(":")
    value = importlib.import_module(module_name)
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


def public_names(module_name: str) -> list[str]:
    """The names a face offers: its `__all__`, the names it re-exports with `as`, or else
    the public names defined in it."""
    module = importlib.import_module(module_name)
    if hasattr(module, "__all__"):
        names = set(module.__all__)
        # `from m import X as X` marks a public re-export outside __all__.
        names |= {
            n
            for n, v in vars(module).items()
            if not n.startswith("_") and n.isupper() and not isinstance(v, types.ModuleType)
        }
        return sorted(names)
    names = []
    for name, value in vars(module).items():
        if name.startswith("_") or isinstance(value, types.ModuleType):
            continue
        if getattr(value, "__module__", None) == module_name or name.isupper():
            names.append(name)
    return sorted(names)


def current_listing() -> list[str]:
    entries = [f"{face}:{name}" for face in FACES for name in public_names(face)]
    entries += list(METHODS)
    return [f"{entry}  {signature_of(resolve(entry))}".rstrip() for entry in entries]


def recorded() -> list[tuple[str, str]]:
    rows = []
    lines = LISTING.read_text().splitlines() if LISTING.exists() else []
    for line in lines:
        entry, _, signature = line.partition("  ")
        rows.append((entry, signature))
    return rows


@pytest.mark.parametrize("entry,signature", recorded(), ids=[e for e, _ in recorded()])
def test_public_name(entry, signature):
    value = resolve(entry)
    assert signature_of(value) == signature, f"{entry}'s signature changed"


def test_faces_do_not_expose_private_modules():
    """The implementation lives in `nvfp4_jax._src`; no face hands out its modules."""
    import nvfp4_jax  # noqa: PLC0415

    leaked = []
    for face in FACES:
        module = importlib.import_module(face)
        for name, value in vars(module).items():
            if name.startswith("_"):
                continue
            if isinstance(value, types.ModuleType) and value.__name__.startswith("nvfp4_jax._src"):
                leaked.append(f"{face}.{name} -> {value.__name__}")
    del nvfp4_jax
    assert not leaked, leaked


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python tests/test_public_api.py --write")
    LISTING.write_text("\n".join(current_listing()) + "\n")
    print(f"wrote {LISTING}")
