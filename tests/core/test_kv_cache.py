"""The NVFP4 KV cache (`nvfp4_jax.kv_cache`): its numbers, vLLM's page bytes, append and read.

Every test runs on each implementation (the `impl` fixture): the reference and the native
CPU kernels write the same bits, which are those of the independent NumPy model
(`tests/kv_cache_oracle.py`: section 15 of docs/NUMERICS.md, and vLLM's writer restated).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import kv_cache_oracle as oracle
import ml_dtypes
import numpy as np
import pytest
from helpers import make_impl
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvfp4_jax import kernels
from nvfp4_jax import kv_cache as kc
from nvfp4_jax._src.core.kernels import _kv_cache as native


def _native_cpu() -> None:
    """Skips unless the native CPU kernels run here (the KV cache has no CUDA kernels)."""
    make_impl("cpu")
    if kernels.current_platform() != "cpu":
        pytest.skip("the native KV cache kernels run on the CPU only")


@pytest.fixture(params=["reference", "cpu"])
def impl(request):
    """The reference and the native CPU kernels (the KV cache has no CUDA kernels)."""
    chosen = make_impl(request.param)
    if chosen.implementation == "ffi" and kernels.current_platform() != "cpu":
        pytest.skip("the native KV cache kernels run on the CPU only")
    return chosen


CONFIGS = {
    "hnd_v": dict(kv_heads=2, head_dim=64, page_size=8),
    "nhd_v": dict(kv_heads=3, head_dim=128, page_size=4, layout="NHD"),
    "hnd_kv": dict(kv_heads=1, head_dim=64, page_size=16, scale_swizzle="kv"),
    "nhd_none_e32": dict(kv_heads=2, head_dim=32, page_size=8, layout="NHD", scale_swizzle="none"),
    "hnd_v_4over6": dict(kv_heads=2, head_dim=128, page_size=8, four_over_six=True),
}


def _tokens(key, shape, dtype=jnp.bfloat16, spread=True):
    """Heavy-tailed tokens: normal times a lognormal factor per head, some blocks tiny."""
    k1, k2 = jax.random.split(jax.random.key(key))
    x = jax.random.normal(k1, shape, jnp.float32)
    if spread:
        x = x * jnp.exp(2.0 * jax.random.normal(k2, shape[:-1] + (1,), jnp.float32))
    return x.astype(dtype)


def _run(impl, op, *args, **kwargs):
    fn = getattr(kc, op)
    return fn(*args, implementation=impl.implementation, **kwargs)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pages_are_vllms_bytes_for_the_same_codes_and_scales(impl, name):
    """The pages hold, byte for byte, what vLLM's writer stores for the tokens' codes and
    scales (the independent restatement of its index arithmetic), slots skipped included."""
    config = kc.KVCacheConfig(**CONFIGS[name])
    batch, tokens, positions = 2, 11, np.array([0, 5], np.int32)
    cache = kc.init_cache(config, batch, 37, k_scale=0.0125, v_scale=0.375)
    shape = (batch, tokens, config.kv_heads, config.head_dim)
    k, v = _tokens(1, shape), _tokens(2, shape)
    got = _run(impl, "append", cache, k, v, positions).pages
    pages = cache.pages.shape[1]
    want = np.zeros((batch * pages, 2 * config.page_bytes), np.uint8)
    sides = []
    for x, scale in ((k, cache.k_scale), (v, cache.v_scale)):
        codes, scales = kc.quantize_heads(x, scale, four_over_six=config.four_over_six)
        sides += [np.asarray(codes), np.asarray(scales).view(np.uint8)]
    slots = positions[:, None] + np.arange(tokens)
    slots = np.where(
        slots < pages * config.page_size,
        slots + np.arange(batch)[:, None] * pages * config.page_size,
        -1,
    )
    flat = [s.reshape(batch * tokens, *s.shape[2:]) for s in sides]
    oracle.vllm_write(
        want,
        *flat,
        slots.reshape(-1),
        num_heads=config.kv_heads,
        head_size=config.head_dim,
        block_size=config.page_size,
        hnd=config.layout == "HND",
        swizzle=config.scale_swizzle,
    )
    np.testing.assert_array_equal(np.asarray(got).reshape(want.shape), want)


@pytest.mark.parametrize("four_over_six", [False, True], ids=["nvfp4", "nvfp4_4over6"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_codes_and_scales_are_section_14s(impl, dtype, four_over_six):
    """A cache's codes and scales are the oracle's (np.float32, step by step), and read
    decodes them as `value(code) * (f32(sf) * scale)`."""
    config = kc.KVCacheConfig(
        kv_heads=2, head_dim=64, page_size=8, scale_swizzle="none", four_over_six=four_over_six
    )
    cache, k, v = _filled_run(impl, config, jnp.dtype(dtype))
    got_k, got_v = _run(impl, "read", cache)
    for x, got, scale in ((k, got_k, 0.0125), (v, got_v, 0.375)):
        codes, scales = oracle.quantize_heads(np.asarray(x, np.float32), scale, four_over_six)
        want = oracle.dequantize_heads(codes, scales, scale)
        np.testing.assert_array_equal(np.asarray(got)[0, :11], want[0])
        np.testing.assert_array_equal(np.asarray(got)[1, 5:16], want[1])


def _filled_run(impl, config, dtype=jnp.bfloat16):
    cache = kc.init_cache(config, 2, 37, k_scale=0.0125, v_scale=0.375)
    shape = (2, 11, config.kv_heads, config.head_dim)
    k, v = _tokens(1, shape, dtype), _tokens(2, shape, dtype)
    return _run(impl, "append", cache, k, v, jnp.array([0, 5])), k, v


def test_four_over_six_changes_some_blocks_and_errs_less(impl):
    """Four Over Six keeps map-to-4 in some blocks and lowers the squared error overall."""
    errors = []
    for fos in (False, True):
        config = kc.KVCacheConfig(kv_heads=2, head_dim=128, four_over_six=fos)
        cache, k, _ = _filled_run(impl, config)
        got, _ = _run(impl, "read", cache)
        errors.append(float(jnp.sum((got[0, :11] - k[0].astype(jnp.float32)) ** 2)))
    assert errors[1] < errors[0]


def test_special_values(impl):
    """Zeros, -0, a NaN and an inf block, huge and tiny blocks: the oracle's bytes."""
    config = kc.KVCacheConfig(kv_heads=1, head_dim=64, page_size=4, scale_swizzle="none")
    x = np.zeros((1, 4, 1, 64), np.float32)
    x[0, 0, 0, :16] = -0.0
    x[0, 0, 0, 16:32] = np.linspace(-3, 3, 16)
    x[0, 0, 0, 32] = np.nan
    x[0, 0, 0, 48] = np.inf
    x[0, 1, 0, :16] = 1e30
    x[0, 1, 0, 16:32] = 1e-4
    x[0, 2, 0] = np.linspace(-100, 100, 64)
    x[0, 3, 0] = 2.0 ** np.arange(-8, 8, 0.25)
    cache = kc.init_cache(config, 1, 4, k_scale=0.01, v_scale=1.0)
    got = _run(impl, "append", cache, x, x, 0)
    for side, scale in ((0, 0.01), (1, 1.0)):
        want_codes, want_scales = oracle.quantize_heads(x[0, :, 0], scale)
        page = np.asarray(got.pages)[0, 0, side]
        data = page[: config.data_bytes].reshape(4, 32)
        np.testing.assert_array_equal(data, want_codes)
        np.testing.assert_array_equal(page[config.data_bytes :].reshape(4, 4), want_scales)
    assert np.asarray(got.pages)[0, 0, 0, config.data_bytes + 2] == 0x7F  # the NaN block


