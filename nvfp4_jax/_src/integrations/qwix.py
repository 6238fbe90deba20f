"""An NVFP4 qwix provider: `qwix.quantize_model(model, NVFP4Provider(rules), *inputs)`.

qwix intercepts the ops a Flax model (nnx or linen) issues and hands each to its provider
with the path of the module that issued it. `NVFP4Provider` computes the ops an
`NVFP4Rule` matches with the NVFP4 training recipe:

* `jax.lax.dot_general` with one weight operand (a parameter of the issuing module):
  `nvfp4_jax.dot_general` (fprop, dgrad and wgrad in NVFP4), the weight as its rhs;
* `jnp.einsum` of an activation and a weight: the same, its plan `einsum_plan` (batch
  letters, such as an expert axis, are batched GEMMs);
* `jax.lax.ragged_dot` (a dropless MoE's experts): `nvfp4_jax.ragged_dot`.

An op of two activations (attention's `q @ k^T`), a convolution, an op whose sizes NVFP4
cannot block (K or N not a multiple of 16) and every op of a rule with `recipe=None` stay
in high precision, as `jax.lax` computes them. Plain qwix rules in the same list keep
qwix's own behaviour. What happened to each op is in `provider.report`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, nnx

try:
    import qwix
    from qwix._src.utils import flax_util
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "nvfp4_jax.qwix needs qwix (pip install 'nvfp4_jax[qwix]' or pip install qwix)"
    ) from error

from nvfp4_jax._src.core import formats
from nvfp4_jax._src.flax.einsum import einsum_plan
from nvfp4_jax._src.model.convert.report import LayerDecision, QuantizeReport
from nvfp4_jax._src.model.convert.rules import Rule
from nvfp4_jax._src.training.dot_general import constrain_output, dot_general
from nvfp4_jax._src.training.ragged.ragged_dot import ragged_dot
from nvfp4_jax._src.training.recipe import NVFP4Recipe

_BLOCK = formats.BLOCK_SIZE
# The global inline flags a Python regular expression may open with, e.g. `(?i)` or `(?im)`.
_GLOBAL_FLAGS = re.compile(r"(?:\(\?[aiLmsux]+\))*")
# The value a transformation's tracer carries: grad's (JVP, linearize) `primal`, vmap's `val`.
_CARRIED = ("primal", "val")


def search_pattern(pattern: str) -> str:
    """A regular expression that `re.fullmatch`es exactly where `pattern` `re.search`es.

    nvfp4_jax's `Rule` matches a module path with `re.search`, qwix with `re.fullmatch`.

    Example:
      >>> import re
      >>> bool(re.fullmatch(search_pattern("mlp/"), "layers/3/mlp/down_proj"))
      True
      >>> bool(re.fullmatch(search_pattern("^lm_head$"), "layers/3/lm_head"))
      False
      >>> bool(re.fullmatch(search_pattern("(?i)LM_HEAD"), "model/lm_head"))
      True
    """
    try:
        verbose = re.compile(pattern).flags & re.VERBOSE
    except (re.error, TypeError) as error:
        raise ValueError(
            f"search_pattern: {pattern!r} is not a regular expression: {error}"
        ) from None
    # Global inline flags (`(?i)`) must open the whole expression: they move to its start.
    flags = _GLOBAL_FLAGS.match(pattern).group()
    body = pattern[len(flags) :]
    # In verbose mode a `#` comment runs to the end of the line: end the body's line.
    return f"{flags}(?s:.*?)(?:{body}{chr(10) if verbose else ''})(?s:.*)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class NVFP4Rule(qwix.QtRule):
    """A qwix rule whose ops compute with an `NVFP4Recipe` (None: in high precision).

    `module_path` is matched with `re.fullmatch` against the path of the module that issues
    the op (qwix's matching; `NVFP4Rule.from_rule` converts an nvfp4_jax `Rule`, which
    matches with `re.search`). `op_names` narrows the rule to some of `"dot_general"`,
    `"einsum"` and `"ragged_dot"`, as in qwix.

    Attributes:
      recipe: the `NVFP4Recipe` of the matched ops, or None to keep them in high precision.
      rng_stream: the Flax rng stream stochastic rounding draws a fresh key from on every
        call (linen: `apply(..., rngs={stream: key})`; nnx: qwix's
        `model.set_attributes(qwix_rngs=nnx.Rngs(stream=...))`). None derives each GEMM's
        key from the bits of its incoming gradient, as the drop-ins do with `key=None`.

    Example:
      >>> NVFP4Rule(module_path=".*mlp.*", recipe=NVFP4Recipe()).recipe.weight_2d
      True
    """

    recipe: NVFP4Recipe | None = NVFP4Recipe()
    rng_stream: str | None = None

    def __post_init__(self):
        if self.recipe is not None and not isinstance(self.recipe, NVFP4Recipe):
            raise TypeError(
                f"NVFP4Rule: recipe must be an NVFP4Recipe or None, got {self.recipe!r}"
            )
        if self.rng_stream is not None and not isinstance(self.rng_stream, str):
            raise TypeError(f"NVFP4Rule: rng_stream must be a str or None, got {self.rng_stream!r}")
        for name in ("weight_qtype", "act_qtype", "bwd_qtype"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"NVFP4Rule: {name}={getattr(self, name)!r}: an NVFP4 rule computes with "
                    "its recipe; leave qwix's qtypes unset (or use a plain qwix rule)"
                )
        try:
            re.compile(self.module_path)
        except (re.error, TypeError) as error:
            raise ValueError(
                f"NVFP4Rule: module_path {self.module_path!r} is not a regular expression: {error}"
            ) from None

    @classmethod
    def from_rule(cls, rule: Rule, *, rng_stream: str | None = None) -> NVFP4Rule:
        """The qwix rule of an nvfp4_jax `Rule` (same paths, same recipe).

        Example:
          >>> NVFP4Rule.from_rule(Rule("lm_head", None)).module_path
          '(?s:.*?)(?:lm_head)(?s:.*)'
        """
        if not isinstance(rule, Rule):
            raise TypeError(f"NVFP4Rule.from_rule: rule must be an nvfp4_jax Rule, got {rule!r}")
        return cls(
            module_path=search_pattern(rule.pattern), recipe=rule.recipe, rng_stream=rng_stream
        )


def _float(*arrays) -> bool:
    return all(jnp.issubdtype(jnp.result_type(a), jnp.floating) for a in arrays)


def _not_one_weight(both: bool) -> str:
    """Why an op of two weights (`both`) or of two activations stays in high precision."""
    which = "two weights" if both else "no weight operand (activations only)"
    return f"{which}: computed in high precision"


def _module_params(module) -> dict:
    """The arrays of a module's own parameters (nnx `Param`s, linen's `params`), by name."""
    if isinstance(module, nnx.Module):
        params = {
            name: node.get_raw_value()
            for name, node in vars(module).items()
            if isinstance(node, nnx.Param)
        }
    else:
        scope = module.scope
        params = {
            name: _unboxed(value)
            for name, value in (scope._collection("params") if scope is not None else {}).items()
        }
    return {name: value for name, value in params.items() if isinstance(value, jax.Array)}


def _unboxed(value):
    """A linen parameter's array as the module sees it, without a sharding constraint."""
    if isinstance(value, linen.Partitioned):
        return value.unbox(apply_constraint=False)
    return value.unbox() if isinstance(value, linen.meta.AxisMetadata) else value


