"""Multi-device checks, run in a subprocess on 8 CPU devices (see test_distributed.py).

    python tests/distributed_checks.py [CHECK ...]      (no names: every check)

XLA must see `--xla_force_host_platform_device_count=8` before JAX initializes, which a
pytest process that already imported JAX cannot arrange, so this script sets the flag itself
and runs as its own process. It prints one line per check, `PASS <name>` or
`FAIL <name>: <why>`, and exits non-zero if any check failed.

Each check compares a sharded computation with the same computation on one device:

* quantize under `jit` with a `NamedSharding` (rows sharded, or the quantized axis sharded
  in multiples of 16): codes, scales and amax bit for bit;
* quantize inside `shard_map` with the global amax (`lax.pmax` of the local `tensor_amax`,
  passed as `amax=`): bit for bit; with stochastic rounding through
  `distributed.quantize_shard` (global amax and the shard's SR offset): bit for bit;
* fake_quantize, dequantize, apply_rht and a non-finite input under `jit` with sharded
  inputs: bit for bit;
* the compiled HLO of the FFI ops on a row-sharded input runs the custom call on the local
  shard: no all-gather (only scalar all-reduces for the amax);
* a training step of a 2-layer NVFP4 MLP, data-parallel (batch over 8 devices, parameters
  replicated) and FSDP-style (parameters sharded along one axis, batch sharded too): the
  loss and the gradients.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from nvfp4_jax import (  # noqa: E402
    NVFP4Recipe,
    apply_rht,
    dequantize,
    distributed,
    dot_general,
    fake_quantize,
    kernels,
    quantize,
    tensor_amax,
)

AXIS = "x"
IMPLEMENTATIONS = ["reference"] + (["ffi"] if kernels.is_available("cpu") else [])


class CheckFailed(Exception):
    """A sharded result differs from the unsharded one."""


def mesh():
    return jax.make_mesh((8,), (AXIS,), axis_types=(AxisType.Auto,))


def on_one_device(*arrays):
    return [jax.device_put(a, jax.devices()[0]) for a in arrays]


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def require_same_bits(actual, expected, what):
    a, e = bits(actual), bits(expected)
    if a.shape != e.shape or not np.array_equal(a, e):
        differ = "shapes differ" if a.shape != e.shape else f"{np.sum(a != e)} of {a.size} differ"
        raise CheckFailed(f"{what}: {differ}")


def require_same_quantization(q, q_ref, what):
    for field in ("codes", "scales", "amax"):
        require_same_bits(getattr(q, field), getattr(q_ref, field), f"{what} {field}")


def data(shape, seed=0):
    """Normal times a lognormal factor per row, so blocks and shards have different amaxes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * rng.lognormal(0.0, 1.5, (shape[0],) + (1,) * (len(shape) - 1))
    return jnp.asarray(x.astype(np.float32))


# --- quantize under jit with NamedSharding ------------------------------------------------

# name -> (shape, partition spec of the input, quantize kwargs)
JIT_CASES = {
    "rows_sharded_1x16": ((128, 64), P(AXIS, None), {"axis": -1}),
    "quantized_axis_sharded_1x16": ((64, 128), P(None, AXIS), {"axis": -1}),
    "quantized_axis_sharded_axis0": ((128, 64), P(AXIS, None), {"axis": 0}),
    "rows_sharded_2d": ((128, 64), P(AXIS, None), {"axis": -1, "block_2d": True}),
    "quantized_axis_sharded_rht": ((128, 64), P(AXIS, None), {"axis": 0, "rht": True}),
    "rows_sharded_sr": ((128, 64), P(AXIS, None), {"axis": -1, "stochastic_rounding": True}),
    "rows_sharded_rht_sr_bf16": (
        (128, 64),
        P(AXIS, None),
        {"axis": 0, "rht": True, "stochastic_rounding": True},
    ),
    "rows_sharded_rht_sr": ((128, 64), P(AXIS, None), {"rht": True, "stochastic_rounding": True}),
    "rows_sharded_2d_sr": (
        (128, 64),
        P(AXIS, None),
        {"block_2d": True, "stochastic_rounding": True},
    ),
    "rows_sharded_3d_sr": ((16, 8, 64), P(AXIS, None, None), {"stochastic_rounding": True}),
    "middle_axis_sharded_3d_sr": ((4, 16, 64), P(None, AXIS, None), {"stochastic_rounding": True}),
    "rows_sharded_2d_8_rows": ((64, 64), P(AXIS, None), {"block_2d": True}),
}


