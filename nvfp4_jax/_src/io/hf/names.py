"""Flax paths <-> Hugging Face tensor names: `NameRule`, `NameMap` and the maps of known models.

Flax names differ from HF's: a `kernel` (in, out) becomes `weight` (out, in), an `embedding`
or a norm `scale` becomes `weight`. A `NameMap` (ordered `NameRule`s, first match wins)
translates both ways; `llama_name_map()` is the map of Flax models written with HF's module
names, `qwen3_moe_name_map()` and `mixtral_name_map()` add the mixture-of-experts blocks (one
stacked (E, in, out) kernel per projection on the Flax side, E linears on the HF side, and the
router). Here too, by HF module name: the modules exported in high precision by default, the
sibling linears engines fuse into one layer, and how an engine matches a module against a
checkpoint's `ignore` list.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, get_args

from nvfp4_jax._src.core import checks

DEFAULT_EXCLUDE = ("lm_head", "model.embed_tokens")
# What a rule maps: a quantized linear, an embedding, a norm, a plain tensor, stacked
# experts, a router.
Kind = Literal["linear", "embedding", "norm", "plain", "experts", "router"]
KINDS = get_args(Kind)
# The field of an "experts" rule that exists on the HF side only: the expert's index.
EXPERT_FIELD = "expert"
_EXPERT_PLACEHOLDER = "{" + EXPERT_FIELD + "}"


_FIELD = re.compile(r"\{(\w+)(\*?)\}")


def _compile(pattern: str, sep: str, experts: bool = False) -> tuple[re.Pattern, dict[str, bool]]:
    """A pattern's regex and its fields (name -> spans several components).

    With `experts` (the HF side of an "experts" rule), the field `{expert}` matches a decimal
    index without leading zeros, of at most 9 digits, only.
    """
    parts, fields, pos = [], {}, 0
    one = f"[^{re.escape(sep)}]+"
    for match in _FIELD.finditer(pattern):
        name, multi = match.group(1), bool(match.group(2))
        if name in fields:
            raise ValueError(f"NameRule: field {{{name}}} appears twice in {pattern!r}")
        fields[name] = multi
        parts.append(re.escape(pattern[pos : match.start()]))
        body = f"{one}(?:{re.escape(sep)}{one})*" if multi else one
        if experts and name == EXPERT_FIELD and not multi:
            body = "0|[1-9][0-9]{0,8}"
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

    Mixture-of-experts blocks need two more kinds. A Flax model holds the E experts of one
    projection as one stacked kernel (E, in, out) (`nvfp4_jax.nnx.Experts`), while a
    checkpoint stores E linears: the kind "experts" maps the one to the other, and its HF
    pattern holds one field the Flax pattern lacks, `{expert}`, the expert's index (a
    decimal number; the stacked kernel's leading axis). For instance
    `NameRule("layers/{i}/mlp/experts/gate_proj/kernel",
    "model.layers.{i}.mlp.experts.{expert}.gate_proj.weight", "experts")`. The kind "router"
    is a linear that engines serve in high precision only (an MoE block's gate): never
    quantized, always named in the checkpoint's `ignore` list.

    Attributes:
      flax: the Flax path pattern, components joined with "/", e.g. "{module*}/kernel".
      hf: the HF tensor name pattern, e.g. "model.{module*}.weight".
      kind: how the tensor converts: "linear" (a kernel (in, out) <-> `weight` (out, in),
        quantized unless excluded; `hf` must end in ".weight"), "embedding" (same
        orientation, 2-D), "norm" (1-D), "plain" (as it is), "experts" (a stacked kernel
        (E, in, out) <-> E linears `weight` (out, in), expert e at `{expert}` = e, each
        quantized unless excluded; `hf` must end in ".weight" and hold `.{expert}.` as a
        whole component with a parent, e.g. "...experts.{expert}.w1.weight") or "router"
        (a linear always kept in high precision and listed in `ignore`; `hf` must end in
        ".weight").
    """

    flax: str
    hf: str
    kind: str

    def __post_init__(self):
        checks.check_choice(f"NameRule {self.flax!r}: kind", self.kind, Kind)
        if self.kind in ("linear", "experts", "router") and not self.hf.endswith(".weight"):
            raise ValueError(
                f"NameRule {self.flax!r}: the HF name of a {self.kind} must end in '.weight'"
            )
        flax_fields = _compile(self.flax, "/")[1]
        hf_fields = _compile(self.hf, ".", self.kind == "experts")[1]
        if self.kind == "experts":
            if f".{_EXPERT_PLACEHOLDER}." not in self.hf or hf_fields.get(EXPERT_FIELD):
                raise ValueError(
                    f"NameRule {self.hf!r}: an experts rule's HF name must hold the expert "
                    f"index as a whole component with a parent, '.{_EXPERT_PLACEHOLDER}.' "
                    "(e.g. 'model.layers.{i}.mlp.experts.{expert}.gate_proj.weight')"
                )
            if EXPERT_FIELD in flax_fields:
                raise ValueError(
                    f"NameRule {self.flax!r}: the Flax path of an experts rule is the stacked "
                    f"kernel (E, in, out); it must not hold {_EXPERT_PLACEHOLDER}"
                )
            hf_fields = {k: v for k, v in hf_fields.items() if k != EXPERT_FIELD}
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
            (rule, _compile(rule.flax, "/"), _compile(rule.hf, ".", rule.kind == "experts"))
            for rule in self.rules
        ]

    def to_hf(self, path: str) -> tuple[str, str] | None:
        """`(HF tensor name, kind)` of the Flax path `path` ("a/b/kernel"), or None.

        For an "experts" rule the name keeps the field `{expert}` unfilled (e.g.
        "model.layers.0.mlp.experts.{expert}.up_proj.weight"): the stacked kernel stands for
        one tensor per expert; `expert_names` fills it in.
        """
        for rule, (flax_re, fields), _ in self._compiled:
            match = flax_re.fullmatch(path)
            if match:
                values = {k: v.replace("/", ".") if fields[k] else v for k, v in _groups(match)}
                if rule.kind == "experts":
                    values[EXPERT_FIELD] = _EXPERT_PLACEHOLDER
                return _fill(rule.hf, values), rule.kind
        return None

    def to_flax(self, name: str, ndim: int | None = None) -> tuple[str, str] | None:
        """`(Flax path, kind)` of the HF tensor `name`, or None.

        For an expert's tensor (kind "experts") the path is the stacked kernel's; `expert_of`
        gives the index.

        Args:
          name: an HF tensor name, e.g. "model.norm.weight".
          ndim: the rank of the stored tensor; rules whose kind cannot hold that rank
            (linear, embedding, experts and router: 2, norm: 1) are passed over.
        """
        found = self._match_hf(name, ndim)
        return None if found is None else found[:2]

    def expert_of(self, name: str, ndim: int | None = None) -> int | None:
        """The expert index of the HF tensor `name` (the rule `to_flax` picks), else None.

        None also when that rule is not an "experts" rule.
        """
        found = self._match_hf(name, ndim)
        return None if found is None else found[2]

    @staticmethod
    def expert_names(name: str, num_experts: int) -> list[str]:
        """The E HF names of an experts rule's `to_hf` name: `{expert}` = 0 .. E - 1."""
        return [name.replace(_EXPERT_PLACEHOLDER, str(e)) for e in range(num_experts)]

    def _match_hf(self, name: str, ndim: int | None) -> tuple[str, str, int | None] | None:
        for rule, _, (hf_re, fields) in self._compiled:
            match = hf_re.fullmatch(name)
            if match and _kind_fits(rule.kind, ndim):
                values = {k: v.replace(".", "/") if fields[k] else v for k, v in _groups(match)}
                expert = values.pop(EXPERT_FIELD, None) if rule.kind == "experts" else None
                path = _fill(rule.flax, values)
                return path, rule.kind, None if expert is None else int(expert)
        return None

    def __repr__(self) -> str:
        return f"NameMap({list(self.rules)!r})"