def _is_param(x, param) -> bool:
    """Whether `x` is `param`, or follows from it by unary ops (a cast, a reshape, ...).

    Told by identity: in a jaxpr trace through the chain of one-operand equations; under a
    transformation (grad, vmap) through the values its tracers carry; outside a trace, `x`
    holds exactly `param`'s values after a cast to `x`'s dtype.
    """
    if _traces_back(x, param):
        return True
    x_traced, param_traced = isinstance(x, jax.core.Tracer), isinstance(param, jax.core.Tracer)
    if x_traced and param_traced and type(x) is type(param):
        for attr in _CARRIED:
            carried = getattr(x, attr, None), getattr(param, attr, None)
            if all(isinstance(value, jax.Array) for value in carried):
                return _is_param(*carried)
    if x_traced or param_traced or tuple(jnp.shape(x)) != tuple(param.shape):
        return False
    return bool(np.array_equal(np.asarray(x), np.asarray(jnp.asarray(param).astype(x.dtype))))


def _traces_back(x, param) -> bool:
    """Whether a chain of one-operand equations of the jaxpr being traced leads `param` to `x`."""
    while True:
        if x is param:
            return True
        if not isinstance(x, jax.core.Tracer):
            return False
        # A parameter closed over by a traced function enters the trace as a constant.
        get_const = getattr(x, "get_const", None)
        if get_const is not None and get_const() is param:
            return True
        in_tracers = getattr(getattr(x, "parent", None), "in_tracers", ())
        if len(in_tracers) != 1:
            return False
        x = in_tracers[0]


