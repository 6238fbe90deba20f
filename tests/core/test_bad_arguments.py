"""Property-based test (Hypothesis) of the ops' argument checks: drawn invalid arguments raise a
ValueError or TypeError naming the argument at fault, with the same type and message on
every implementation (the pure-jnp reference, the CPU kernels, the CUDA kernels where a GPU
is present). Profiles and example counts: `tests/strategies.py`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import given, note
from hypothesis import strategies as st
from strategies import F32, budget

import nvfp4_jax
from nvfp4_jax._src.core.array import NVFP4Array


@dataclasses.dataclass
class BadCall:
    """A call with one invalid argument and the words its error message must contain."""

    label: str
    call: object  # implementation -> result
    words: tuple[str, ...]
    implementations: tuple = ("reference", "ffi", None)


def _x(shape=(16, 32), dtype=F32):
    return jnp.ones(shape, dtype)


QUANTIZING_OPS = {"quantize": nvfp4_jax.quantize, "fake_quantize": nvfp4_jax.fake_quantize}
AXIS_OPS = {**QUANTIZING_OPS, "tensor_amax": nvfp4_jax.tensor_amax}
GOOD_SHAPES = ((32,), (16, 32), (2, 16, 32))


@functools.cache
def _valid_q() -> NVFP4Array:
    return jax.jit(lambda x: nvfp4_jax.quantize(x, implementation="reference"))(_x())


def _maybe_jit(jit: bool, fn, *traced):
    """Calls fn(*traced), under jax.jit (the arguments traced) or eagerly."""
    return jax.jit(fn)(*traced) if jit else fn(*traced)


@st.composite
def bad_axis(draw):
    shape = draw(st.sampled_from(GOOD_SHAPES))
    nd = len(shape)
    op_name = draw(st.sampled_from(sorted(AXIS_OPS)))
    axis = draw(
        st.one_of(
            st.integers(nd, nd + 100),
            st.integers(-nd - 100, -nd - 1),
            st.sampled_from([True, False, np.bool_(True), 1.0, F32(0), "0", None, (0,), [0], 0.5]),
            st.integers(nd, nd + 3).map(np.int64),
        )
    )
    jit = draw(st.booleans())

    def call(impl):
        return _maybe_jit(
            jit, lambda x: AXIS_OPS[op_name](x, axis=axis, implementation=impl), _x(shape)
        )

    return BadCall(f"{op_name}(shape={shape}, axis={axis!r}, jit={jit})", call, ("axis",))


@st.composite
def bad_block_shape(draw):
    """The quantized axis not a multiple of 16, or 16x16 blocks on rows that do not fit."""
    op_name = draw(st.sampled_from(sorted(QUANTIZING_OPS)))
    two_d = draw(st.booleans())
    n = draw(st.integers(1, 70).filter(lambda v: v % 16))
    if two_d:
        shape, axis = draw(
            st.sampled_from([((n, 32), -1), ((32, n), 0), ((2, n, 32), 2), ((32,), 0)])
        )
        words = ("block_2d", str(shape))
    else:
        shape, axis = draw(
            st.sampled_from([((16, n), -1), ((n, 16), 0), ((n,), 0), ((2, n, 16), 1)])
        )
        words = ("axis", str(shape))
    jit = draw(st.booleans())

    def call(impl):
        fn = QUANTIZING_OPS[op_name]
        return _maybe_jit(
            jit, lambda x: fn(x, axis=axis, block_2d=two_d, implementation=impl), _x(shape)
        )

    return BadCall(f"{op_name}(shape={shape}, axis={axis}, block_2d={two_d})", call, words)


BAD_ARRAY_DTYPES = (
    np.int32,
    np.int8,
    np.uint8,
    np.float64,
    np.bool_,
    np.complex64,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
)
ALL_X_OPS = {**AXIS_OPS, "apply_rht": nvfp4_jax.apply_rht}


@st.composite
def bad_x(draw):
    op_name = draw(st.sampled_from(sorted(ALL_X_OPS)))
    dtype = draw(st.sampled_from(BAD_ARRAY_DTYPES))
    kind = draw(st.sampled_from(["numpy", "jax", "list", "other"]))
    if kind == "other":
        x = draw(st.sampled_from([None, "x", b"x"]))
        words = ("x must be an array",)
    elif kind == "list":  # nested Python ints: an int32 array
        x = [[1] * 32] * 16
        words = ("int32",)
    elif kind == "jax" and dtype is not np.float64:  # jnp would make f64 an f32 (no x64)
        x = jnp.ones((16, 32), dtype)
        words = (np.dtype(dtype).name,)
    else:
        x = np.ones((16, 32), dtype)
        words = (np.dtype(dtype).name,)

    def call(impl):
        return ALL_X_OPS[op_name](x, implementation=impl)

    return BadCall(f"{op_name}(x of {getattr(x, 'dtype', type(x))})", call, words)


BAD_OUT_DTYPES = (
    np.int32,
    np.float64,
    ml_dtypes.float8_e4m3fn,
    np.bool_,
    "float64",
    "int8",
    "not_a_dtype",
    object,
    3,
)


@st.composite
def bad_out_dtype(draw):
    dtype = draw(st.sampled_from(BAD_OUT_DTYPES + (None,)))
    op_name = (
        "dequantize" if dtype is None else draw(st.sampled_from(["dequantize", "fake_quantize"]))
    )
    x = _x()
    if op_name == "dequantize":

        def call(impl):
            return nvfp4_jax.dequantize(_valid_q(), dtype, implementation=impl)

    else:

        def call(impl):
            return nvfp4_jax.fake_quantize(x, dtype=dtype, implementation=impl)

    return BadCall(f"{op_name}(dtype={dtype!r})", call, ("dtype",))


@st.composite
def bad_amax(draw):
    """A non-scalar amax (eager or traced), a wrong type, or a concrete invalid value."""
    op_name = draw(st.sampled_from(sorted(QUANTIZING_OPS)))
    fn = QUANTIZING_OPS[op_name]
    kind = draw(st.sampled_from(["shape", "type", "value"]))
    jit = kind == "shape" and draw(st.booleans())
    if kind == "shape":
        shape = draw(st.sampled_from([(1,), (2,), (1, 1), (16, 32), (0,)]))
        amax = draw(st.sampled_from([np.ones, jnp.ones]))(shape, F32)
    elif kind == "type":
        amax = draw(st.sampled_from(["1.0", True, np.bool_(False), 1 + 1j, b"1", [1.0], (0.5,)]))
    else:
        value = draw(st.sampled_from([np.nan, np.inf, -np.inf, -1.0, -1e-30, -3e38]))
        amax = draw(st.sampled_from([float, F32, jnp.float32]))(value)

    def call(impl):
        return _maybe_jit(jit, lambda x, a: fn(x, amax=a, implementation=impl), _x(), amax)

    return BadCall(f"{op_name}(amax={amax!r}, jit={jit})", call, ("amax",))


BAD_KEYS = (
    "k",
    1.5,
    7,
    np.ones(3, np.uint32),
    np.ones(2, np.float32),
    np.ones((2, 2), np.uint32),
    {"key": 0},
)


@st.composite
def bad_key(draw):
    op_name = draw(st.sampled_from(sorted(QUANTIZING_OPS)))
    fn = QUANTIZING_OPS[op_name]
    key = draw(
        st.one_of(
            st.just(None),
            st.sampled_from(BAD_KEYS),
            st.integers(2, 4).map(lambda n: jax.random.split(jax.random.key(0), n)),
        )
    )
    jit = draw(st.booleans()) and key is not None and hasattr(key, "shape")

    def call(impl):
        quantize = lambda x, k: fn(x, stochastic_rounding=True, key=k, implementation=impl)  # noqa: E731
        if jit:
            return jax.jit(quantize)(_x(), key)
        return quantize(_x(), key)

    return BadCall(f"{op_name}(stochastic_rounding=True, key={key!r}, jit={jit})", call, ("key",))


@st.composite
def bad_flag(draw):
    op_name, flag = draw(
        st.sampled_from(
            [
                ("quantize", "block_2d"),
                ("quantize", "rht"),
                ("quantize", "stochastic_rounding"),
                ("fake_quantize", "global_scale"),
                ("fake_quantize", "rht"),
                ("tensor_amax", "rht"),
                ("apply_rht", "inverse"),
            ]
        )
    )
    value = draw(st.sampled_from([1, 0, "yes", None, np.int32(1), 1.0, jnp.bool_(True)]))
    fn = ALL_X_OPS[op_name]

    def call(impl):
        return fn(_x(), **{flag: value}, implementation=impl)

    return BadCall(f"{op_name}({flag}={value!r})", call, (flag,))


@st.composite
def bad_q(draw):
    q = draw(
        st.sampled_from(
            [np.ones((16, 8), np.uint8), jnp.ones(4), None, {"codes": 0}, (1, 2, 3), "q"]
        )
    )
    return BadCall(
        f"dequantize({type(q).__name__})",
        lambda impl: nvfp4_jax.dequantize(q, implementation=impl),
        ("NVFP4Array",),
    )


@st.composite
def bad_implementation(draw):
    value = draw(
        st.one_of(
            st.sampled_from(["cuda", "REFERENCE", "", "jax", "native", 1, True, ("ffi",)]),
            st.text(max_size=8).filter(lambda s: s not in ("reference", "ffi")),
        )
    )
    op_name = draw(st.sampled_from(sorted(ALL_X_OPS) + ["dequantize"]))
    if op_name == "dequantize":

        def call(_):
            return nvfp4_jax.dequantize(_valid_q(), implementation=value)

    else:

        def call(_):
            return ALL_X_OPS[op_name](_x(), implementation=value)

    return BadCall(f"{op_name}(implementation={value!r})", call, ("implementation",), (value,))


@st.composite
def bad_rht_shape(draw):
    """apply_rht needs a last axis of 16s, and every op at least one dimension."""
    shape = draw(
        st.one_of(
            st.just(()),
            st.tuples(st.integers(1, 70).filter(lambda v: v % 16)),
            st.tuples(st.integers(1, 4), st.integers(1, 70).filter(lambda v: v % 16)),
        )
    )
    op_name = "apply_rht" if shape else draw(st.sampled_from(sorted(ALL_X_OPS)))

    def call(impl):
        return ALL_X_OPS[op_name](jnp.ones(shape, F32), implementation=impl)

    return BadCall(f"{op_name}(shape={shape})", call, (str(shape),))


BAD_CALLS = st.one_of(
    bad_axis(),
    bad_block_shape(),
    bad_x(),
    bad_out_dtype(),
    bad_amax(),
    bad_key(),
    bad_flag(),
    bad_q(),
    bad_implementation(),
    bad_rht_shape(),
)


def _outcome(bad: BadCall, implementation) -> tuple[str, str]:
    try:
        result = bad.call(implementation)
        jax.block_until_ready(result)
    except (ValueError, TypeError) as error:
        return type(error).__name__, str(error)
    except Exception as error:  # anything else is the failure to report
        raise AssertionError(
            f"{bad.label} on {implementation!r} raised {type(error).__name__}, not a ValueError "
            f"or TypeError: {error}"
        ) from error
    raise AssertionError(f"{bad.label} on {implementation!r} was accepted")


@budget("bad_arguments")
@given(bad=BAD_CALLS)
def test_bad_arguments_are_rejected_alike(impls, bad):
    note(bad.label)
    outcomes = {impl: _outcome(bad, impl) for impl in bad.implementations}
    for impl, (kind, message) in outcomes.items():
        assert all(word in message for word in bad.words), (
            f"{bad.label} on {impl!r}: {kind} {message!r} does not name {bad.words}"
        )
    assert len(set(outcomes.values())) == 1, f"{bad.label}: {outcomes}"
