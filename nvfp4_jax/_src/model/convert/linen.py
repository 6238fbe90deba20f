"""Rules applied to a linen model: `quantize_linen` intercepts its layers' calls.

`quantize_linen(rules)` (a context manager) or `quantized(fn, rules)` intercept every
`nn.Dense`, `nn.DenseGeneral` and `nn.Einsum` call whose path matches a rule and compute it
with `nvfp4_dot_general(recipe)`; the parameters are Flax's own. An
`nvfp4_jax.linen.Experts` layer (a (G, K, N) kernel) takes the rule's recipe (None: high
precision); a `Dense` with an `NVFP4Array` kernel (frozen) computes as it is, reported
"skipped".
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from nvfp4_jax._src.core import formats
from nvfp4_jax._src.core.array import NVFP4Array
from nvfp4_jax._src.flax import linen as nvfp4_linen
from nvfp4_jax._src.flax.einsum import NVFP4Einsum, einsum_plan
from nvfp4_jax._src.flax.layer_info import dot_general_recipe
from nvfp4_jax._src.flax.walk import path_str
from nvfp4_jax._src.model.convert.report import Action, QuantizeReport, record
from nvfp4_jax._src.model.convert.rules import DEFAULT_RNG_COLLECTION, Rule, check_rules, match_rule
from nvfp4_jax._src.training.dot_general import nvfp4_dot_general
from nvfp4_jax._src.training.recipe import NVFP4Recipe

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
    if recipe.random_backward and module.has_rng(stream):
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
        path = path_str(module.path)
        found = match_rule(self.rules, path)
        action, reason = _linen_decision(module, found, args, kwargs)
        record(self.report, path, type(module).__name__, action, found, reason)
        if action == "high_precision" and isinstance(module, nvfp4_linen.Experts):
            with _fields(module, recipe=None):
                return next_fun(*args, **kwargs)
        if action == "high_precision" and dot_general_recipe(getattr(module, "dot_general", None)):
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