@pytest.mark.parametrize("prefill", [True, False], ids=["prefill", "token_by_token"])
def test_token_by_token_equals_prefill_and_reference(impl, prefill):
    """Appending a token per step writes the bytes a prefill writes; both equal the
    reference's."""
    config = kc.KVCacheConfig(**CONFIGS["nhd_v"])
    cache = kc.init_cache(config, 2, 20, k_scale=0.02, v_scale=0.03)
    shape = (2, 9, config.kv_heads, config.head_dim)
    k, v = _tokens(3, shape), _tokens(4, shape)
    want = kc.append(cache, k, v, 2, implementation="reference")
    if prefill:
        got = _run(impl, "append", cache, k, v, 2)
    else:
        step = jax.jit(
            lambda c, a, b, p: kc.append(c, a, b, p, implementation=impl.implementation),
            donate_argnums=0,
        )
        got = cache
        for t in range(9):
            got = step(got, k[:, t : t + 1], v[:, t : t + 1], jnp.full((2,), 2 + t, jnp.int32))
    np.testing.assert_array_equal(np.asarray(got.pages), np.asarray(want.pages))


def test_slots_outside_the_cache_are_skipped(impl):
    """Negative positions and slots past the end write nothing (vLLM's skipped slot)."""
    config = kc.KVCacheConfig(**CONFIGS["hnd_v"])
    cache = kc.init_cache(config, 2, 16)
    k = _tokens(5, (2, 6, 2, 64))
    got = _run(impl, "append", cache, k, k, jnp.array([-6, 13]))
    pages = np.asarray(got.pages)
    assert not pages[0].any()
    read_k, _ = _run(impl, "read", got)
    assert np.asarray(read_k)[1, 13:16].any() and not np.asarray(read_k)[1, :13].any()