def check_quantize_jit_sharded():
    m, key = mesh(), jax.random.key(3)
    for implementation in IMPLEMENTATIONS:
        for name, (shape, spec, kw) in JIT_CASES.items():
            x = data(shape)
            if name.endswith("bf16"):
                x = x.astype(jnp.bfloat16)

            def run(x, key, kw=kw, implementation=implementation):
                return quantize(x, key=key, implementation=implementation, **kw)

            expected = jax.jit(run)(*on_one_device(x, key))
            sharded = jax.device_put(x, NamedSharding(m, spec))
            q = jax.jit(run)(sharded, key)
            require_same_quantization(q, expected, f"{implementation} {name}")


def check_other_ops_jit_sharded():
    """fake_quantize, dequantize, apply_rht and non-finite inputs, sharded along rows."""
    m, key = mesh(), jax.random.key(5)
    rows = NamedSharding(m, P(AXIS, None))
    bad = data((128, 64), seed=2).at[37, 5].set(jnp.inf)
    for implementation in IMPLEMENTATIONS:
        cases = {
            "fake_quantize_sr": lambda x, k, i=implementation: fake_quantize(
                x, stochastic_rounding=True, key=k, implementation=i
            ),
            "fake_quantize_rht_2d_bf16_out": lambda x, k, i=implementation: fake_quantize(
                x, rht=True, block_2d=True, dtype=jnp.bfloat16, implementation=i
            ),
            "fake_quantize_no_global_scale": lambda x, k, i=implementation: fake_quantize(
                x, global_scale=False, implementation=i
            ),
            "dequantize_rht": lambda x, k, i=implementation: dequantize(
                quantize(x, rht=True, implementation=i), implementation=i
            ),
            "apply_rht": lambda x, k, i=implementation: apply_rht(x, implementation=i),
            "tensor_amax_rht": lambda x, k, i=implementation: tensor_amax(
                x, rht=True, implementation=i
            ),
        }
        for name, fn in cases.items():
            for label, x in (("", data((128, 64), seed=2)), (" non-finite", bad)):
                if name == "apply_rht" and label:
                    continue
                expected = jax.jit(fn)(*on_one_device(x, key))
                actual = jax.jit(fn)(jax.device_put(x, rows), key)
                require_same_bits(actual, expected, f"{implementation} {name}{label}")
        # A finite caller amax with inf in one shard: NaN stored amax / NaN everywhere.
        for name, fn in {
            "quantize": lambda x, i=implementation: (
                quantize(x, amax=jnp.float32(3), implementation=i).amax
            ),
            "fake_quantize": lambda x, i=implementation: fake_quantize(
                x, amax=jnp.float32(3), implementation=i
            ),
        }.items():
            expected = jax.jit(fn)(*on_one_device(bad))
            actual = jax.jit(fn)(jax.device_put(bad, rows))
            require_same_bits(actual, expected, f"{implementation} {name} caller amax, inf")


# --- the FFI custom calls run on local shards (no all-gather in the compiled HLO) ------------

# name -> (target, function of the row-sharded input)
HLO_CASES = {
    "amax": ("nvfp4_amax", lambda x: tensor_amax(x, rht=True, implementation="ffi")),
    "quantize": ("nvfp4_quantize", lambda x: quantize(x, implementation="ffi").codes),
    "quantize_sr_2d": (
        "nvfp4_quantize",
        lambda x: (
            quantize(
                x,
                block_2d=True,
                stochastic_rounding=True,
                key=jax.random.key(0),
                implementation="ffi",
            ).codes
        ),
    ),
    "fake_quantize_rht_sr": (
        "nvfp4_fake_quantize",
        lambda x: fake_quantize(
            x, rht=True, stochastic_rounding=True, key=jax.random.key(0), implementation="ffi"
        ),
    ),
    "dequantize": (
        "nvfp4_dequantize",
        lambda x: dequantize(quantize(x, rht=True, implementation="ffi"), implementation="ffi"),
    ),
    "apply_rht": ("nvfp4_rht", lambda x: apply_rht(x, implementation="ffi")),
    "quantize_axis0": ("nvfp4_quantize", lambda x: quantize(x, axis=0, implementation="ffi").codes),
}


