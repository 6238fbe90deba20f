"""The einsum drop-in: an einsum of an input and one weight, computed in NVFP4.

`einsum_plan(spec, rhs_shape)` says how an einsum `input,kernel->output` runs as the NVFP4
`dot_general` (a dense contraction, then a transpose), or why it cannot; `NVFP4Einsum(recipe)`
is a `jnp.einsum` drop-in (`nnx.Einsum(..., einsum_op=NVFP4Einsum(recipe))`) computing it.
"""

from __future__ import annotations

import dataclasses
import math
import string
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from nvfp4_jax._src.core import formats
from nvfp4_jax._src.training.dot_general import constrain_output, dot_general
from nvfp4_jax._src.training.recipe import NVFP4Recipe


@dataclasses.dataclass(frozen=True)
class EinsumPlan:
    """An einsum `lhs,rhs->out` as a dense `dot_general` followed by a transpose.

    Attributes:
      lhs_contract: the input's contracted axes.
      rhs_contract: the kernel's contracted axes, in the same order.
      perm: the transpose from `dot_general`'s (batch, input free, kernel free) order to the
        output.
      k: the contracted size.
      n: the kernel's free size (batch axes not counted).
      lhs_batch: the input's batch axes (only with `einsum_plan(..., allow_batch=True)`).
      rhs_batch: the kernel's batch axes, in the same order.
    """

    lhs_contract: tuple[int, ...]
    rhs_contract: tuple[int, ...]
    perm: tuple[int, ...]
    k: int
    n: int
    lhs_batch: tuple[int, ...] = ()
    rhs_batch: tuple[int, ...] = ()

    @property
    def dimension_numbers(self):
        """The `dot_general` dimension numbers of the plan."""
        return (self.lhs_contract, self.rhs_contract), (self.lhs_batch, self.rhs_batch)


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


def _check_subscripts(lhs: str, rhs: str, out: str, allow_batch: bool) -> list[str]:
    """The contracted letters of a plain dense einsum; ValueError naming what is not."""
    for name, subs in (("input", lhs), ("kernel", rhs), ("output", out)):
        if not subs.isalpha() and subs:
            raise ValueError(f"the {name} subscripts {subs!r} must be letters")
        if len(set(subs)) != len(subs):
            raise ValueError(f"the {name} subscripts {subs!r} repeat a letter (a diagonal)")
    if set(out) - set(lhs) - set(rhs):
        raise ValueError(f"the output subscripts {out!r} name letters of neither operand")
    batch = set(lhs) & set(rhs) & set(out)
    if batch and not allow_batch:
        raise ValueError(f"batch dimension(s) {''.join(sorted(batch))!r} (in input and kernel)")
    summed = (set(lhs) ^ set(rhs)) - set(out)
    if summed:
        raise ValueError(f"dimension(s) {''.join(sorted(summed))!r} of one operand are summed")
    contracted = [c for c in lhs if c in rhs and c not in batch]
    if not contracted:
        raise ValueError("no dimension is contracted (an outer product)")
    return contracted


def einsum_plan(
    spec: str,
    rhs_shape: Sequence[int],
    lhs_ndim: int | None = None,
    *,
    allow_batch: bool = False,
) -> EinsumPlan:
    """How an einsum of an input and one weight runs as the NVFP4 `dot_general`.

    Args:
      spec: the einsum string, `input,kernel->output` (an `...` in input and output allowed).
      rhs_shape: the kernel's shape.
      lhs_ndim: the input's rank (None: one dimension for an ellipsis, for a static check).
      allow_batch: accept batch dimensions (letters of input, kernel and output, such as the
        experts of `"eck,ekn->ecn"`): each batch element is its own GEMM (`dot_general`).

    Raises:
      ValueError: saying why the einsum is not a plain dense contraction (batch dimensions,
        sums, diagonals, a kernel rank that does not match), or why its contracted size K or
        kernel free size N is not a multiple of 16.
    """
    lhs, rhs, out = _expand_ellipsis(spec.replace(" ", ""), lhs_ndim)
    if len(rhs) != len(rhs_shape):
        raise ValueError(f"the kernel subscripts {rhs!r} do not match its shape {rhs_shape}")
    contracted = _check_subscripts(lhs, rhs, out, allow_batch)
    batch = [c for c in lhs if c in rhs and c in out]
    k = math.prod(rhs_shape[rhs.index(c)] for c in contracted)
    n = math.prod(
        size for c, size in zip(rhs, rhs_shape, strict=True) if c not in contracted + batch
    )
    if k % formats.BLOCK_SIZE or n % formats.BLOCK_SIZE:
        raise ValueError(
            f"the contracted size K={k} and the kernel's free size N={n} must be multiples "
            f"of {formats.BLOCK_SIZE}"
        )
    paired = contracted + batch
    result = batch + [c for c in lhs if c not in paired] + [c for c in rhs if c not in paired]
    return EinsumPlan(
        lhs_contract=tuple(lhs.index(c) for c in contracted),
        rhs_contract=tuple(rhs.index(c) for c in contracted),
        perm=tuple(result.index(c) for c in out),
        k=k,
        n=n,
        lhs_batch=tuple(lhs.index(c) for c in batch),
        rhs_batch=tuple(rhs.index(c) for c in batch),
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