def match_hf(name_map: NameMap, name: str, ndim: int | None) -> tuple[str, str, int | None] | None:
    """(Flax path, kind, expert index or None) of the HF tensor `name`, None if no rule maps it.

    `NameMap.to_flax` and `NameMap.expert_of` at once, for the importer.
    """
    return name_map._match_hf(name, ndim)


def _groups(match: re.Match) -> list[tuple[str, str]]:
    return list(match.groupdict().items())


def _kind_fits(kind: str, ndim: int | None) -> bool:
    if ndim is None or kind == "plain":
        return True
    return ndim == (1 if kind == "norm" else 2)


def expert_block(hf_template: str) -> str:
    """The HF module of an experts rule's name: what precedes `.{expert}`.

    E.g. "model.layers.0.mlp.experts" for "model.layers.0.mlp.experts.{expert}.up_proj.weight":
    the prefix engines build one fused MoE layer under and match against `ignore`.
    """
    return hf_template.partition(f".{_EXPERT_PLACEHOLDER}.")[0]


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


def _moe_rules(block: str, projections: Mapping[str, str]) -> list[NameRule]:
    """The router and experts rules of an MoE block: Flax `layers/{layer}/mlp`, HF `block`."""
    flax = "layers/{layer}/mlp"
    rules = [NameRule(f"{flax}/gate/kernel", f"{block}.gate.weight", "router")]
    for name, hf_name in projections.items():
        hf = f"{block}.experts.{_EXPERT_PLACEHOLDER}.{hf_name}.weight"
        rules.append(NameRule(f"{flax}/experts/{name}/kernel", hf, "experts"))
    return rules