def _sizes_problem(k: int, n: int) -> str:
    if k % _BLOCK or n % _BLOCK:
        return f"its contracted size K={k} and weight free size N={n} must be multiples of 16"
    return ""


class NVFP4Provider(qwix.QtProvider):
    """A qwix provider that trains with the NVFP4 recipe where an `NVFP4Rule` matches.

    `qwix.quantize_model(model, NVFP4Provider(rules), *inputs)` (nnx) or
    `qwix.quantize_model(model, NVFP4Provider(rules))` (linen) is the one line. `rules` may
    mix `NVFP4Rule`s, nvfp4_jax `Rule`s (as `default_rules(num_layers)` gives them; each
    converted by `NVFP4Rule.from_rule` with `rng_stream`) and plain qwix rules, which keep
    qwix's behaviour; the first rule matching an op's module path decides.

    Attributes:
      report: a `QuantizeReport` of what each intercepted op did, keyed by
        `"<module path>:<op><n>"` (e.g. `"layers/0/mlp/up_proj:dot_general0"`), filled as
        the model is traced.

    Example:
      >>> import flax.nnx as nnx, qwix
      >>> model = nnx.Linear(32, 16, rngs=nnx.Rngs(0))
      >>> provider = NVFP4Provider([NVFP4Rule(recipe=NVFP4Recipe())])
      >>> qmodel = qwix.quantize_model(model, provider, jnp.ones((4, 32)))
      >>> provider.report[":dot_general0"].action
      'nvfp4'
    """

    def __init__(
        self,
        rules: Sequence[qwix.QuantizationRule | Rule],
        *,
        rng_stream: str | None = None,
        disable_jit: bool = False,
    ):
        if isinstance(rules, (Rule, qwix.QuantizationRule, str)):
            raise TypeError(f"NVFP4Provider: rules must be a sequence of rules, got {rules!r}")
        converted = []
        for index, rule in enumerate(rules):
            if isinstance(rule, Rule):
                rule = NVFP4Rule.from_rule(rule, rng_stream=rng_stream)
            if not isinstance(rule, qwix.QuantizationRule):
                raise TypeError(
                    f"NVFP4Provider: rules[{index}] must be an NVFP4Rule, an nvfp4_jax Rule or "
                    f"a qwix rule, got {rule!r}"
                )
            converted.append(rule)
        super().__init__(converted, disable_jit=disable_jit)
        self.report = QuantizeReport()

    # --- bookkeeping ---------------------------------------------------------------------------

    def _nvfp4_rule(self, op_name: str) -> NVFP4Rule | None:
        """The op's rule if it is an NVFP4 one (else qwix's own path decides)."""
        rule = self._get_current_rule_and_op_id(op_name, only_rule=True)[0]
        return rule if isinstance(rule, NVFP4Rule) else None

    def _enter(self, op_name: str) -> str:
        """Counts the op (as qwix does) and returns its report key."""
        _, op_id = self._get_current_rule_and_op_id(op_name)
        path = "/".join(map(str, flax_util.get_current_module_path()))
        return f"{path}:{op_id}"

    def _record(self, key: str, rule: NVFP4Rule, action: str, reason: str = "") -> None:
        module = flax_util.get_current_module()
        self.report.layers[key] = LayerDecision(
            path=key,
            layer=type(module).__name__,
            action=action,
            rule=self._rules.index(rule),
            pattern=rule.module_path,
            recipe=rule.recipe if action == "nvfp4" else None,
            reason=reason,
        )

    def _key(self, rule: NVFP4Rule) -> jax.Array | None:
        if rule.rng_stream is None or not rule.recipe.random_backward:
            return None
        return flax_util.make_rng(rule.rng_stream)

    @staticmethod
    def _weight_name(*operands) -> tuple[str, int] | None:
        """(module path/parameter name, operand index) of the operand that is a parameter.

        A parameter of the module issuing the op, told as `_weights` tells it; None if none.

        What a subclass observing the ops keys them by: `decoder/layers_0/mlp/wi_0/kernel`,
        or `decoder/layers_0/MoeBlock_0/wi_1` for an expert stack the block itself holds.
        """
        params = _module_params(flax_util.get_current_module())
        path = "/".join(map(str, flax_util.get_current_module_path()))
        for index, x in enumerate(operands):
            for name, param in params.items():
                if _is_param(x, param):
                    return f"{path}/{name}" if path else name, index
        return None

    def _weights(self, op: str, *operands) -> list[bool]:
        """Which operands are parameters of the module issuing the op, told by identity.

        qwix's own lookup (`flax_util.find_param`) falls back to matching shapes, which takes
        an activation of the weight's shape (a square layer on a square batch) for a weight.
        Here an operand is a weight only if it is one of the module's parameters, or
        follows from one by unary ops (a cast, a reshape, a sharding constraint) in the trace,
        or (outside a trace) holds exactly its values after a cast. An operand that is none of
        these but has the shape of a matrix parameter (one a GEMM could take as its weight; a
        norm's vector scale plus an offset is not) cannot be told apart: a `ValueError`, not a
        guess.
        """
        params = _module_params(flax_util.get_current_module())
        weights = [any(_is_param(x, p) for p in params.values()) for x in operands]
        if not any(weights):
            matrices = {n: p for n, p in params.items() if p.ndim >= 2}
            for x in operands:
                same = [n for n, p in matrices.items() if tuple(p.shape) == tuple(jnp.shape(x))]
                if same:
                    raise ValueError(
                        f"NVFP4Provider: {op} in module "
                        f"{'/'.join(map(str, flax_util.get_current_module_path()))!r}: an "
                        f"operand of shape {tuple(jnp.shape(x))} has the shape of parameter "
                        f"{same[0]!r} but is not that parameter nor a cast or reshape of it, "
                        "so it cannot be told from an activation; pass the parameter to the "
                        "op as it is (or through unary ops), or keep the module in high "
                        "precision with a rule whose recipe is None"
                    )
        return weights

    # --- the ops ---------------------------------------------------------------------------

    def dot_general(
        self,
        lhs,
        rhs,
        dimension_numbers,
        precision=None,
        preferred_element_type=None,
        *,
        out_sharding=None,
    ):
        """NVFP4 `dot_general` where an NVFP4 rule matches and one operand is a weight."""
        rule = self._nvfp4_rule("dot_general")
        if rule is None:
            return super().dot_general(
                lhs,
                rhs,
                dimension_numbers,
                precision,
                preferred_element_type,
                out_sharding=out_sharding,
            )
        key = self._enter("dot_general")

        def high_precision(action: str, reason: str = ""):
            self._record(key, rule, action, reason)
            return jax.lax.dot_general(
                lhs,
                rhs,
                dimension_numbers,
                precision=precision,
                preferred_element_type=preferred_element_type,
                out_sharding=out_sharding,
            )

        if rule.recipe is None:
            return high_precision("high_precision")
        lhs_weight, rhs_weight = self._weights("dot_general", lhs, rhs)
        if lhs_weight == rhs_weight:
            return high_precision("skipped", _not_one_weight(lhs_weight))
        (lc, rc), (lb, rb) = dimension_numbers
        x, w, dims = lhs, rhs, dimension_numbers
        if lhs_weight:  # the weight becomes the rhs; the result is transposed back
            x, w, dims = rhs, lhs, ((rc, lc), (rb, lb))
        (_, w_contract), (_, w_batch) = dims
        k = math.prod(w.shape[d] for d in w_contract)
        n = math.prod(s for d, s in enumerate(w.shape) if d not in (*w_contract, *w_batch))
        problem = "" if _float(x, w) else "its operands are not floats"
        problem = problem or _sizes_problem(k, n)
        if problem:
            return high_precision("skipped", problem)
        self._record(key, rule, "nvfp4")
        y = dot_general(
            x,
            w,
            dims,
            precision,
            preferred_element_type,
            recipe=rule.recipe,
            key=self._key(rule),
        )
        if lhs_weight:
            batch, w_free = len(lb), w.ndim - len(w_contract) - len(w_batch)
            x_free = y.ndim - batch - w_free
            perm = (
                *range(batch),
                *range(batch + x_free, y.ndim),
                *range(batch, batch + x_free),
            )
            y = jnp.transpose(y, perm)
        return constrain_output(y, out_sharding)

    def einsum(
        self,
        einsum_str,
        *operands,
        precision=None,
        preferred_element_type=None,
        _dot_general=jax.lax.dot_general,
        out_sharding=None,
    ):
        """NVFP4 einsum of an activation and a weight where an NVFP4 rule matches."""
        rule = self._nvfp4_rule("einsum")
        if rule is None:
            return super().einsum(
                einsum_str,
                *operands,
                precision=precision,
                preferred_element_type=preferred_element_type,
                _dot_general=_dot_general,
                out_sharding=out_sharding,
            )
        key = self._enter("einsum")

        def high_precision(action: str, reason: str = ""):
            self._record(key, rule, action, reason)
            return jnp.einsum(
                einsum_str,
                *operands,
                precision=precision,
                preferred_element_type=preferred_element_type,
                _dot_general=_dot_general,
                out_sharding=out_sharding,
            )

        if rule.recipe is None:
            return high_precision("high_precision")
        if len(operands) != 2 or not isinstance(einsum_str, str):
            return high_precision("skipped", "not an einsum of two operands")
        weights = self._weights("einsum", *operands)
        if weights[0] == weights[1]:
            return high_precision("skipped", _not_one_weight(weights[0]))
        spec, (x, w) = einsum_str.replace(" ", ""), operands
        if weights[0]:  # the weight becomes the kernel operand
            inputs, out = spec.split("->") if "->" in spec else (spec, None)
            first, _, second = inputs.partition(",")
            spec = f"{second},{first}" + ("" if out is None else f"->{out}")
            x, w = w, x
        if not _float(x, w):
            return high_precision("skipped", "its operands are not floats")
        try:
            plan = einsum_plan(spec, jnp.shape(w), jnp.ndim(x), allow_batch=True)
        except ValueError as error:
            return high_precision("skipped", f"{spec!r}: {error}")
        self._record(key, rule, "nvfp4")
        y = dot_general(
            x,
            w,
            plan.dimension_numbers,
            precision,
            preferred_element_type,
            recipe=rule.recipe,
            key=self._key(rule),
        )
        return constrain_output(jnp.transpose(y, plan.perm), out_sharding)

    def ragged_dot(
        self,
        lhs,
        rhs,
        group_sizes,
        precision=None,
        preferred_element_type=None,
        group_offset=None,
    ):
        """NVFP4 `ragged_dot` (the experts' grouped GEMM) where an NVFP4 rule matches."""
        rule = self._nvfp4_rule("ragged_dot")
        if rule is None:
            return super().ragged_dot(
                lhs, rhs, group_sizes, precision, preferred_element_type, group_offset
            )
        key = self._enter("ragged_dot")
        problem = ""
        if rule.recipe is not None and not _float(lhs, rhs):
            problem = "its operands are not floats"
        elif rule.recipe is not None and jnp.ndim(lhs) == 2 and jnp.ndim(rhs) == 3:
            problem = _sizes_problem(jnp.shape(lhs)[1], jnp.shape(rhs)[2])
        if rule.recipe is None or problem:
            self._record(key, rule, "skipped" if problem else "high_precision", problem)
            return jax.lax.ragged_dot(
                lhs,
                rhs,
                group_sizes,
                precision=precision,
                preferred_element_type=preferred_element_type,
                group_offset=group_offset,
            )
        self._record(key, rule, "nvfp4")
        return ragged_dot(
            lhs,
            rhs,
            group_sizes,
            precision,
            preferred_element_type,
            group_offset,
            recipe=rule.recipe,
            key=self._key(rule),
        )


__all__ = ["NVFP4Provider", "NVFP4Rule", "search_pattern"]
