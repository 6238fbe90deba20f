"""The native NVFP4 kernels: loading, target registration and `jax.ffi.ffi_call` wrappers.

The C++ (`nvfp4_jax._nvfp4_cpu`) and CUDA (`nvfp4_jax._nvfp4_cuda`) handlers are built by
CMake from `ffi/` as tiny extension modules whose `registrations()` return PyCapsules. Each
target is registered under one name for both platforms ("cpu" and "CUDA"), so XLA picks the
handler for wherever the computation runs. Loading is lazy (first `is_available` or call)
and never raises: a missing or broken module leaves `is_available` False and its import
error is kept for `unavailable_reason`.

All wrappers take the *stored layout*: the quantized axis last, shape (..., C) with C a
multiple of 16; rows are the flattened leading dims (R = prod(shape[:-1])).

`vmap_method`: quantization is per tensor (one amax, and SR counters that start at element
0), so the batch of a vmapped quantize/dequantize is a batch of independent tensors: those
targets use "sequential", which calls the kernel once per example exactly as the reference
computes it under vmap. The RHT acts on each 16-group alone, so a batch is just more
leading dims: "broadcast_all" runs it in one call.

Sharding: the public wrappers below route every call through `nvfp4_jax.distributed`, whose
`custom_partitioning` rules run the kernels on each device's shard (the tensor amax is a
`lax.pmax` of local amaxes) instead of letting XLA all-gather the operands of an opaque
custom call. On one device they lower to the plain custom call. The `_call_*` functions are
the bare `ffi_call`s.
"""

from __future__ import annotations

import importlib
import threading

import jax
import jax.numpy as jnp

TARGETS = (
    "nvfp4_amax",
    "nvfp4_quantize",
    "nvfp4_fake_quantize",
    "nvfp4_dequantize",
    "nvfp4_rht",
)
# Platform name of nvfp4_jax (as dispatch.current_platform says it) -> (module, XLA name).
_MODULES = {"cpu": ("nvfp4_jax._nvfp4_cpu", "cpu"), "cuda": ("nvfp4_jax._nvfp4_cuda", "CUDA")}
_BLOCK = 16
_FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

_lock = threading.Lock()
# platform -> None when loaded and registered, else the reason it is not.
_status: dict[str, str | None] = {}


def _gpu_backend_present() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def _load(platform: str) -> str | None:
    """Imports and registers the native module for `platform`; returns why not, or None."""
    if platform not in _MODULES:
        return f"nvfp4_jax has no native kernels for platform {platform!r}"
    module_name, xla_platform = _MODULES[platform]
    try:
        module = importlib.import_module(module_name)
        capsules = module.registrations()
    except Exception as e:  # noqa: BLE001  (any import failure must leave the package usable)
        return f"importing {module_name} failed: {type(e).__name__}: {e}"
    if platform == "cuda" and not _gpu_backend_present():
        return "the CUDA kernels are built, but this JAX has no CUDA GPU backend"
    missing = sorted(set(TARGETS) - set(capsules))
    if missing:
        return f"{module_name} lacks the targets {missing}; rebuild nvfp4_jax"
    for name in TARGETS:
        jax.ffi.register_ffi_target(name, capsules[name], platform=xla_platform)
    return None


def _ensure(platform: str) -> str | None:
    with _lock:
        if platform not in _status:
            _status[platform] = _load(platform)
        return _status[platform]


def is_available(platform: str) -> bool:
    """Returns True when the native library for `platform` ("cpu" or "cuda") is registered."""
    return _ensure(platform) is None


def unavailable_reason(platform: str) -> str:
    """Says why the native library for `platform` cannot be used ("" when it can)."""
    return _ensure(platform) or ""


def _require_platform() -> None:
    """Raises a RuntimeError saying why when the current platform has no native library."""
    from nvfp4_jax import dispatch  # noqa: PLC0415  (dispatch imports this module lazily)

    for platform in _MODULES:
        _ensure(platform)  # register every platform we can, not just the default one
    platform = dispatch.current_platform()
    reason = unavailable_reason(platform)
    if reason:
        raise RuntimeError(f"nvfp4_jax native kernels are not available on {platform}: {reason}")


def _check_layout(op: str, x: jax.Array, block_2d: bool = False) -> None:
    if jnp.dtype(x.dtype) not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: x must be bfloat16, float16 or float32, got {x.dtype} {x.shape}")
    if x.ndim == 0 or x.shape[-1] % _BLOCK:
        raise ValueError(f"{op}: the last axis of x {x.shape} must be a multiple of {_BLOCK}")
    if block_2d and (x.ndim < 2 or x.shape[-2] % _BLOCK):
        raise ValueError(f"{op}: 16x16 blocks need x.shape[-2] % {_BLOCK} == 0, got {x.shape}")


def _f32_scalar(a) -> jax.Array:
    return jnp.asarray(a, jnp.float32).reshape(())


def _key_words(words) -> jax.Array:
    """uint32[4] (k0, k1, SR counter offset lo, hi) from 2 key words (offset 0) or 4 words."""
    words = jnp.asarray(words, jnp.uint32).reshape(-1)
    if words.shape == (2,):
        return jnp.concatenate([words, jnp.zeros((2,), jnp.uint32)])
    if words.shape != (4,):
        raise ValueError(f"key words must be uint32[2] or uint32[4], got shape {words.shape}")
    return words


def _distributed():
    from nvfp4_jax import distributed  # noqa: PLC0415  (distributed imports this module)

    return distributed


def _call_amax(x, *, rht):
    call = jax.ffi.ffi_call(
        "nvfp4_amax", jax.ShapeDtypeStruct((), jnp.float32), vmap_method="sequential"
    )
    return call(x, rht=bool(rht))