def test_append_is_in_place_under_jit_with_donation(impl):
    """With the cache donated, the new pages live in the old pages' buffer."""
    config = kc.KVCacheConfig(**CONFIGS["hnd_v"])
    cache = kc.init_cache(config, 2, 64)
    step = jax.jit(
        lambda c, a, p: kc.append(c, a, a, p, implementation=impl.implementation), donate_argnums=0
    )
    k = _tokens(6, (2, 1, 2, 64))
    cache = step(cache, k, jnp.array([0, 0]))  # the first call owns a fresh buffer
    before = cache.pages.unsafe_buffer_pointer()
    cache = step(cache, k, jnp.array([1, 1]))
    assert cache.pages.unsafe_buffer_pointer() == before


def test_vmap_over_layers_is_the_loop(impl):
    """A stack of layers' caches (one scale per layer) under vmap: each layer's own bytes."""
    config = kc.KVCacheConfig(**CONFIGS["hnd_v"])
    caches = [kc.init_cache(config, 2, 24, k_scale=0.01 * (i + 1), v_scale=0.5) for i in range(3)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *caches)
    k = _tokens(7, (3, 2, 5, 2, 64))
    fn = jax.vmap(lambda c, x: kc.append(c, x, x, 1, implementation=impl.implementation))
    got = jax.jit(fn)(stacked, k)
    for i, cache in enumerate(caches):
        want = kc.append(cache, k[i], k[i], 1, implementation="reference")
        np.testing.assert_array_equal(np.asarray(got.pages[i]), np.asarray(want.pages))
    reads = jax.vmap(lambda c: kc.read(c, implementation=impl.implementation))(got)
    np.testing.assert_array_equal(
        np.asarray(reads[0][1]), np.asarray(kc.read(jax.tree.map(lambda a: a[1], got))[0])
    )


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["auto", "explicit"])
def test_sequences_sharded_give_the_unsharded_bytes(impl, mode):
    """Under jit with the sequences sharded over 4 devices (Auto axes, or Explicit ones with
    the mesh set): the same pages, the same reads, the pages still sharded."""
    config = kc.KVCacheConfig(**CONFIGS["hnd_v"])
    kind = jax.sharding.AxisType.Auto if mode == "auto" else jax.sharding.AxisType.Explicit
    mesh = jax.make_mesh((4,), ("data",), axis_types=(kind,))
    cache = kc.init_cache(config, 4, 24, k_scale=0.02, v_scale=0.04)
    k = _tokens(8, (4, 3, 2, 64))
    want = kc.append(cache, k, k, 2, implementation="reference")
    name = impl.implementation

    def put(a):
        return jax.device_put(a, NamedSharding(mesh, P("data") if a.ndim else P()))

    with jax.set_mesh(mesh) if mode == "explicit" else contextlib.nullcontext():
        sharded, k_sharded = jax.tree.map(put, cache), put(k)
        got = jax.jit(lambda c, x: kc.append(c, x, x, 2, implementation=name))(sharded, k_sharded)
        read = jax.jit(lambda c: kc.read(c, implementation=name)[1])(got)
        assert got.pages.sharding.spec[0] == "data"
    np.testing.assert_array_equal(np.asarray(got.pages), np.asarray(want.pages))
    np.testing.assert_array_equal(np.asarray(read), np.asarray(kc.read(want)[1]))


