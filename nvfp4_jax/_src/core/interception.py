"""nvfp4_jax's ops trace the same way whatever another library intercepts (qwix).

qwix quantizes a model by patching `jax.lax.dot_general`, `jnp.einsum`, `jax.lax.ragged_dot`
(and, with its ODML providers, every primitive) while the model's call runs, in the calling
thread. An nvfp4_jax op traced inside that call would have its own inner computations
intercepted too: the high-precision GEMM of a recipe with `fprop=False` or the emulated
NVFP4 GEMM of dequantized operands quantized a second time, by rules meant for the model's
layers. Worse, JAX caches traces (`jax.jit`'s, a `custom_vjp`'s) by shapes and static
arguments, not by what is patched, so such a trace would be reused outside the interceptor,
and one made outside reused inside.

An nvfp4_jax op is already quantized: its entry points (`opaque`) and the differentiation
rules JAX calls later run with the calling thread's interceptors suspended, so every trace
of an op is the same inside and outside. Nothing here imports qwix: where it is not loaded,
there is nothing to suspend.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import TypeVar

# qwix's interception state (its private module: qwix is pinned below 0.2, see pyproject).
_QWIX_INTERCEPTION = "qwix._src.interception"

F = TypeVar("F", bound=Callable)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Suspends the interceptors qwix has active in this thread while the block runs."""
    manager = getattr(sys.modules.get(_QWIX_INTERCEPTION), "interception_manager", None)
    if manager is None:
        yield
        return
    active = manager.disable_interception()
    try:
        yield
    finally:
        if active:
            manager.enable_interception(active)


def opaque(fn: F) -> F:
    """`fn` run with other libraries' interceptors suspended (`suspended`)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with suspended():
            return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