def compiled_hlo(fn, x):
    return jax.jit(fn).lower(x).compile().as_text()


def check_ffi_hlo_no_all_gather():
    if "ffi" not in IMPLEMENTATIONS:
        print("  note: native CPU kernels not built; nothing to check")
        return
    m = mesh()
    x = jax.device_put(data((128, 64), seed=3), NamedSharding(m, P(AXIS, None)))
    for name, (target, fn) in HLO_CASES.items():
        text = compiled_hlo(fn, x)
        if f'custom_call_target="{target}"' not in text:
            raise CheckFailed(f"{name}: no custom call {target} in the compiled HLO")
        # The custom call must see the local shard (16 of 128 rows), and nothing gathered.
        calls = [line for line in text.splitlines() if f'custom_call_target="{target}"' in line]
        if not any("[16,64]" in line or "[64,16]" in line for line in calls):
            raise CheckFailed(f"{name}: {target} does not run on the local shard:\n{calls}")
        gathers = [line.strip() for line in text.splitlines() if "all-gather(" in line]
        if gathers:
            raise CheckFailed(f"{name}: the compiled HLO all-gathers: {gathers[0][:300]}")


# --- quantize inside shard_map with a global amax -------------------------------------------

# name -> (shape, spec of the input, spec of codes and scales (stored layout), kwargs)
SHARD_MAP_CASES = {
    "rows_sharded_1x16": ((128, 64), P(AXIS, None), P(AXIS, None), {}),
    "quantized_axis_sharded_1x16": ((64, 128), P(None, AXIS), P(None, AXIS), {}),
    "quantized_axis_sharded_rht": ((64, 128), P(None, AXIS), P(None, AXIS), {"rht": True}),
    "rows_sharded_2d": ((128, 64), P(AXIS, None), P(AXIS, None), {"block_2d": True}),
}


def check_quantize_shard_map_global_amax():
    m = mesh()
    for implementation in IMPLEMENTATIONS:
        for name, (shape, in_spec, out_spec, kw) in SHARD_MAP_CASES.items():
            x = data(shape, seed=1)

            def local(x_shard, kw=kw, implementation=implementation):
                local_amax = tensor_amax(
                    x_shard, rht=kw.get("rht", False), implementation=implementation
                )
                amax = jax.lax.pmax(local_amax, AXIS)
                q = quantize(x_shard, amax=amax, implementation=implementation, **kw)
                return q.codes, q.scales, q.amax[None]  # every shard's amax, to compare all

            sharded = jax.jit(
                jax.shard_map(
                    local, mesh=m, in_specs=in_spec, out_specs=(out_spec, out_spec, P(AXIS))
                )
            )
            codes, scales, amax = sharded(jax.device_put(x, NamedSharding(m, in_spec)))
            (x1,) = on_one_device(x)
            unsharded = functools.partial(quantize, implementation=implementation, **kw)
            expected = jax.jit(unsharded)(x1)
            what = f"{implementation} {name}"
            require_same_bits(codes, expected.codes, f"{what} codes")
            require_same_bits(scales, expected.scales, f"{what} scales")
            for shard_amax in amax:
                require_same_bits(shard_amax, expected.amax, f"{what} amax")


# --- stochastic rounding inside shard_map: the shard's SR offset ----------------------------