def test_native_program_holds_the_custom_calls():
    """The native path compiles to the custom calls, the reference to none."""
    _native_cpu()
    config = kc.KVCacheConfig(**CONFIGS["hnd_v"])
    cache = kc.init_cache(config, 1, 16)
    k = _tokens(9, (1, 1, 2, 64))
    for name, present in (("ffi", True), ("reference", False)):
        append = functools.partial(kc.append, positions=0, implementation=name)
        text = jax.jit(lambda c, x, f=append: f(c, x, x)).lower(cache, k).as_text()
        assert ("nvfp4_kv_cache_write" in text) == present
        read = functools.partial(kc.read, implementation=name)
        assert ("nvfp4_kv_cache_read" in jax.jit(read).lower(cache).as_text()) == present


def test_cache_bytes_are_under_0_29_of_bf16_at_head_dim_128():
    """72 bytes per head and token and side against bf16's 256: 9/32 = 0.28125."""
    config = kc.KVCacheConfig(kv_heads=8, head_dim=128)
    assert config.full_dim == 72
    bf16 = 2 * 4096 * 8 * 128 * 2
    assert config.cache_bytes(4096) / bf16 == 9 / 32


def test_scale_from_amax_is_modelopts_division():
    amax = np.float32(3.7)
    assert float(kc.scale_from_amax(amax)) == float(amax / np.float32(448))
    assert float(kc.scale_from_amax(0.0)) == 1.0


BAD_CALLS = [
    ("k_rank", lambda c, k: kc.append(c, k[0], k, 0), ValueError, "k must be"),
    (
        "k_heads",
        lambda c, k: kc.append(c, k[:, :, :1], k[:, :, :1], 0),
        ValueError,
        "key/value heads",
    ),
    ("k_dtype", lambda c, k: kc.append(c, k.astype(jnp.int32), k, 0), TypeError, "dtype int32"),
    ("kv_shapes", lambda c, k: kc.append(c, k, k[:, :1], 0), ValueError, "one shape"),
    (
        "positions_shape",
        lambda c, k: kc.append(c, k, k, jnp.zeros(3, jnp.int32)),
        ValueError,
        "positions",
    ),
    ("positions_float", lambda c, k: kc.append(c, k, k, 0.5), TypeError, "positions"),
    ("not_a_cache", lambda c, k: kc.append(c.pages, k, k, 0), TypeError, "NVFP4KVCache"),
    (
        "q_heads",
        lambda c, k: kc.attention(k[:, :, :, :].repeat(3, 2)[:, :, :3], c, 1),
        ValueError,
        "multiple",
    ),
    ("q_head_dim", lambda c, k: kc.attention(k[..., :32], c, 1), ValueError, "E=64"),
    ("read_dtype", lambda c, k: kc.read(c, jnp.int8), TypeError, "dtype"),
]


