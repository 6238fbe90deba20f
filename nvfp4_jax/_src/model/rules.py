"""Whole-model NVFP4: which layers compute in NVFP4, chosen by rules on their module paths.

A `Rule` pairs a regular expression with a recipe: `Rule(r"mlp/", NVFP4Recipe())` puts
every layer whose path contains `mlp/` in NVFP4, `Rule("lm_head", None)` keeps the output
head in high precision. A path is the "/"-joined module path (`layers/3/mlp/down_proj` in
nnx, `layers_3/mlp/down_proj` in linen), matched with `re.search`; the first matching rule
wins and a layer no rule matches stays as it is.

* nnx: `quantize_model(model, rules)` turns the model's `nnx.Linear` layers into
  `nvfp4_jax.nnx.Linear` in place, keeping their parameter variables, and points the
  `nnx.Einsum` layers whose contraction is a plain dense one at the NVFP4 `dot_general`.
* linen: `quantize_linen(rules)` (a context manager) or `quantized(fn, rules)` intercept
  every `nn.Dense`, `nn.DenseGeneral` and `nn.Einsum` call whose path matches a rule and
  compute it with `nvfp4_dot_general(recipe)`; the parameters are Flax's own.
* Mixture-of-experts layers (`nvfp4_jax.nnx.Experts`, `nvfp4_jax.linen.Experts`: a
  (G, K, N) kernel) are matched by their path like a linear and take the rule's recipe (None:
  high precision), each expert's GEMMs with its own tensor amaxes.
* A frozen layer (an NVFP4 weight: `Linear.from_quantized`, `Experts.from_quantized`, a linen
  `Dense` with an `NVFP4Array` kernel) computes as it is: a rule matching it reports it
  "skipped" (`frozen_problem`).
* `default_rules(num_layers)` is the NVIDIA NVFP4 paper's policy scaled to a model: the
  embeddings, the output head and the first and last blocks in high precision (the paper
  keeps the first 2 and last 8 of 62 blocks of its 12B model), everything else in NVFP4;
  an MoE router (a module named `gate` or `router`) stays in high precision, as engines
  serve it.

Example:
  >>> from flax import nnx
  >>> class MLP(nnx.Module):
  ...     def __init__(self, rngs):
  ...         self.up = nnx.Linear(32, 64, rngs=rngs)
  ...         self.down = nnx.Linear(64, 32, rngs=rngs)
  ...     def __call__(self, x):
  ...         return self.down(jax.nn.relu(self.up(x)))
  >>> model = MLP(nnx.Rngs(0))
  >>> report = quantize_model(model, [Rule("down", None), Rule(".*", NVFP4Recipe())])
  >>> type(model.up).__module__, type(model.down).__module__
  ('nvfp4_jax.nnx', 'flax.nnx.nn.linear')
  >>> report["up"].action, report["down"].action
  ('nvfp4', 'high_precision')
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import string
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from nvfp4_jax._src.core import formats
from nvfp4_jax._src.core.array import NVFP4Array
from nvfp4_jax._src.flax import linen as nvfp4_linen
from nvfp4_jax._src.flax import nnx as nvfp4_nnx
from nvfp4_jax._src.training.dot_general import constrain_output, dot_general, nvfp4_dot_general
from nvfp4_jax._src.training.recipe import NVFP4Recipe

Action = Literal["nvfp4", "high_precision", "unmatched", "skipped"]

# The default rng stream stochastic rounding of the converted nnx layers draws from.
DEFAULT_RNG_COLLECTION = "quantize"
# The default pattern of a block index in a module path: nnx `layers/3/`, linen `layers_3/`.
LAYER_PATTERN = r"(?:^|/)layers[/_](\d+)(?:/|$)"
# The layers the paper keeps in high precision besides blocks: embeddings and output head.
EMBED_AND_HEAD = r"(?:^|/)(?:\w*embed\w*|lm_head|head)(?:/|$)"
# A mixture-of-experts router (Mixtral's and Qwen3-MoE's `gate`, gpt-oss' `router`): a whole
# path component, so `gate_proj` is not one. Engines compute it in high precision.
ROUTER = r"(?:^|/)(?:gate|router)(?:/|$)"


# --- rules --------------------------------------------------------------------------------------


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


# --- the report -------------------------------------------------------------------------------


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


@dataclasses.dataclass(frozen=True)
class LayerDecision:
    """What `quantize_model` (or the linen interceptor) did with one layer.

    Attributes:
      path: the "/"-joined module path.
      layer: the layer's class name (`Linear`, `Einsum`, `Dense`, `DenseGeneral`).
      action: "nvfp4" (computes in NVFP4), "high_precision" (a rule with recipe None),
        "unmatched" (no rule matched: left as it was) or "skipped" (an NVFP4 rule matched
        but the layer cannot be quantized: left as it was, see `reason`).
      rule: the index of the matching rule, or None.
      pattern: the matching rule's pattern, or None.
      recipe: the recipe the layer computes with ("nvfp4" only).
      reason: why a layer was skipped.
      aliases: the other paths of a layer held at several paths (a tied head), for which
        this decision holds too (`report[alias]` gives it).
      stack: the leading layer axes of a stacked layer (a kernel (L, K, N) made under
        `nnx.vmap` and run under `nnx.scan`: `(L,)`); `()` for a plain one.
    """

    path: str
    layer: str
    action: Action
    rule: int | None = None
    pattern: str | None = None
    recipe: NVFP4Recipe | None = None
    reason: str = ""
    aliases: tuple[str, ...] = ()
    stack: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        fields = dataclasses.asdict(self)
        fields["recipe"] = recipe_to_dict(self.recipe)
        return fields


@dataclasses.dataclass
class QuantizeReport:
    """Per module path, what became of each linear layer (a `LayerDecision`).

    Index it by path (`report["layers/0/mlp/up_proj"]`); `paths(action)` lists the paths of
    one action. A layer held at several paths has one entry, at its first path, listing the
    others as its `aliases`; indexing by an alias gives that entry.
    """

    layers: dict[str, LayerDecision] = dataclasses.field(default_factory=dict)
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)

    def __getitem__(self, path: str) -> LayerDecision:
        return self.layers[self.aliases.get(path, path)]

    def __contains__(self, path: object) -> bool:
        return path in self.layers or path in self.aliases

    def __len__(self) -> int:
        return len(self.layers)

    def paths(self, action: Action) -> list[str]:
        """The paths of the layers whose action is `action`, in path order."""
        return [path for path, entry in self.layers.items() if entry.action == action]

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """A JSON-ready dict: path -> `LayerDecision.to_dict()`."""
        return {path: entry.to_dict() for path, entry in self.layers.items()}

    def __str__(self) -> str:
        width = max((len(path) for path in self.layers), default=4)
        lines = []
        for path, entry in self.layers.items():
            rule = "-" if entry.rule is None else f"rules[{entry.rule}] {entry.pattern!r}"
            notes = [f"also at {', '.join(entry.aliases)}"] if entry.aliases else []
            if entry.stack:
                notes.append(f"stacked {'x'.join(map(str, entry.stack))}")
            if entry.reason:
                notes.append(entry.reason)
            detail = f" ({'; '.join(notes)})" if notes else ""
            lines.append(f"{path:<{width}}  {entry.layer:<12} {entry.action:<14} {rule}{detail}")
        return "\n".join(lines)

    def _record(
        self,
        path: str,
        layer: str,
        action: Action,
        found,
        reason: str = "",
        *,
        aliases: Sequence[str] = (),
        stack: Sequence[int] = (),
    ) -> None:
        index, rule = found if found is not None else (None, None)
        self.layers[path] = LayerDecision(
            path=path,
            layer=layer,
            action=action,
            rule=index,
            pattern=None if rule is None else rule.pattern,
            recipe=None if rule is None or action != "nvfp4" else rule.recipe,
            reason=reason,
            aliases=tuple(aliases),
            stack=tuple(stack),
        )
        for alias in aliases:
            self.aliases[alias] = path


# --- einsum -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EinsumPlan:
    """An einsum `lhs,rhs->out` as a dense `dot_general` followed by a transpose.

    Attributes:
      lhs_contract: the input's contracted axes.
      rhs_contract: the kernel's contracted axes, in the same order.
      perm: the transpose from `dot_general`'s (input free, kernel free) order to the output.
      k: the contracted size.
      n: the kernel's free size.
    """

    lhs_contract: tuple[int, ...]
    rhs_contract: tuple[int, ...]
    perm: tuple[int, ...]
    k: int
    n: int


def _expand_ellipsis(spec: str, lhs_ndim: int | None) -> tuple[str, str, str]:
    """(lhs, rhs, out) subscripts with an input `...` spelled as letters; ValueError if bad."""
    if spec.count("->") != 1 or spec.count(",") != 1:
        raise ValueError("needs the explicit form 'input,kernel->output' with two operands")
    operands, out = spec.split("->")
    lhs, rhs = operands.split(",")
    if "..." in rhs:
        raise ValueError("an ellipsis in the kernel's subscripts is not a dense weight")
    if "..." not in lhs:
        if "..." in out:
            raise ValueError("an ellipsis in the output needs one in the input")
        return lhs, rhs, out
    if "..." not in out:
        raise ValueError("an input ellipsis summed away is a reduction, not a dense contraction")
    free = [c for c in string.ascii_letters if c not in spec]
    count = 1 if lhs_ndim is None else lhs_ndim - (len(lhs) - 3)
    letters = "".join(free[: max(count, 0)])
    return lhs.replace("...", letters), rhs, out.replace("...", letters)


def _check_subscripts(lhs: str, rhs: str, out: str) -> list[str]:
    """The contracted letters of a plain dense einsum; ValueError naming what is not."""
    for name, subs in (("input", lhs), ("kernel", rhs), ("output", out)):
        if not subs.isalpha() and subs:
            raise ValueError(f"the {name} subscripts {subs!r} must be letters")
        if len(set(subs)) != len(subs):
            raise ValueError(f"the {name} subscripts {subs!r} repeat a letter (a diagonal)")
    if set(out) - set(lhs) - set(rhs):
        raise ValueError(f"the output subscripts {out!r} name letters of neither operand")
    batch = set(lhs) & set(rhs) & set(out)
    if batch:
        raise ValueError(f"batch dimension(s) {''.join(sorted(batch))!r} (in input and kernel)")
    summed = (set(lhs) ^ set(rhs)) - set(out)
    if summed:
        raise ValueError(f"dimension(s) {''.join(sorted(summed))!r} of one operand are summed")
    contracted = [c for c in lhs if c in rhs]
    if not contracted:
        raise ValueError("no dimension is contracted (an outer product)")
    return contracted


def einsum_plan(spec: str, rhs_shape: Sequence[int], lhs_ndim: int | None = None) -> EinsumPlan:
    """How an einsum of an input and one weight runs as the NVFP4 `dot_general`.

    Args:
      spec: the einsum string, `input,kernel->output` (an `...` in input and output allowed).
      rhs_shape: the kernel's shape.
      lhs_ndim: the input's rank (None: one dimension for an ellipsis, for a static check).

    Raises:
      ValueError: saying why the einsum is not a plain dense contraction (batch dimensions,
        sums, diagonals, a kernel rank that does not match), or why its contracted size K or
        kernel free size N is not a multiple of 16.
    """
    lhs, rhs, out = _expand_ellipsis(spec.replace(" ", ""), lhs_ndim)
    if len(rhs) != len(rhs_shape):
        raise ValueError(f"the kernel subscripts {rhs!r} do not match its shape {rhs_shape}")
    contracted = _check_subscripts(lhs, rhs, out)
    k = math.prod(rhs_shape[rhs.index(c)] for c in contracted)
    n = math.prod(size for c, size in zip(rhs, rhs_shape, strict=True) if c not in contracted)
    if k % formats.BLOCK_SIZE or n % formats.BLOCK_SIZE:
        raise ValueError(
            f"the contracted size K={k} and the kernel's free size N={n} must be multiples "
            f"of {formats.BLOCK_SIZE}"
        )
    result = [c for c in lhs if c not in contracted] + [c for c in rhs if c not in contracted]
    return EinsumPlan(
        lhs_contract=tuple(lhs.index(c) for c in contracted),
        rhs_contract=tuple(rhs.index(c) for c in contracted),
        perm=tuple(result.index(c) for c in out),
        k=k,
        n=n,
    )


@dataclasses.dataclass(frozen=True)
class NVFP4Einsum:
    """A `jnp.einsum` drop-in for an input and one weight, computed in NVFP4.

    `nnx.Einsum(..., einsum_op=NVFP4Einsum(recipe))` computes its contraction with the NVFP4
    `dot_general` (`einsum_plan` says which contractions qualify; others are an error).
    Stochastic rounding draws its bits from `key`, or, with None, from a key derived from the
    incoming gradient (it changes every step).

    Example:
      >>> op = NVFP4Einsum(NVFP4Recipe())
      >>> op("btd,dhe->bthe", jnp.ones((2, 4, 32)), jnp.ones((32, 2, 16))).shape
      (2, 4, 2, 16)
    """

    recipe: NVFP4Recipe = NVFP4Recipe()
    key: jax.Array | None = dataclasses.field(default=None, compare=False)

    def __call__(
        self,
        spec: str,
        lhs: jax.Array,
        rhs: jax.Array,
        *,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
        **kwargs,
    ) -> jax.Array:
        """`jnp.einsum(spec, lhs, rhs)` with NVFP4 GEMMs (`kwargs` are accepted, unused)."""
        del kwargs
        try:
            plan = einsum_plan(spec, jnp.shape(rhs), jnp.ndim(lhs))
        except ValueError as error:
            raise ValueError(f"NVFP4Einsum: {spec!r} cannot run in NVFP4: {error}") from None
        y = dot_general(
            lhs,
            rhs,
            ((plan.lhs_contract, plan.rhs_contract), ((), ())),
            precision,
            preferred_element_type,
            recipe=self.recipe,
            key=self.key,
        )
        return constrain_output(jnp.transpose(y, plan.perm), out_sharding)


# --- nnx ---------------------------------------------------------------------------------------


def _is_nvfp4_linear(layer) -> bool:
    return isinstance(layer, nvfp4_nnx.Linear)


# The nnx layers rules decide: linears, einsums and mixture-of-experts layers.
NNX_LAYERS = (nnx.Linear, nnx.Einsum, nvfp4_nnx.Experts)


def _dot_general_recipe(fn) -> NVFP4Recipe | None:
    """The recipe of a `nvfp4_dot_general(recipe)` function, None for any other function."""
    recipe = getattr(fn, "nvfp4_recipe", None)
    return recipe if isinstance(recipe, NVFP4Recipe) else None


def layer_recipe(layer) -> NVFP4Recipe | None:
    """The recipe an nnx layer computes with now, or None for high precision.

    An `nvfp4_jax.nnx.Linear` computes with its `recipe`, an `nnx.Linear` built with
    `dot_general=nvfp4_dot_general(recipe)` with that recipe, an `nnx.Einsum` with
    `einsum_op=NVFP4Einsum(recipe)` with that one, an `nvfp4_jax.nnx.Experts` with its
    `recipe`; a frozen layer (`frozen_problem`) and any other layer in high precision.

    Example:
      >>> layer = nnx.Linear(32, 16, dot_general=nvfp4_dot_general(), rngs=nnx.Rngs(0))
      >>> layer_recipe(layer) == NVFP4Recipe()
      True
    """
    if frozen_problem(layer):
        return None
    if _is_nvfp4_linear(layer):
        return layer.recipe
    if isinstance(layer, nnx.Linear):
        return _dot_general_recipe(layer.dot_general)
    if isinstance(layer, nnx.Einsum) and isinstance(layer.einsum_op, NVFP4Einsum):
        return layer.einsum_op.recipe
    if isinstance(layer, nvfp4_nnx.Experts):
        return layer.recipe
    return None


def frozen_problem(layer) -> str:
    """Why rules leave `layer` as it is because its weight is frozen ("" if it is not).

    Every frozen nnx layer (`Linear.from_quantized`, `Experts.from_quantized`) holds its
    weight as an `nvfp4_jax.nnx.QuantizedKernel`: an `NVFP4Array` that computes the same
    whatever a rule says, and that has no float weight to quantize or keep in high precision.

    Example:
      >>> frozen_problem(nnx.Linear(32, 16, rngs=nnx.Rngs(0)))
      ''
    """
    if isinstance(getattr(layer, "kernel", None), nvfp4_nnx.QuantizedKernel):
        return f"a frozen quantized weight ({type(layer).__name__}.from_quantized)"
    return ""


def _linear_kind_problem(layer: nnx.Linear) -> str:
    if type(layer) not in (nnx.Linear, nvfp4_nnx.Linear):
        return f"a subclass of nnx.Linear ({type(layer).__name__}) computes its own way"
    return ""


def weight_problem(shape: Sequence[int]) -> str:
    """Why a weight of `shape` cannot be an NVFP4 GEMM operand ("" if it can).

    Example:
      >>> weight_problem((24, 16))
      'in_features=24 and out_features=16 must be multiples of 16'
    """
    shape = tuple(shape)
    if len(shape) != 2:
        return f"its kernel {shape} is not a 2-D (in, out) matrix"
    if shape[0] % formats.BLOCK_SIZE or shape[1] % formats.BLOCK_SIZE:
        return (
            f"in_features={shape[0]} and out_features={shape[1]} must be multiples of "
            f"{formats.BLOCK_SIZE}"
        )
    return ""


def linear_stack(layer: nnx.Linear) -> tuple[int, ...] | None:
    """The leading layer axes of an `nnx.Linear`'s kernel: `()` for a plain (K, N) kernel.

    A stacked layer (made under `nnx.vmap`, run under `nnx.scan` over the layer axis, as in
    Flax's "scan over layers") holds a kernel `(L, K, N)` while its `in_features` and
    `out_features` are K and N: each step of the scan sees one (K, N) kernel. None when the
    kernel's last two axes are not `(in_features, out_features)`.

    Example:
      >>> linear_stack(nnx.Linear(32, 16, rngs=nnx.Rngs(0)))
      ()
    """
    shape = tuple(layer.kernel.shape)
    if len(shape) < 2 or shape[-2:] != (layer.in_features, layer.out_features):
        return None
    return shape[:-2]


def experts_stack(layer: nvfp4_nnx.Experts) -> tuple[int, ...] | None:
    """The leading layer axes of an `Experts` kernel `(*stack, G, K, N)`: `()` for (G, K, N).

    None when the kernel's last three axes are not `(num_experts, in_features, out_features)`.
    """
    shape = tuple(layer.kernel.shape)
    if len(shape) < 3 or shape[-3:] != (layer.num_experts, layer.in_features, layer.out_features):
        return None
    return shape[:-3]


def experts_problem(layer: nvfp4_nnx.Experts) -> str:
    """Why an `nvfp4_jax.nnx.Experts` layer cannot compute in NVFP4 ("" if it can).

    Each expert's (K, N) matrix is one GEMM's weight: K and N must be multiples of 16. Frozen
    experts (`Experts.from_quantized`) cannot (`frozen_problem`).

    Example:
      >>> experts_problem(nvfp4_nnx.Experts(4, 24, 16, recipe=None, rngs=nnx.Rngs(0)))
      'in_features=24 and out_features=16 must be multiples of 16'
    """
    problem = frozen_problem(layer)
    if problem:
        return problem
    if type(layer) is not nvfp4_nnx.Experts:
        return f"a subclass of Experts ({type(layer).__name__}) computes its own way"
    if experts_stack(layer) is None:
        return (
            f"its kernel {tuple(layer.kernel.shape)} is not a stack of ({layer.num_experts}, "
            f"{layer.in_features}, {layer.out_features}) expert matrices"
        )
    return weight_problem(tuple(layer.kernel.shape)[-2:])


def layer_stack(layer) -> tuple[int, ...]:
    """The leading layer axes of a stacked layer's kernel (`()` for a plain one)."""
    if isinstance(layer, nnx.Linear):
        return linear_stack(layer) or ()
    if isinstance(layer, nvfp4_nnx.Experts):
        return experts_stack(layer) or ()
    return ()


def _linear_shape_problem(layer: nnx.Linear) -> str:
    shape = tuple(layer.kernel.shape)
    if linear_stack(layer) is None:
        return (
            f"its kernel {shape} is neither an (in, out) = ({layer.in_features}, "
            f"{layer.out_features}) matrix nor a stack of them"
        )
    return weight_problem(shape[-2:])


def linear_problem(layer: nnx.Linear) -> str:
    """Why the `nnx.Linear` `layer` cannot compute in NVFP4 ("" if it can).

    It cannot when it is a subclass (its own `__call__` would be lost), a frozen quantized
    layer (`Linear.from_quantized`), or its sizes are not multiples of 16. A stacked layer
    (kernel `(L, K, N)`, see `linear_stack`) can: each of its (K, N) slices is one GEMM.

    Example:
      >>> linear_problem(nnx.Linear(32, 16, rngs=nnx.Rngs(0)))
      ''
    """
    return frozen_problem(layer) or _linear_kind_problem(layer) or _linear_shape_problem(layer)


def _linear_config(layer: nnx.Linear) -> dict[str, Any]:
    return dict(
        use_bias=layer.bias is not None,
        dtype=layer.dtype,
        param_dtype=layer.param_dtype,
        precision=layer.precision,
        promote_dtype=layer.promote_dtype,
        preferred_element_type=layer.preferred_element_type,
    )


def _adopt(new: nnx.Linear, old: nnx.Linear) -> nnx.Linear:
    """`new` (built abstract) with `old`'s very parameter variables."""
    new.kernel = old.kernel
    new.bias = old.bias if old.bias is not None else nnx.data(None)
    return new


def _to_nvfp4(layer: nnx.Linear, recipe: NVFP4Recipe, rngs: nnx.Rngs, stream: str):
    """An NVFP4 `Linear` holding `layer`'s variables (`layer` itself if nothing changes).

    A stacked layer's per-layer state gets its layer axes too, so that `nnx.scan` (or
    `nnx.vmap`) hands every step its own: the calibration `input_amax` is `zeros(stack)`,
    the stochastic-rounding stream holds one key and one count per layer.
    """
    if layer_recipe(layer) == recipe:
        return layer
    stack = linear_stack(layer)
    config = _linear_config(layer)
    new = nnx.eval_shape(
        lambda: nvfp4_nnx.Linear(
            layer.in_features, layer.out_features, recipe=recipe, rngs=nnx.Rngs(0), **config
        )
    )
    new.input_amax = nvfp4_nnx.InputAmax(jnp.zeros(stack, jnp.float32))
    if not recipe.stochastic_rounding:
        new.quantize_rngs = nnx.data(None)
    else:
        new.quantize_rngs = rngs[stream].split(stack) if stack else rngs[stream].fork()
    return _adopt(new, layer)


def _to_high_precision(layer: nnx.Linear) -> nnx.Linear:
    """A plain `nnx.Linear` holding `layer`'s variables (`layer` itself if it is one).

    An `nnx.Linear` built with `dot_general=nvfp4_dot_general(...)` gets back the default
    `jax.lax.dot_general`.
    """
    if not _is_nvfp4_linear(layer):
        if _dot_general_recipe(layer.dot_general) is not None:
            layer.dot_general = jax.lax.dot_general
        return layer
    config = _linear_config(layer)
    new = nnx.eval_shape(
        lambda: nnx.Linear(layer.in_features, layer.out_features, rngs=nnx.Rngs(0), **config)
    )
    return _adopt(new, layer)


def _set_experts_recipe(
    layer: nvfp4_nnx.Experts, recipe: NVFP4Recipe | None, rngs: nnx.Rngs, stream: str
) -> None:
    """Points an `Experts` layer (in place) at `recipe`, with a stacked SR stream if stacked."""
    if layer.recipe == recipe:
        return
    if recipe is not None and recipe.stochastic_rounding and layer.quantize_rngs is None:
        stack = experts_stack(layer) or ()
        layer.quantize_rngs = rngs[stream].split(stack) if stack else rngs[stream].fork()
    layer.set_recipe(recipe)


def _einsum_problem(layer: nnx.Einsum) -> str:
    if type(layer) is not nnx.Einsum:
        return f"a subclass of nnx.Einsum ({type(layer).__name__}) computes its own way"
    if layer.einsum_str is None:
        return "its einsum_str is given at call time"
    try:
        einsum_plan(layer.einsum_str, tuple(layer.kernel.shape))
    except ValueError as error:
        return f"{layer.einsum_str!r}: {error}"
    return ""


def _path_str(path: tuple) -> str:
    return "/".join(str(part) for part in path)


def layer_paths(model: nnx.Module) -> dict[str, tuple[nnx.Module, tuple[str, ...]]]:
    """Maps first path -> (layer, all its paths) for every linear, einsum and `Experts` layer.

    A layer held at several paths (a head tied to another projection: `model.head =
    model.embed_proj`) is listed once, under the first of its paths in path order; the
    tuple holds all of them, that one first. Layers come in path order.

    Example:
      >>> class Tied(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.embed_proj = nnx.Linear(16, 16, rngs=rngs)
      ...         self.head = self.embed_proj
      >>> [paths for _, paths in layer_paths(Tied(nnx.Rngs(0))).values()]
      [('embed_proj', 'head')]
    """
    found: dict[int, tuple[Any, list[str]]] = {}

    def visit(node, path: tuple, ancestors: frozenset) -> None:
        if isinstance(node, NNX_LAYERS):
            found.setdefault(id(node), (node, []))[1].append(_path_str(path))
        impl = nnx.graphlib.get_node_impl(node)
        if impl is None or id(node) in ancestors:  # a leaf, or a reference back up
            return
        inner = ancestors | {id(node)}
        for key, child in impl.node_dict(node).items():
            if not (isinstance(key, str) and key.startswith("_pytree__")):
                visit(child, (*path, key), inner)

    visit(model, (), frozenset())
    layers = {}
    for layer, paths in found.values():
        paths = tuple(sorted(dict.fromkeys(paths), key=_natural_key))
        layers[paths[0]] = (layer, paths)
    return dict(sorted(layers.items(), key=lambda item: _natural_key(item[0])))


def named_layers(model: nnx.Module) -> dict[str, nnx.Module]:
    """Maps path -> layer for every `nnx.Linear`, `nnx.Einsum` and `Experts`, in path order.

    Paths are "/"-joined (`layers/3/mlp/down_proj`) and sorted with block indices in number
    order; a layer held at several paths is listed once, at its first (`layer_paths` gives
    all of them).

    Example:
      >>> list(named_layers(nnx.Sequential(nnx.Linear(16, 16, rngs=nnx.Rngs(0)))))
      ['layers/0']
    """
    return {path: layer for path, (layer, _) in layer_paths(model).items()}


def _holders(model: nnx.Module, targets: dict[int, Any]) -> dict[int, list[tuple[Any, Any]]]:
    """For each target (by id), every (parent node, key) holding it: shared ones included."""
    holders: dict[int, list] = {ident: [] for ident in targets}
    for _, node in nnx.iter_graph(model):
        impl = nnx.graphlib.get_node_impl(node)
        if impl is None or isinstance(node, NNX_LAYERS):
            continue
        for key, child in impl.node_dict(node).items():
            if id(child) in holders and child is targets[id(child)]:
                holders[id(child)].append((node, key))
    return holders


def _point(holders: list[tuple[Any, Any]], new) -> str:
    """Points every holder at `new`; returns why it cannot ("" when done)."""
    for parent, _ in holders:
        if not isinstance(parent, (nnx.Module, list, dict)):
            return f"it is held in a {type(parent).__name__}, which cannot be changed in place"
    if not holders:
        return "it is the model itself (only the layers a model holds can be replaced)"
    for parent, key in holders:
        if isinstance(key, int) or isinstance(parent, (list, dict)):
            parent[key] = new
        else:
            setattr(parent, key, new)
    return ""


def replace_layers(model: nnx.Module, replacements: Sequence[tuple[Any, Any]]) -> list[str]:
    """Replaces layers of `model` in place: each `(old, new)` pair, wherever `old` is held.

    Returns:
      Per pair, "" when replaced, else why not (the layer is the model itself, or is held in
      an immutable container such as a tuple).
    """
    targets = {id(old): old for old, _ in replacements}
    holders = _holders(model, targets)
    return [_point(holders[id(old)], new) for old, new in replacements]


def _natural_key(path: str) -> list:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("/")]