# name -> (shape, spec of the input = spec of codes and scales, kwargs)
SHARD_MAP_SR_CASES = {
    "rows_sharded_sr": ((128, 64), P(AXIS, None), {}),
    "rows_sharded_rht_sr_bf16": ((128, 64), P(AXIS, None), {"rht": True}),
    "rows_sharded_2d_sr": ((128, 64), P(AXIS, None), {"block_2d": True}),
    "rows_sharded_3d_sr": ((16, 4, 64), P(AXIS, None, None), {}),
    "axis0_sr": ((64, 128), P(None, AXIS), {"axis": 0}),  # stored (128, 64): rows sharded
}


def check_quantize_shard_map_sr():
    m, key = mesh(), jax.random.key(9)
    for implementation in IMPLEMENTATIONS:
        for name, (shape, spec, kw) in SHARD_MAP_SR_CASES.items():
            x = data(shape, seed=4)
            if name.endswith("bf16"):
                x = x.astype(jnp.bfloat16)
            stored_spec = spec if kw.get("axis", -1) == -1 else P(spec[1], spec[0])

            def local(x_shard, key, kw=kw, implementation=implementation):
                q = distributed.quantize_shard(
                    x_shard,
                    axis_names=AXIS,
                    stochastic_rounding=True,
                    key=key,
                    implementation=implementation,
                    **kw,
                )
                values = distributed.fake_quantize_shard(
                    x_shard,
                    axis_names=AXIS,
                    stochastic_rounding=True,
                    key=key,
                    implementation=implementation,
                    **kw,
                )
                return q.codes, q.scales, q.amax[None], values

            sharded = jax.jit(
                jax.shard_map(
                    local,
                    mesh=m,
                    in_specs=(spec, P()),
                    out_specs=(stored_spec, stored_spec, P(AXIS), spec),
                )
            )
            codes, scales, amax, values = sharded(jax.device_put(x, NamedSharding(m, spec)), key)
            x1, key1 = on_one_device(x, key)

            def unsharded(x, key, kw=kw, implementation=implementation):
                flags = dict(stochastic_rounding=True, key=key, implementation=implementation)
                return quantize(x, **flags, **kw), fake_quantize(x, **flags, **kw)

            expected, expected_values = jax.jit(unsharded)(x1, key1)
            what = f"{implementation} {name}"
            require_same_bits(codes, expected.codes, f"{what} codes")
            require_same_bits(scales, expected.scales, f"{what} scales")
            require_same_bits(values, expected_values, f"{what} fake_quantize")
            for shard_amax in amax:
                require_same_bits(shard_amax, expected.amax, f"{what} amax")


# --- training steps ---------------------------------------------------------------------------

BATCH, IN, WIDTH, OUT = 128, 128, 128, 64
DENSE = (((1,), (0,)), ((), ()))


def mlp_loss(params, x, y, key, recipe):
    # Layer 1 draws SR bits from a key; layer 2 from its gradient's bits (key=None): both
    # must be sharding-invariant.
    h = jax.nn.gelu(dot_general(x, params["w1"], DENSE, recipe=recipe, key=key) + params["b1"])
    out = dot_general(h, params["w2"], DENSE, recipe=recipe, key=None)
    return jnp.mean((out - y) ** 2)