@pytest.mark.parametrize("name,call,error,match", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_bad_arguments_are_named(impl, name, call, error, match):
    """Bad shapes and dtypes raise the same error on every implementation, naming them."""
    del name
    config = kc.KVCacheConfig(**CONFIGS["hnd_v"])
    cache = kc.init_cache(config, 2, 16)
    k = _tokens(10, (2, 3, 2, 64))
    with pytest.raises(error, match=match):
        with jax.default_device(impl.device):
            call(cache, k)


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(kv_heads=0, head_dim=64), "kv_heads must be positive"),
        (dict(kv_heads=1, head_dim=40), "multiple of 16"),
        (dict(kv_heads=1, head_dim=32), "multiple of 64"),
        (dict(kv_heads=1, head_dim=64, page_size=6), "multiple of 4"),
        (dict(kv_heads=1, head_dim=64, layout="HDN"), "layout"),
        (dict(kv_heads=1, head_dim=64, scale_swizzle="k"), "scale_swizzle"),
    ],
)
def test_bad_configs_are_named(fields, match):
    with pytest.raises(ValueError, match=match):
        kc.KVCacheConfig(**fields)


def test_bad_scales_and_sizes_are_named():
    config = kc.KVCacheConfig(kv_heads=1, head_dim=64)
    with pytest.raises(ValueError, match="k_scale must be finite and positive"):
        kc.init_cache(config, 1, 8, k_scale=0.0)
    with pytest.raises(ValueError, match="length must be positive"):
        kc.init_cache(config, 1, 0)
    with pytest.raises(TypeError, match="batch must be an int"):
        kc.init_cache(config, 1.5, 8)


def _bad_native_calls(config):
    """(target, call) pairs each of which hands the handler one operand it must refuse."""
    bad_pages = jnp.zeros((1, 2, 2, config.page_bytes + 1), jnp.uint8)
    pages = jnp.zeros((1, 2, 2, config.page_bytes), jnp.uint8)
    k = jnp.zeros((1, 1, 2, 64), jnp.bfloat16)
    q = jnp.zeros((1, 1, 4, 64), jnp.bfloat16)
    one = jnp.zeros(1, jnp.int32)
    return [
        (
            "nvfp4_kv_cache_write: pages of shape",
            lambda: native.kv_cache_write(config, bad_pages, 1.0, 1.0, k, k, one),
        ),
        (
            "nvfp4_kv_cache_write: k of shape",
            lambda: native.kv_cache_write(config, pages, 1.0, 1.0, k[..., :32], k[..., :32], one),
        ),
        (
            "nvfp4_kv_cache_read: pages of shape",
            lambda: native.kv_cache_read(config, bad_pages, 1.0, 1.0, jnp.float32),
        ),
        (
            "nvfp4_kv_attention: q of shape",
            lambda: native.kv_attention(config, q[:, :, :3], pages, 1.0, 1.0, one, 1.0),
        ),
        (
            "nvfp4_kv_attention: lengths of shape",
            lambda: native.kv_attention(config, q, pages, 1.0, 1.0, jnp.zeros(2, jnp.int32), 1.0),
        ),
    ]


def test_the_native_targets_refuse_a_wrong_operand():
    """Each FFI handler names the bad operand (never reads or writes outside a buffer)."""
    _native_cpu()
    config = kc.KVCacheConfig(**CONFIGS["hnd_v"])
    for message, call in _bad_native_calls(config):
        with pytest.raises(Exception, match=message):
            jax.block_until_ready(call())


def test_e4m3_scale_bytes_are_ml_dtypes_values():
    """The oracle's scale bytes decode with ml_dtypes as the cache's read does."""
    codes, scales = oracle.quantize_heads(np.linspace(-5, 5, 64, dtype=np.float32), 0.01)
    assert scales.view(ml_dtypes.float8_e4m3fn).astype(np.float32).max() <= 448
