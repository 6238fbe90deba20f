"""Rules: which layers compute in NVFP4, chosen by regular expressions on their module paths.

A `Rule` pairs a regular expression with a recipe: `Rule(r"mlp/", NVFP4Recipe())` puts
every layer whose path contains `mlp/` in NVFP4, `Rule("lm_head", None)` keeps the output
head in high precision. A path is the "/"-joined module path (`layers/3/mlp/down_proj` in
nnx, `layers_3/mlp/down_proj` in linen), matched with `re.search`; the first matching rule
wins and a layer no rule matches stays as it is.

`default_rules(num_layers)` is the NVIDIA NVFP4 paper's policy scaled to a model: the
embeddings, the output head and the first and last blocks in high precision (the paper
keeps the first 2 and last 8 of 62 blocks of its 12B model), everything else in NVFP4; an
MoE router (a module named `gate` or `router`) stays in high precision, as engines serve it.

The rules are applied by `quantize_model` (nnx, `nnx`), `quantize_linen` (linen,
`linen`), `inspect_model` (`diagnostics`) and `quantize_for_export` (`ptq`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from typing import Any

import jax.numpy as jnp

from nvfp4_jax._src.training.recipe import NVFP4Recipe

# The default rng stream stochastic rounding of the converted nnx layers draws from.
DEFAULT_RNG_COLLECTION = "quantize"
# The default pattern of a block index in a module path: nnx `layers/3/`, linen `layers_3/`.
LAYER_PATTERN = r"(?:^|/)layers[/_](\d+)(?:/|$)"
# The layers the paper keeps in high precision besides blocks: embeddings and output head.
EMBED_AND_HEAD = r"(?:^|/)(?:\w*embed\w*|lm_head|head)(?:/|$)"
# A mixture-of-experts router (Mixtral's and Qwen3-MoE's `gate`, gpt-oss' `router`): a whole
# path component, so `gate_proj` is not one. Engines compute it in high precision.
ROUTER = r"(?:^|/)(?:gate|router)(?:/|$)"


@dataclasses.dataclass(frozen=True)
class Rule:
    """Layers whose module path matches `pattern` compute with `recipe` (None: high precision).

    "High precision" is the layer's own computation (its `dtype`, bf16 in a bf16 model).

    Attributes:
      pattern: a regular expression, matched with `re.search` against the "/"-joined module
        path (e.g. `layers/3/mlp/down_proj`): `"lm_head"` matches anywhere, `"^lm_head$"`
        only the whole path, `""` or `".*"` every path.
      recipe: the `NVFP4Recipe` of the matched layers, or None to keep them in high precision.

    Example:
      >>> Rule(r"mlp/", NVFP4Recipe()).matches("layers/3/mlp/down_proj")
      True
      >>> Rule(pattern="lm_head", recipe=None).matches("layers/3/mlp/down_proj")
      False
    """

    pattern: str
    recipe: NVFP4Recipe | None
    _regex: re.Pattern = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.pattern, str):
            raise TypeError(f"{self!r}: pattern must be a str (a regular expression)")
        if self.recipe is not None and not isinstance(self.recipe, NVFP4Recipe):
            raise TypeError(f"{self!r}: recipe must be an NVFP4Recipe or None (high precision)")
        try:
            regex = re.compile(self.pattern)
        except re.error as error:
            raise ValueError(
                f"{self!r}: pattern is not a valid regular expression: {error}"
            ) from None
        object.__setattr__(self, "_regex", regex)

    def matches(self, path: str) -> bool:
        """Whether `path` (a "/"-joined module path) matches `pattern` (`re.search`)."""
        return self._regex.search(path) is not None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the pattern, and the recipe's fields (or None)."""
        return {"pattern": self.pattern, "recipe": recipe_to_dict(self.recipe)}

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> Rule:
        """The inverse of `to_dict`."""
        return cls(fields["pattern"], recipe_from_dict(fields["recipe"]))


def check_rules(rules: Iterable[Rule], op: str = "rules") -> tuple[Rule, ...]:
    """Returns `rules` as a tuple, checking that every element is a `Rule`.

    Raises:
      TypeError: for a single `Rule`, a string or an element that is not a `Rule`.
    """
    if isinstance(rules, (Rule, str)) or not isinstance(rules, Iterable):
        raise TypeError(f"{op}: rules must be a sequence of Rule, got {rules!r}")
    rules = tuple(rules)
    for index, rule in enumerate(rules):
        if not isinstance(rule, Rule):
            raise TypeError(f"{op}: rules[{index}] must be a Rule, got {rule!r}")
    return rules


def match_rule(rules: Sequence[Rule], path: str) -> tuple[int, Rule] | None:
    """The first rule matching `path`, with its index, or None when no rule matches.

    Example:
      >>> rules = [Rule("head", None), Rule("", NVFP4Recipe())]
      >>> match_rule(rules, "lm_head")[0], match_rule(rules, "layers/0/mlp/up_proj")[0]
      (0, 1)
    """
    for index, rule in enumerate(rules):
        if rule.matches(path):
            return index, rule
    return None