def _check_rngs(rngs, stream: str) -> nnx.Rngs:
    if rngs is None:
        return nnx.Rngs(**{stream: 0})
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"quantize_model: rngs must be an nnx.Rngs or None, got {rngs!r}")
    try:
        rngs[stream]
    except KeyError:
        raise ValueError(
            f"quantize_model: rngs has neither a {stream!r} stream nor a default one"
        ) from None
    return rngs


def _convert_experts(layer: nvfp4_nnx.Experts, rule: Rule, rngs: nnx.Rngs, stream: str):
    problem = experts_problem(layer) if rule.recipe is not None else ""
    if problem:
        return layer, "skipped", problem
    _set_experts_recipe(layer, rule.recipe, rngs, stream)
    return layer, "nvfp4" if rule.recipe is not None else "high_precision", ""


def _convert_einsum(layer: nnx.Einsum, rule: Rule):
    if rule.recipe is None:
        if isinstance(layer.einsum_op, NVFP4Einsum):
            layer.einsum_op = jnp.einsum
        return layer, "high_precision", ""
    problem = _einsum_problem(layer)
    if problem:
        return layer, "skipped", problem
    layer.einsum_op = NVFP4Einsum(rule.recipe)
    return layer, "nvfp4", ""


def _convert(layer, rule: Rule, rngs: nnx.Rngs, stream: str):
    """(new layer, action, reason) for a layer a rule matched."""
    problem = frozen_problem(layer)
    if problem:  # whatever the rule's recipe: a frozen weight stays as it is
        return layer, "skipped", problem
    if isinstance(layer, nvfp4_nnx.Experts):
        return _convert_experts(layer, rule, rngs, stream)
    if isinstance(layer, nnx.Einsum):
        return _convert_einsum(layer, rule)
    problem = _linear_kind_problem(layer)
    if problem:
        return layer, "skipped", problem
    if rule.recipe is None:
        return _to_high_precision(layer), "high_precision", ""
    problem = _linear_shape_problem(layer)
    if problem:
        return layer, "skipped", problem
    return _to_nvfp4(layer, rule.recipe, rngs, stream), "nvfp4", ""


