"""What only the native kernels have: every CPU instruction-set build, the full flag matrix,
the custom call in the compiled HLO, raw custom-call errors, and library loading.

Numbers are checked against the NumPy oracle (tests/numerics_oracle.py) bit for bit; the
oracle suite itself (core/test_quantize.py, core/test_stochastic.py,
core/test_hadamard.py) runs on every
implementation through the `impl` fixture.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numerics_oracle as oracle
import numpy as np
import pytest
from helpers import (
    assert_same_bits,
    assert_same_q,
    heavy_tailed,
    make_impl,
    np_dtype,
    with_underflow_block,
)

import nvfp4_jax
from nvfp4_jax._src.core.kernels import _library

KEY = jax.random.key(7)


def case_id(dtype, block_2d, rht, sr, shape):
    dims = "_".join(f"{c}{n}" for c, n in zip("bmk"[-len(shape) :], shape, strict=True))
    flags = f"{'2d' if block_2d else '1d'}_{'rht' if rht else 'plain'}_{'sr' if sr else 'rn'}"
    return f"{dtype}_{flags}_{dims}"


def matrix():
    """Every dtype x blocks x RHT x rounding combination, the shapes taking turns."""
    combos = itertools.product(("bf16", "f16", "f32"), (False, True), (False, True), (False, True))
    for i, (dtype, block_2d, rht, sr) in enumerate(combos):
        shape = [(16, 16), (48, 64) if block_2d else (33, 64), (3, 32, 48)][i % 3]
        yield pytest.param(
            dtype, block_2d, rht, sr, shape, id=case_id(dtype, block_2d, rht, sr, shape)
        )


def expected(x, *, block_2d, rht, sr, key=KEY):
    sr_bytes = oracle.sr_random_bytes(*oracle.sr_key_words(key), x.size) if sr else None
    return oracle.quantize(x, block_2d=block_2d, rht=rht, sr_bytes=sr_bytes)


def check_against_oracle(native, x, *, block_2d, rht, sr, what=""):
    flags = dict(block_2d=block_2d, rht=rht, stochastic_rounding=sr)
    o = expected(x, block_2d=block_2d, rht=rht, sr=sr)
    assert_same_q(native.quantize(x, key=KEY, **flags), o, what)
    fake = native.fake_quantize(x, key=KEY, dtype=jnp.float32, **flags)
    assert_same_bits(fake, o.dequant_stored.reshape(fake.shape), f"{what} fake_quantize")


@pytest.mark.slow
@pytest.mark.parametrize("dtype,block_2d,rht,sr,shape", list(matrix()))
def test_quantize_and_fake_quantize_bits(native, dtype, block_2d, rht, sr, shape):
    x = heavy_tailed(shape, dtype, seed=sum(shape))
    if shape[-1] >= 32:
        x = with_underflow_block(x, row=1, block=1)
    check_against_oracle(native, x, block_2d=block_2d, rht=rht, sr=sr)


@pytest.mark.parametrize("out", ["bf16", "f16"])
@pytest.mark.parametrize("global_scale", [True, False], ids=["global", "no_global"])
def test_fake_quantize_output_dtypes(native, out, global_scale):
    x = heavy_tailed((32, 64), "f32", seed=6)
    o = oracle.quantize(x, rht=True)
    values = (
        o.dequant_stored
        if global_scale
        else oracle.e2m1_value(o.codes) * (np.repeat(o.scales.astype(np.float32), 16, axis=-1))
    )
    got = native.fake_quantize(x, dtype=np_dtype(out), rht=True, global_scale=global_scale)
    assert_same_bits(got, values.astype(np.float32).astype(np_dtype(out)), f"-> {out}")


# Tensors the CPU kernels split between threads (more than a few parallel chunks of about
# 2^17 elements), with row counts that split them mid-group and the last 16-block group of a
# range partial: the small shapes above run in one chunk. Against the reference (checked
# against the oracle elsewhere), every op and output dtype.
SPLIT_SHAPES = [(16 * 37, 16 * 45), (3, 16 * 13, 16 * 29), (16 * 5, 16 * 1201)]


def split_cases():
    for i, (block_2d, rht, sr) in enumerate(itertools.product((False, True), repeat=3)):
        shape = SPLIT_SHAPES[i % len(SPLIT_SHAPES)]
        dtype = ("bf16", "f32", "f16")[i % 3]
        axis = -1 if i % 2 == 0 else -2
        flags = f"{'2d' if block_2d else '1d'}_{'rht' if rht else 'plain'}_{'sr' if sr else 'rn'}"
        yield pytest.param(
            shape, dtype, axis, block_2d, rht, sr, id=f"{dtype}_{flags}_axis{axis}_{len(shape)}d"
        )


@pytest.mark.slow
@pytest.mark.parametrize("shape,dtype,axis,block_2d,rht,sr", list(split_cases()))
def test_tensors_split_between_threads_equal_the_reference(
    native, shape, dtype, axis, block_2d, rht, sr
):
    ref = make_impl("reference")
    x = with_underflow_block(heavy_tailed(shape, dtype, seed=sum(shape)), row=2, block=1)
    flags = dict(axis=axis, block_2d=block_2d, rht=rht, stochastic_rounding=sr)
    want = ref.quantize(x, key=KEY, **flags)
    assert_same_q(native.quantize(x, key=KEY, **flags), want, "quantize")
    for out in ("bf16", "f32"):
        assert_same_bits(
            native.fake_quantize(x, key=KEY, dtype=np_dtype(out), **flags),
            ref.fake_quantize(x, key=KEY, dtype=np_dtype(out), **flags),
            f"fake_quantize -> {out}",
        )
        if not rht:  # the inverse RHT's rounding order is not part of the contract
            assert_same_bits(
                native.dequantize(want, np_dtype(out)),
                ref.dequantize(want, np_dtype(out)),
                f"dequantize -> {out}",
            )
    assert_same_bits(
        native.tensor_amax(x, axis=axis, rht=rht), ref.tensor_amax(x, axis=axis, rht=rht), "amax"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype,block_2d,rht,sr",
    [("bf16", False, True, True), ("f16", True, True, False), ("f32", False, False, True)],
    ids=["bf16_1d_rht_sr", "f16_2d_rht_rn", "f32_1d_plain_sr"],
)
def test_every_cpu_variant_bits(cpu_isa, dtype, block_2d, rht, sr):
    cpu = make_impl("cpu")
    x = heavy_tailed((48, 64), dtype, seed=12)
    check_against_oracle(cpu, x, block_2d=block_2d, rht=rht, sr=sr, what=cpu_isa)
    q = nvfp4_jax.reference.quantize(x, rht=rht)
    want = oracle.dequantize(oracle.quantize(x, rht=rht), rht=rht)
    got = cpu.dequantize(q)
    if rht:  # the inverse RHT's rounding order is not part of the contract
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    else:
        assert_same_bits(got, want, f"{cpu_isa} dequantize")
    assert_same_bits(cpu.apply_rht(x), oracle.fwht_rht(x), f"{cpu_isa} rht")


def test_custom_call_in_compiled_hlo(native):
    x = jax.device_put(jnp.asarray(heavy_tailed((32, 64), "bf16")), native.device)
    ops = {
        "nvfp4_amax": lambda x: nvfp4_jax.tensor_amax(x, implementation="ffi"),
        "nvfp4_quantize": lambda x: nvfp4_jax.quantize(x, implementation="ffi").codes,
        "nvfp4_fake_quantize": lambda x: nvfp4_jax.fake_quantize(x, implementation="ffi"),
        "nvfp4_rht": lambda x: nvfp4_jax.apply_rht(x, implementation="ffi"),
        "nvfp4_dequantize": lambda x: nvfp4_jax.dequantize(
            nvfp4_jax.quantize(x, implementation="ffi"), implementation="ffi"
        ),
    }
    for target, fn in ops.items():
        text = jax.jit(fn).lower(x).compile().as_text()
        assert f'custom_call_target="{target}"' in text, target


def raw_call(target, args, results, **attrs):
    return jax.ffi.ffi_call(target, results)(*args, **attrs)


@pytest.mark.parametrize(
    "target,args,results,attrs,message",
    [
        (
            "nvfp4_amax",
            [np.zeros((4, 20), np.float32)],
            jax.ShapeDtypeStruct((), jnp.float32),
            dict(rht=False),
            "nvfp4_amax: x of shape (4, 20) and dtype f32: the quantized (last) axis must be a "
            "multiple of 16",
        ),
        (
            "nvfp4_amax",
            [np.zeros((4, 16), np.int32)],
            jax.ShapeDtypeStruct((), jnp.float32),
            dict(rht=False),
            "nvfp4_amax: x of shape (4, 16) and dtype s32: expected dtype bf16, f16 or f32",
        ),
        (
            "nvfp4_quantize",
            [np.zeros((24, 32), np.float32), np.float32(1), np.zeros(4, np.uint32)],
            (
                jax.ShapeDtypeStruct((24, 16), jnp.uint8),
                jax.ShapeDtypeStruct((24, 2), jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((), jnp.float32),
            ),
            dict(block_2d=True, rht=False, stochastic_rounding=False),
            "16x16 blocks need a row count that is a multiple of 16",
        ),
        (
            "nvfp4_quantize",
            [np.zeros((16, 32), np.float32), np.float32(1), np.zeros(3, np.uint32)],
            (
                jax.ShapeDtypeStruct((16, 16), jnp.uint8),
                jax.ShapeDtypeStruct((16, 2), jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((), jnp.float32),
            ),
            dict(block_2d=False, rht=False, stochastic_rounding=False),
            "key words of shape (3,): expected uint32[4]",
        ),
        (
            "nvfp4_dequantize",
            [np.zeros((4, 8), np.uint8), np.zeros((4, 2), jnp.float8_e4m3fn), np.float32(1)],
            jax.ShapeDtypeStruct((4, 16), jnp.float32),
            dict(rht=False),
            "nvfp4_dequantize: scales of shape (4, 2) and dtype f8e4m3fn: expected 4 elements",
        ),
    ],
    ids=["amax_cols", "amax_dtype", "quantize_2d_rows", "quantize_key", "dequantize_scales"],
)
def test_native_errors_name_shape_and_dtype(target, args, results, attrs, message):
    make_impl("cpu")
    with pytest.raises(Exception) as info:
        jax.block_until_ready(raw_call(target, args, results, **attrs))
    assert message in str(info.value)


def test_broken_module_leaves_kernels_unavailable(monkeypatch):
    modules = {"cpu": ("nvfp4_jax._no_such_module", "cpu")}
    monkeypatch.setattr(_library, "MODULES", modules)
    monkeypatch.setattr(_library, "_loaded", {})
    monkeypatch.setattr(_library, "_status", {})
    assert not nvfp4_jax.kernels.is_available("cpu")
    reason = nvfp4_jax.kernels.unavailable_reason("cpu")
    assert "No module named 'nvfp4_jax._no_such_module'" in reason
    with pytest.raises(ValueError, match="_no_such_module"):
        nvfp4_jax.quantize(jnp.ones((16, 16)), implementation="ffi")
    # None falls back to the reference, which keeps working.
    q = nvfp4_jax.quantize(jnp.ones((16, 16)))
    assert_same_q(q, nvfp4_jax.reference.quantize(jnp.ones((16, 16))))


def test_unknown_implementation_is_an_error():
    for bad in ("cuda", "FFI", 1):
        with pytest.raises(ValueError, match="implementation must be one of"):
            nvfp4_jax.quantize(jnp.ones((16, 16)), implementation=bad)


@pytest.mark.parametrize(
    "dtype,block_2d,rht,sr",
    [("bf16", False, True, True), ("f32", True, False, False)],
    ids=["bf16_1d_rht_sr", "f32_2d_plain_rn"],
)
def test_every_cpu_variant_splits_between_threads_alike(cpu_isa, dtype, block_2d, rht, sr):
    cpu, ref = make_impl("cpu"), make_impl("reference")
    x = heavy_tailed(SPLIT_SHAPES[0], dtype, seed=3)
    flags = dict(block_2d=block_2d, rht=rht, stochastic_rounding=sr)
    want = ref.quantize(x, key=KEY, **flags)
    assert_same_q(cpu.quantize(x, key=KEY, **flags), want, cpu_isa)
    assert_same_bits(
        cpu.fake_quantize(x, key=KEY, **flags), ref.fake_quantize(x, key=KEY, **flags), cpu_isa
    )
    bf16 = np_dtype("bf16")
    assert_same_bits(cpu.dequantize(want, bf16), ref.dequantize(want, bf16), cpu_isa)