def match_layer(
    rules: Sequence[Rule], paths: Sequence[str], op: str = "rules"
) -> tuple[int, Rule] | None:
    """The rule of a layer held at `paths` (one layer, e.g. a tied head, at several paths).

    Each path is matched (`match_rule`); the paths no rule matches have no say. The rules
    matched must agree on what the layer computes with (the same recipe, or all None); the
    first path's rule is returned, or None when no path is matched.

    Raises:
      ValueError: two paths of the layer match rules with different recipes, naming both
        paths and both rules.

    Example:
      >>> rules = [Rule("lm_head", None), Rule("", NVFP4Recipe())]
      >>> match_layer(rules, ["embed_proj", "lm_head"])
      Traceback (most recent call last):
      ...
      ValueError: rules: one layer is held at 'embed_proj' and at 'lm_head', and their ...
    """
    decided = [(path, found) for path in paths if (found := match_rule(rules, path))]
    if not decided:
        return None
    first_path, first = decided[0]
    for path, found in decided[1:]:
        if found[1].recipe != first[1].recipe:
            raise ValueError(
                f"{op}: one layer is held at {first_path!r} and at {path!r}, and their rules "
                f"disagree: rules[{first[0]}] {first[1]!r} {_says(first[1])}, "
                f"rules[{found[0]}] {found[1]!r} {_says(found[1], short=True)}; add a rule "
                "for one of the paths that agrees with the other"
            )
    return first


def _says(rule: Rule, short: bool = False) -> str:
    if rule.recipe is None:
        return "in high precision" if short else "keeps it in high precision"
    return "in NVFP4" if short else "puts it in NVFP4"


def keep_bf16(*patterns: str) -> list[Rule]:
    """Rules keeping the layers that match any of `patterns` in high precision (their dtype).

    Example:
      >>> keep_bf16("lm_head", r"layers/0/")
      [Rule(pattern='lm_head', recipe=None), Rule(pattern='layers/0/', recipe=None)]
    """
    return [Rule(pattern, None) for pattern in patterns]


def _check_count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"default_rules: {name} must be a non-negative int, got {value!r}")
    return value


def default_rules(
    num_layers: int,
    *,
    first: int = 1,
    last: int = 1,
    recipe: NVFP4Recipe = NVFP4Recipe(),
    layer_pattern: str = LAYER_PATTERN,
    keep: Sequence[str] = (EMBED_AND_HEAD, ROUTER),
) -> list[Rule]:
    r"""The NVFP4 paper's policy: embeddings, head, first and last blocks high precision.

    NVIDIA's 12B model keeps the first 2 and the last 8 of its 62 blocks in bf16, with the
    embeddings and the output head; the last blocks show the largest weight-gradient error.
    For small models that scales to `first=1`, `last=1`.

    Args:
      num_layers: the number of blocks (decoder layers).
      first: blocks kept in high precision at the start of the stack.
      last: blocks kept in high precision at the end of the stack.
      recipe: the recipe of every other layer.
      layer_pattern: a regular expression with one group `(\d+)` capturing the block index
        (nnx `layers/3/`, linen `layers_3/` by default).
      keep: more patterns kept in high precision (default: embeddings and output head,
        `*embed*`, `lm_head` or `head` as a whole path component, and a mixture-of-experts
        router, `gate` or `router` as a whole path component; `ROUTER`).

    Returns:
      `keep` rules, a rule for the first and last blocks, then a catch-all NVFP4 rule.

    Example:
      >>> rules = default_rules(4)
      >>> [match_rule(rules, f"layers/{i}/mlp/up_proj")[1].recipe is None for i in range(4)]
      [True, False, False, True]
    """
    num_layers = _check_count(num_layers, "num_layers")
    first, last = _check_count(first, "first"), _check_count(last, "last")
    if first + last > num_layers:
        raise ValueError(
            f"default_rules: first + last = {first + last} exceeds num_layers = {num_layers}"
        )
    if not isinstance(layer_pattern, str) or layer_pattern.count(r"(\d+)") != 1:
        raise ValueError(
            "default_rules: layer_pattern must contain the group (\\d+) (the block index) "
            f"exactly once, got {layer_pattern!r}"
        )
    if isinstance(keep, str):
        raise TypeError(f"default_rules: keep must be a sequence of patterns, got {keep!r}")
    rules = keep_bf16(*keep)
    edges = [*range(first), *range(num_layers - last, num_layers)]
    if edges:
        alternatives = "|".join(str(index) for index in edges)
        rules.append(Rule(layer_pattern.replace(r"(\d+)", f"(?:{alternatives})"), None))
    rules.append(Rule(".*", recipe))
    return rules


def recipe_to_dict(recipe: NVFP4Recipe | None) -> dict[str, Any] | None:
    """A JSON-ready dict of a recipe's fields (the dtype by name), or None."""
    if recipe is None:
        return None
    fields = dataclasses.asdict(recipe)
    fields["gemm_dtype"] = jnp.dtype(recipe.gemm_dtype).name
    return fields


def recipe_from_dict(fields: dict[str, Any] | None) -> NVFP4Recipe | None:
    """The inverse of `recipe_to_dict`."""
    return None if fields is None else NVFP4Recipe(**fields)