def qwen3_moe_name_map() -> NameMap:
    """The map of a Qwen3-MoE (`Qwen3MoeForCausalLM`): mixture-of-experts blocks + Llama's.

    An MoE block at Flax `layers/{i}/mlp` holds the router `gate/kernel` (hidden, E) <->
    `model.layers.{i}.mlp.gate.weight` (E, hidden), kind "router" (high precision, named in
    `ignore`), and one stacked kernel per projection, `experts/gate_proj/kernel`,
    `experts/up_proj/kernel` (E, hidden, I) and `experts/down_proj/kernel` (E, I, hidden)
    <-> `model.layers.{i}.mlp.experts.{e}.gate_proj.weight` (I, hidden), `.up_proj`,
    `.down_proj` (hidden, I) for e = 0 .. E - 1, kind "experts". Everything else is
    `llama_name_map()`'s (attention, dense MLPs of `mlp_only_layers`, norms, Qwen3's
    `self_attn.q_norm` / `k_norm` as `layers/{i}/self_attn/q_norm/scale`).
    """
    projections = {p: p for p in ("gate_proj", "up_proj", "down_proj")}
    moe = _moe_rules("model.layers.{layer}.mlp", projections)
    return NameMap([*moe, *llama_name_map().rules])


def mixtral_name_map() -> NameMap:
    """The map of a Mixtral (`MixtralForCausalLM`): the same Flax layout, Mixtral's HF names.

    Flax `layers/{i}/mlp/gate/kernel` (the router) <->
    `model.layers.{i}.block_sparse_moe.gate.weight`; `layers/{i}/mlp/experts/gate_proj`,
    `up_proj`, `down_proj` (stacked kernels, as in `qwen3_moe_name_map`) <->
    `model.layers.{i}.block_sparse_moe.experts.{e}.w1`, `.w3`, `.w2` (`.weight` each). The
    fused pair of an expert is (w1, w3), which `DEFAULT_FUSED_GROUPS` holds. Everything else
    is `llama_name_map()`'s.
    """
    projections = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    moe = _moe_rules("model.layers.{layer}.block_sparse_moe", projections)
    return NameMap([*moe, *llama_name_map().rules])


def as_name_map(name_map) -> NameMap:
    """`name_map` as a `NameMap`: None is `llama_name_map()`, a list of rules is wrapped."""
    if name_map is None:
        return llama_name_map()
    return name_map if isinstance(name_map, NameMap) else NameMap(name_map)


# --- module names as engines match them -------------------------------------------------------


def engine_ignores(module: str, ignore: Sequence[str]) -> bool:
    """Whether an engine skips `module` for `ignore`: exact, substring, fnmatch (as vLLM)."""
    return any(p == module or p in module or fnmatch.fnmatchcase(module, p) for p in ignore)


def group_of(module: str, fused_groups) -> tuple[str, int] | None:
    """(parent module, index of its group in `fused_groups`) of a fused linear, else None."""
    parent, _, name = module.rpartition(".")
    for i, group in enumerate(fused_groups):
        if name in group:
            return parent, i
    return None