def _call_quantize(x, amax, words, *, block_2d, rht, stochastic_rounding):
    lead, cols = x.shape[:-1], x.shape[-1]
    out = (
        jax.ShapeDtypeStruct((*lead, cols // 2), jnp.uint8),
        jax.ShapeDtypeStruct((*lead, cols // _BLOCK), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((), jnp.float32),
    )
    call = jax.ffi.ffi_call("nvfp4_quantize", out, vmap_method="sequential")
    return tuple(
        call(
            x,
            amax,
            words,
            block_2d=bool(block_2d),
            rht=bool(rht),
            stochastic_rounding=bool(stochastic_rounding),
        )
    )


def _call_fake_quantize(x, amax, words, *, block_2d, rht, stochastic_rounding, global_scale, dtype):
    call = jax.ffi.ffi_call(
        "nvfp4_fake_quantize", jax.ShapeDtypeStruct(x.shape, dtype), vmap_method="sequential"
    )
    return call(
        x,
        amax,
        words,
        block_2d=bool(block_2d),
        rht=bool(rht),
        stochastic_rounding=bool(stochastic_rounding),
        global_scale=bool(global_scale),
    )


def _call_dequantize(codes, scales, amax, *, rht, dtype):
    shape = (*codes.shape[:-1], 2 * codes.shape[-1]) if codes.ndim else ()
    call = jax.ffi.ffi_call(
        "nvfp4_dequantize", jax.ShapeDtypeStruct(shape, dtype), vmap_method="sequential"
    )
    return call(codes, scales, amax, rht=bool(rht))


def _call_rht(x, *, inverse):
    call = jax.ffi.ffi_call(
        "nvfp4_rht", jax.ShapeDtypeStruct(x.shape, x.dtype), vmap_method="broadcast_all"
    )
    return call(x, inverse=bool(inverse))


def amax_ffi(x: jax.Array, *, rht: bool) -> jax.Array:
    """Returns max |x| as an f32 scalar; NaN if any element of x is not finite.

    With `rht`, the max over the RHT of x rounded to x.dtype (what quantize with rht uses).
    """
    _require_platform()
    _check_layout("amax_ffi", x)
    return _distributed().amax_kernel(x, rht=bool(rht))


def quantize_ffi(
    x: jax.Array, amax, key_words, *, block_2d: bool, rht: bool, stochastic_rounding: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Quantizes the stored layout x (..., C) with tensor amax `amax` (f32 scalar A).

    `key_words`: uint32[2] (k0, k1), or uint32[4] (k0, k1, SR counter offset lo, hi): the
    SR counter of element n is `offset + n // 8` (a shard of a larger tensor).

    Returns:
      codes uint8 (..., C/2), scales float8_e4m3fn (..., C/16) and the stored amax: A, or
      NaN when A or any (post-RHT) element of x is not finite.
    """
    _require_platform()
    _check_layout("quantize_ffi", x, block_2d)
    return _distributed().quantize_kernel(
        x,
        _f32_scalar(amax),
        _key_words(key_words),
        block_2d=bool(block_2d),
        rht=bool(rht),
        stochastic_rounding=bool(stochastic_rounding),
    )


def fake_quantize_ffi(
    x: jax.Array,
    amax,
    key_words,
    *,
    block_2d: bool,
    rht: bool,
    stochastic_rounding: bool,
    global_scale: bool,
    dtype,
) -> jax.Array:
    """Quantizes x like `quantize_ffi` and returns the dequantized values in `dtype`.

    No inverse RHT. value = code * (f32(s_b) * A * RCP2688) with `global_scale`, else
    code * f32(s_b). A non-finite input (or A) gives NaN everywhere with `global_scale`.
    """
    _require_platform()
    _check_layout("fake_quantize_ffi", x, block_2d)
    dtype = jnp.dtype(dtype)
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"fake_quantize_ffi: dtype must be bf16, f16 or f32, got {dtype}")
    return _distributed().fake_quantize_kernel(
        x,
        _f32_scalar(amax),
        _key_words(key_words),
        block_2d=bool(block_2d),
        rht=bool(rht),
        stochastic_rounding=bool(stochastic_rounding),
        global_scale=bool(global_scale),
        dtype=dtype,
    )


def dequantize_ffi(codes: jax.Array, scales: jax.Array, amax, *, rht: bool, dtype) -> jax.Array:
    """Decodes codes uint8 (..., C/2) and scales (..., C/16) to (..., C) in `dtype`.

    x_hat = code * (f32(s_b) * (A * RCP2688)) in f32, the inverse RHT when `rht`, the cast.
    """
    _require_platform()
    dtype = jnp.dtype(dtype)
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dequantize_ffi: dtype must be bf16, f16 or f32, got {dtype}")
    if codes.dtype != jnp.uint8 or scales.dtype != jnp.float8_e4m3fn:
        raise TypeError(
            f"dequantize_ffi: expected uint8 codes and float8_e4m3fn scales, got "
            f"{codes.dtype} {codes.shape} and {scales.dtype} {scales.shape}"
        )
    if codes.ndim == 0:
        return _call_dequantize(codes, scales, _f32_scalar(amax), rht=bool(rht), dtype=dtype)
    return _distributed().dequantize_kernel(
        codes, scales, _f32_scalar(amax), rht=bool(rht), dtype=dtype
    )


def rht_ffi(x: jax.Array, *, inverse: bool) -> jax.Array:
    """The RHT (or its inverse) of each 16-group along the last axis, rounded to x.dtype."""
    _require_platform()
    _check_layout("rht_ffi", x)
    return _distributed().rht_kernel(x, inverse=bool(inverse))