def quantize_model(
    model: nnx.Module,
    rules: Sequence[Rule],
    *,
    rngs: nnx.Rngs | None = None,
    rng_collection: str = DEFAULT_RNG_COLLECTION,
) -> QuantizeReport:
    """Puts the linear layers of an nnx model in NVFP4 (or high precision) by rules, in place.

    Every `nnx.Linear` whose path matches a rule with a recipe becomes an
    `nvfp4_jax.nnx.Linear` with that recipe, holding the very same kernel and bias variables
    (values, dtype, metadata) and the layer's `dtype`, `param_dtype`, `precision`,
    `promote_dtype` and `preferred_element_type`; one matching a rule with recipe None
    becomes (or stays) a plain `nnx.Linear` computing with `jax.lax.dot_general` (also one
    built with `dot_general=nvfp4_dot_general()`). An `nnx.Einsum` whose contraction is a
    plain dense one (`einsum_plan`) gets `einsum_op=NVFP4Einsum(recipe)`. A layer whose sizes
    are not multiples of 16, an einsum with batch dimensions or sums, and a frozen quantized
    layer (`Linear.from_quantized`, `Experts.from_quantized`: `frozen_problem`; whatever the
    rule's recipe) stay as they are, reported "skipped" with the reason. A layer no rule
    matches is left alone. An `nvfp4_jax.nnx.Experts` layer (the (G, K, N)
    experts of an MoE block) stays the same object and takes the rule's recipe
    (`Experts.set_recipe`; None: high precision); its sizes K and N must be multiples of 16.

    A layer held at several paths (a tied head) is decided by the rules its paths match
    (`match_layer`: they must agree, else ValueError), replaced at all of them, and reported
    once, at its first path, with the others as `aliases`. A stacked layer (an
    `nnx.Linear` made under `nnx.vmap`, kernel `(L, K, N)`, run under `nnx.scan`) becomes
    one `nvfp4_jax.nnx.Linear` holding the same stacked kernel, its calibration amax and
    stochastic-rounding stream stacked alike, so that every step of the scan runs the
    ordinary NVFP4 GEMM of its own (K, N) slice, with its own amax; the report gives its
    `stack`.

    Stochastic rounding: each converted `Linear` forks its own stream from
    `rngs[rng_collection]` (the default stream if there is none of that name) and draws a
    fresh key on every call; without `rngs`, from `nnx.Rngs(quantize=0)`. An `Einsum` derives
    its key from the incoming gradient's bits (`nvfp4_dot_general`'s default).

    Args:
      model: the nnx model; changed in place (create the optimizer afterwards, or keep
        using the one you have: the parameter variables are the same objects).
      rules: `Rule`s, first match wins.
      rngs: where the converted layers' stochastic-rounding streams fork from.
      rng_collection: the stream name.

    Returns:
      The `QuantizeReport`: per path, what the layer became and by which rule.

    Raises:
      TypeError: `model` is not an nnx Module, `rules` holds something other than `Rule`s,
        `rngs` is not an `nnx.Rngs`.
      ValueError: `rngs` has no stream to fork from, or two paths of one layer match rules
        that disagree (nothing is changed then).
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"quantize_model: model must be a flax.nnx.Module, got {type(model)}")
    rules = check_rules(rules, "quantize_model")
    rngs = _check_rngs(rngs, rng_collection)
    layers = layer_paths(model)
    # Every rule is resolved (and a shared layer's conflict raised) before anything changes.
    found = {
        path: match_layer(rules, paths, "quantize_model") for path, (_, paths) in layers.items()
    }
    report = QuantizeReport()
    pending = []
    for path, (layer, paths) in layers.items():
        kind = type(layer).__name__
        stack = layer_stack(layer)
        notes = dict(aliases=paths[1:], stack=stack)
        if found[path] is None:
            report._record(path, kind, "unmatched", None, **notes)
            continue
        new, action, reason = _convert(layer, found[path][1], rngs, rng_collection)
        report._record(path, kind, action, found[path], reason, **notes)
        if new is not layer:
            pending.append((path, layer, new))
    failures = replace_layers(model, [(layer, new) for _, layer, new in pending])
    for (path, _, _), reason in zip(pending, failures, strict=True):
        if reason:
            entry = report[path]
            report._record(
                path,
                entry.layer,
                "skipped",
                (entry.rule, rules[entry.rule]),
                reason,
                aliases=entry.aliases,
                stack=entry.stack,
            )
    return report


# --- linen -------------------------------------------------------------------------------------

_LINEN_LAYERS = (nn.Dense, nn.DenseGeneral, nn.Einsum, nvfp4_linen.Experts)
_LINEN_KNOWN = (*_LINEN_LAYERS, nvfp4_linen.Dense)


def _as_tuple(value) -> tuple:
    return tuple(value) if isinstance(value, Sequence) else (value,)


def _first_arg(args: tuple, kwargs: dict, name: str):
    return args[0] if args else kwargs[name]


def _linen_problem(module: nn.Module, args: tuple, kwargs: dict) -> str:
    """Why a Dense/DenseGeneral/Experts call cannot run in NVFP4 ("" if it can)."""
    inputs = _first_arg(args, kwargs, "inputs")
    if isinstance(module, nvfp4_linen.Experts):
        k, n = jnp.shape(inputs)[-1], module.features
    elif isinstance(module, nn.DenseGeneral):
        if _as_tuple(module.batch_dims):
            return f"batch_dims={module.batch_dims} (a batched contraction)"
        k = math.prod(jnp.shape(inputs)[a] for a in _as_tuple(module.axis))
        n = math.prod(_as_tuple(module.features))
    else:
        k, n = jnp.shape(inputs)[-1], module.features
    if k % formats.BLOCK_SIZE or n % formats.BLOCK_SIZE:
        return f"K={k} and N={n} must be multiples of {formats.BLOCK_SIZE}"
    return ""


def _linen_key(module: nn.Module, recipe: NVFP4Recipe, stream: str) -> jax.Array | None:
    if recipe.stochastic_rounding and module.has_rng(stream):
        return module.make_rng(stream)
    return None


@contextlib.contextmanager
def _fields(module: nn.Module, **values) -> Iterator[None]:
    """Temporarily sets fields of a (frozen) linen module; restores them afterwards."""
    saved = {name: getattr(module, name) for name in values}
    try:
        for name, value in values.items():
            object.__setattr__(module, name, value)
        yield
    finally:
        for name, value in saved.items():
            object.__setattr__(module, name, value)


def _linen_einsum(module: nn.Einsum, args: tuple, kwargs: dict, op: NVFP4Einsum) -> jax.Array:
    """`nn.Einsum.__call__` with the NVFP4 einsum: the same parameters, names and shapes."""
    inputs = _first_arg(args, kwargs, "inputs")
    spec = _einsum_spec(module, args, kwargs).replace(" ", "")
    kernel = module.param("kernel", module.kernel_init, module.shape, module.param_dtype)
    bias = None
    if module.use_bias:
        bias_shape, broadcast_shape = module._get_bias_shape(spec, inputs, kernel)
        bias = module.param("bias", module.bias_init, bias_shape, module.param_dtype)
    inputs, kernel, bias = module.promote_dtype(inputs, kernel, bias, dtype=module.dtype)
    y = op(spec, inputs, kernel, preferred_element_type=module.preferred_element_type)
    return y if bias is None else y + jnp.reshape(bias, broadcast_shape)


def _einsum_spec(module: nn.Einsum, args: tuple, kwargs: dict) -> str | None:
    spec = args[1] if len(args) > 1 else kwargs.get("einsum_str")
    return spec if spec is not None else module.einsum_str


def _linen_einsum_problem(module: nn.Einsum, args: tuple, kwargs: dict) -> str:
    spec = _einsum_spec(module, args, kwargs)
    if spec is None:
        return "no einsum_str"
    try:
        einsum_plan(spec, tuple(module.shape), jnp.ndim(_first_arg(args, kwargs, "inputs")))
    except ValueError as error:
        return f"{spec!r}: {error}"
    return ""


class _Interceptor:
    """The linen method interceptor of `quantize_linen`."""

    def __init__(self, rules: tuple[Rule, ...], report: QuantizeReport, stream: str):
        self.rules, self.report, self.stream = rules, report, stream

    def __call__(self, next_fun: Callable, args: tuple, kwargs: dict, context) -> Any:
        module = context.module
        if context.method_name != "__call__" or not isinstance(module, _LINEN_LAYERS):
            return next_fun(*args, **kwargs)
        path = _path_str(module.path)
        found = match_rule(self.rules, path)
        action, reason = _linen_decision(module, found, args, kwargs)
        self.report._record(path, type(module).__name__, action, found, reason)
        if action == "high_precision" and isinstance(module, nvfp4_linen.Experts):
            with _fields(module, recipe=None):
                return next_fun(*args, **kwargs)
        if action == "high_precision" and _dot_general_recipe(getattr(module, "dot_general", None)):
            # A layer built with `dot_general=nvfp4_dot_general()`: back to `lax.dot_general`.
            with _fields(module, dot_general=None):
                return next_fun(*args, **kwargs)
        if action != "nvfp4":
            return next_fun(*args, **kwargs)
        return self._nvfp4(module, found[1].recipe, args, kwargs, next_fun)

    def _nvfp4(self, module, recipe: NVFP4Recipe, args, kwargs, next_fun) -> Any:
        if isinstance(module, (nvfp4_linen.Dense, nvfp4_linen.Experts)):
            with _fields(module, recipe=recipe, rng_collection=self.stream):
                return next_fun(*args, **kwargs)
        key = _linen_key(module, recipe, self.stream)
        if isinstance(module, nn.Einsum):
            return _linen_einsum(module, args, kwargs, NVFP4Einsum(recipe, key))
        with _fields(module, dot_general=nvfp4_dot_general(recipe, key), dot_general_cls=None):
            return next_fun(*args, **kwargs)


def _linen_decision(module: nn.Module, found, args: tuple, kwargs: dict) -> tuple[Action, str]:
    """(action, reason) for a linen layer call, given the matching rule (or None)."""
    if found is None:
        return "unmatched", ""
    if module.has_variable("params", "kernel") and isinstance(
        module.get_variable("params", "kernel"), NVFP4Array
    ):
        return "skipped", "a frozen quantized weight (an NVFP4Array kernel)"
    if type(module) not in _LINEN_KNOWN:
        return "skipped", f"a subclass ({type(module).__name__}) is not intercepted"
    is_nvfp4 = isinstance(module, nvfp4_linen.Dense)
    if found[1].recipe is None:
        if is_nvfp4:
            return "skipped", "an nvfp4_jax.linen.Dense computes in NVFP4 by itself"
        return "high_precision", ""
    if is_nvfp4:
        return "nvfp4", ""
    checker = _linen_einsum_problem if isinstance(module, nn.Einsum) else _linen_problem
    problem = checker(module, args, kwargs)
    return ("skipped", problem) if problem else ("nvfp4", "")


@contextlib.contextmanager
def quantize_linen(
    rules: Sequence[Rule], *, rng_collection: str = DEFAULT_RNG_COLLECTION
) -> Iterator[QuantizeReport]:
    """Within the block, linen `Dense`/`DenseGeneral`/`Einsum` calls follow `rules`.

    Every `nn.Dense`, `nn.DenseGeneral` (without `batch_dims`) and `nn.Einsum` (a plain dense
    contraction, `einsum_plan`) called inside the block whose module path (`module.path`
    "/"-joined, e.g. `layers_0/mlp/down_proj`) matches a rule with a recipe computes with
    `nvfp4_dot_general(recipe)`; the parameters (names, shapes, initializers) are Flax's own,
    so `init` and `apply` see the same tree as without the rules. Stochastic rounding draws
    from the `rng_collection` rngs when `apply` is given them (`rngs={"quantize": key}`),
    else from a key derived from the incoming gradient. An `nvfp4_jax.linen.Dense` a rule
    matches takes the rule's recipe, and so does an `nvfp4_jax.linen.Experts` (None: high
    precision); a `Dense` whose kernel is an `NVFP4Array` (frozen) computes as it is, reported
    "skipped". A layer built with `dot_general=nvfp4_dot_general()`
    that a rule with recipe None matches computes with `jax.lax.dot_general` (high
    precision, as reported); one a rule with a recipe matches, with that recipe.

    Use it inside the function that `jax.jit` traces (or wrap with `quantized`): a function
    jitted outside the block keeps what it was traced with.

    Yields:
      A `QuantizeReport`, filled as the layers are called.

    Example:
      >>> import flax.linen as nn
      >>> layer = nn.Dense(16)
      >>> params = layer.init(jax.random.key(0), jnp.ones((4, 32)))
      >>> with quantize_linen([Rule(".*", NVFP4Recipe())]) as report:
      ...     y = layer.apply(params, jnp.ones((4, 32)))
      >>> report[""].action
      'nvfp4'
    """
    rules = check_rules(rules, "quantize_linen")
    report = QuantizeReport()
    with nn.intercept_methods(_Interceptor(rules, report, rng_collection)):
        yield report


def quantized(
    fn: Callable, rules: Sequence[Rule], *, rng_collection: str = DEFAULT_RNG_COLLECTION
) -> Callable:
    """`fn` (e.g. `model.apply`, or a loss calling it) run inside `quantize_linen(rules)`.

    Example:
      >>> import flax.linen as nn
      >>> model = nn.Dense(16)
      >>> params = model.init(jax.random.key(0), jnp.ones((4, 32)))
      >>> apply = jax.jit(quantized(model.apply, [Rule(".*", NVFP4Recipe())]))
      >>> apply(params, jnp.ones((4, 32))).shape
      (4, 16)
    """
    rules = check_rules(rules, "quantized")
    if not callable(fn):
        raise TypeError(f"quantized: fn must be callable, got {fn!r}")

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with quantize_linen(rules, rng_collection=rng_collection):
            return fn(*args, **kwargs)

    return wrapped
