"""Flax paths <-> Hugging Face tensor names: `NameRule`, `NameMap`, `llama_name_map`.

Flax names differ from HF's: a `kernel` (in, out) becomes `weight` (out, in), an `embedding`
or a norm `scale` becomes `weight`. A `NameMap` (ordered `NameRule`s, first match wins)
translates both ways; `llama_name_map()` is the map of Flax models written with HF's module
names. Here too, by HF module name: the modules exported in high precision by default, the
sibling linears engines fuse into one layer, and how an engine matches a module against a
checkpoint's `ignore` list.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Iterable, Mapping, Sequence

DEFAULT_EXCLUDE = ("lm_head", "model.embed_tokens")
DEFAULT_FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
KINDS = ("linear", "embedding", "norm", "plain")


_FIELD = re.compile(r"\{(\w+)(\*?)\}")


def _compile(pattern: str, sep: str) -> tuple[re.Pattern, dict[str, bool]]:
    """A pattern's regex and its fields (name -> spans several components)."""
    parts, fields, pos = [], {}, 0
    one = f"[^{re.escape(sep)}]+"
    for match in _FIELD.finditer(pattern):
        name, multi = match.group(1), bool(match.group(2))
        if name in fields:
            raise ValueError(f"NameRule: field {{{name}}} appears twice in {pattern!r}")
        fields[name] = multi
        parts.append(re.escape(pattern[pos : match.start()]))
        body = f"{one}(?:{re.escape(sep)}{one})*" if multi else one
        parts.append(f"(?P<{name}>{body})")
        pos = match.end()
    parts.append(re.escape(pattern[pos:]))
    return re.compile("".join(parts)), fields


def _fill(pattern: str, values: Mapping[str, str]) -> str:
    return _FIELD.sub(lambda match: values[match.group(1)], pattern)


@dataclasses.dataclass(frozen=True)
class NameRule:
    """One rule of a `NameMap`: a Flax path pattern, the HF name pattern, the kind.

    Patterns are literal text with fields: `{name}` stands for one path component (no "/"
    in a Flax path, no "." in an HF name), `{name*}` for one or more (joined with "/" on the
    Flax side, "." on the HF side). Both sides hold the same fields, so a rule translates in
    both directions (a regex could not be inverted for the import).

    Attributes:
      flax: the Flax path pattern, components joined with "/", e.g. "{module*}/kernel".
      hf: the HF tensor name pattern, e.g. "model.{module*}.weight".
      kind: how the tensor converts: "linear" (a kernel (in, out) <-> `weight` (out, in),
        quantized unless excluded; `hf` must end in ".weight"), "embedding" (same
        orientation, 2-D), "norm" (1-D) or "plain" (as it is).
    """

    flax: str
    hf: str
    kind: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(
                f"NameRule {self.flax!r}: kind must be one of {KINDS}, got {self.kind!r}"
            )
        if self.kind == "linear" and not self.hf.endswith(".weight"):
            raise ValueError(f"NameRule {self.flax!r}: a linear's HF name must end in '.weight'")
        flax_fields, hf_fields = _compile(self.flax, "/")[1], _compile(self.hf, ".")[1]
        if flax_fields != hf_fields:
            raise ValueError(
                f"NameRule: {self.flax!r} and {self.hf!r} must hold the same fields "
                f"({sorted(flax_fields)} vs {sorted(hf_fields)})"
            )


class NameMap:
    """An ordered list of `NameRule`s between Flax paths and HF tensor names; first match wins.

    Args:
      rules: `NameRule`s or `(flax, hf, kind)` tuples.
    """

    def __init__(self, rules: Iterable[NameRule | tuple[str, str, str]]):
        self.rules = tuple(r if isinstance(r, NameRule) else NameRule(*r) for r in rules)
        self._compiled = [
            (rule, _compile(rule.flax, "/"), _compile(rule.hf, ".")) for rule in self.rules
        ]

    def to_hf(self, path: str) -> tuple[str, str] | None:
        """`(HF tensor name, kind)` of the Flax path `path` ("a/b/kernel"), or None."""
        for rule, (flax_re, fields), _ in self._compiled:
            match = flax_re.fullmatch(path)
            if match:
                values = {k: v.replace("/", ".") if fields[k] else v for k, v in _groups(match)}
                return _fill(rule.hf, values), rule.kind
        return None

    def to_flax(self, name: str, ndim: int | None = None) -> tuple[str, str] | None:
        """`(Flax path, kind)` of the HF tensor `name`, or None.

        Args:
          name: an HF tensor name, e.g. "model.norm.weight".
          ndim: the rank of the stored tensor; rules whose kind cannot hold that rank
            (linear and embedding: 2, norm: 1) are passed over.
        """
        for rule, _, (hf_re, fields) in self._compiled:
            match = hf_re.fullmatch(name)
            if match and _kind_fits(rule.kind, ndim):
                values = {k: v.replace(".", "/") if fields[k] else v for k, v in _groups(match)}
                return _fill(rule.flax, values), rule.kind
        return None

    def __repr__(self) -> str:
        return f"NameMap({list(self.rules)!r})"


def _groups(match: re.Match) -> list[tuple[str, str]]:
    return list(match.groupdict().items())


def _kind_fits(kind: str, ndim: int | None) -> bool:
    if ndim is None or kind == "plain":
        return True
    return ndim == (1 if kind == "norm" else 2)


def llama_name_map() -> NameMap:
    """The map of a Llama (and of any Flax model written with HF's module names).

    Flax `lm_head/kernel` <-> `lm_head.weight`; `embed_tokens/embedding` <->
    `model.embed_tokens.weight`; every other `<module>/kernel` <-> `model.<module>.weight`
    (a linear), `<module>/scale` <-> `model.<module>.weight` (a norm), `<module>/bias` <->
    `model.<module>.bias`, with "/" in `<module>` as "." (`layers/0/self_attn/q_proj` is
    `model.layers.0.self_attn.q_proj`).
    """
    return NameMap(
        [
            NameRule("lm_head/kernel", "lm_head.weight", "linear"),
            NameRule("embed_tokens/embedding", "model.embed_tokens.weight", "embedding"),
            NameRule("{module*}/kernel", "model.{module*}.weight", "linear"),
            NameRule("{module*}/scale", "model.{module*}.weight", "norm"),
            NameRule("{module*}/bias", "model.{module*}.bias", "plain"),
        ]
    )


def _as_name_map(name_map) -> NameMap:
    if name_map is None:
        return llama_name_map()
    return name_map if isinstance(name_map, NameMap) else NameMap(name_map)


# --- module names as engines match them -------------------------------------------------------


def _engine_ignores(module: str, ignore: Sequence[str]) -> bool:
    """Whether an engine skips `module` for `ignore`: exact, substring, fnmatch (as vLLM)."""
    return any(p == module or p in module or fnmatch.fnmatchcase(module, p) for p in ignore)


def _group_of(module: str, fused_groups) -> tuple[str, int] | None:
    parent, _, name = module.rpartition(".")
    for i, group in enumerate(fused_groups):
        if name in group:
            return parent, i
    return None