def train_setup():
    rng = np.random.default_rng(7)
    params = {
        "w1": rng.standard_normal((IN, WIDTH)) / np.sqrt(IN),
        "b1": rng.standard_normal((WIDTH,)) * 0.1,
        "w2": rng.standard_normal((WIDTH, OUT)) / np.sqrt(WIDTH),
    }
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    x = jnp.asarray(rng.standard_normal((BATCH, IN)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((BATCH, OUT)), jnp.float32)
    return params, x, y, jax.random.key(11)


# Every quantized operand is the same bits sharded or not (quantization is blockwise, the
# amax a max, SR bits positional, the derived key a wrapping integer sum), and XLA gathers
# the token axis for the wgrad GEMM (its blocks and RHT run along it), so the NVFP4 weight
# gradients must be bit-exact. The bias gradient is a plain f32 sum over the sharded batch:
# per-device partial sums and an all-reduce, another summation order than one device's; it
# (and the loss, a mean over the batch, if XLA reduces it that way) may differ by f32
# rounding: 1e-5 of the largest entry, relative L2 1e-5.
EXACT_LEAVES = ("w1", "w2")
GRAD_ATOL_REL, GRAD_L2_REL = 1e-5, 1e-5


def require_close_tree(actual, expected, what):
    for path, a in jax.tree_util.tree_leaves_with_path(actual):
        e = np.asarray(dict(jax.tree_util.tree_leaves_with_path(expected))[path])
        a = np.asarray(a)
        if np.array_equal(bits(a), bits(e)):
            continue
        if path[-1].key in EXACT_LEAVES:
            require_same_bits(a, e, f"{what}{jax.tree_util.keystr(path)}")
        scale = np.max(np.abs(e))
        worst = np.max(np.abs(a - e)) / scale
        l2 = np.linalg.norm(a - e) / np.linalg.norm(e)
        print(
            f"  note {what}{jax.tree_util.keystr(path)}: not bit-exact, max abs error "
            f"{worst:.2e} of max |g|, relative L2 {l2:.2e}"
        )
        if worst > GRAD_ATOL_REL or l2 > GRAD_L2_REL:
            raise CheckFailed(f"{what}{jax.tree_util.keystr(path)}: error {worst:.2e} / {l2:.2e}")


def check_train_step(param_specs, name):
    m = mesh()
    params, x, y, key = train_setup()
    for implementation in IMPLEMENTATIONS:
        recipe = NVFP4Recipe(implementation=implementation)
        step = jax.jit(jax.value_and_grad(mlp_loss), static_argnums=4)
        loss_1, grads_1 = step(*on_one_device(params, x, y, key), recipe)
        batch = NamedSharding(m, P(AXIS, None))
        sharded_params = jax.tree.map(
            lambda a, s: jax.device_put(a, NamedSharding(m, s)), params, param_specs
        )
        loss_8, grads_8 = step(
            sharded_params, jax.device_put(x, batch), jax.device_put(y, batch), key, recipe
        )
        what = f"{name} {implementation}"
        if not np.array_equal(bits(loss_8), bits(loss_1)):
            print(f"  note {what}: loss {float(loss_8)!r} vs {float(loss_1)!r} on one device")
            if abs(float(loss_8) - float(loss_1)) > 1e-6 * abs(float(loss_1)):
                raise CheckFailed(f"{what}: loss {float(loss_8)} != {float(loss_1)}")
        require_close_tree(grads_8, grads_1, f"{what} grads")


def check_data_parallel_step():
    replicated = {"w1": P(), "b1": P(), "w2": P()}
    check_train_step(replicated, "data_parallel")


def check_fsdp_step():
    # Weights sharded along their first axis (16 rows per device), the batch over the same axis.
    fsdp = {"w1": P(AXIS, None), "b1": P(AXIS), "w2": P(AXIS, None)}
    check_train_step(fsdp, "fsdp")


CHECKS = {
    "quantize_jit_sharded": check_quantize_jit_sharded,
    "quantize_shard_map_global_amax": check_quantize_shard_map_global_amax,
    "quantize_shard_map_sr": check_quantize_shard_map_sr,
    "other_ops_jit_sharded": check_other_ops_jit_sharded,
    "ffi_hlo_no_all_gather": check_ffi_hlo_no_all_gather,
    "data_parallel_step": check_data_parallel_step,
    "fsdp_step": check_fsdp_step,
}


def main(names: list[str]) -> int:
    if jax.device_count() != 8:
        print(f"FAIL setup: expected 8 devices, got {jax.device_count()}")
        return 1
    print(f"implementations: {IMPLEMENTATIONS}")
    failed = 0
    for name in names or CHECKS:
        if name not in CHECKS:
            print(f"FAIL {name}: no such check (choose from {sorted(CHECKS)})")
            failed += 1
            continue
        try:
            CHECKS[name]()
        except Exception as e:  # noqa: BLE001  (report every check, then fail)
            failed += 1
            detail = "" if isinstance(e, CheckFailed) else "\n" + traceback.format_exc()
            print(f"FAIL {name}: {type(e).__name__}: {e}{detail}", flush=True)
        else:
            print(f"PASS {name}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
