"""Quantizes tensors to NVFP4 and prints the quantization error of each scheme.

    python examples/quantize_demo.py [--rows 4096] [--cols 4096] [--implementation reference]

Two inputs: standard normal data (the error table of docs/NUMERICS.md section 10) and heavy-tailed
data (normal times a lognormal factor per row, plus outliers), where the Random Hadamard
Transform spreads the outliers over their blocks. The Four Over Six rows (each block keeps
the better of its amax mapped to 6 or to 4) show what it buys on each input.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import nvfp4_jax

# (name, quantize keyword arguments, relative MSE on standard normal data per docs/NUMERICS.md)
SCHEMES = (
    ("1x16, round to nearest", {}, 0.0090),
    ("16x16 blocks (weights)", {"block_2d": True}, 0.0124),
    ("1x16, stochastic rounding", {"stochastic_rounding": True}, 0.0188),
    ("1x16, RHT + round to nearest", {"rht": True}, None),
    ("1x16, RHT + stochastic rounding", {"rht": True, "stochastic_rounding": True}, None),
    # Four Over Six (docs/NUMERICS.md section 13), the global scale's E4M3 max 256.
    ("1x16, 4/6 (MAE)", {"four_over_six": "mae"}, None),
    ("1x16, 4/6 (MSE)", {"four_over_six": "mse"}, None),
    (
        "1x16, 4/6 (MSE), E4M3 max 448",
        {"four_over_six": "mse", "four_over_six_e4m3_max": 448},
        None,
    ),
    ("16x16 blocks, 4/6 (MSE)", {"block_2d": True, "four_over_six": "mse"}, None),
    ("1x16, RHT + 4/6 (MSE)", {"rht": True, "four_over_six": "mse"}, None),
    (
        "1x16, 4/6 (MSE) + stochastic rounding",
        {"four_over_six": "mse", "stochastic_rounding": True},
        None,
    ),
)


def heavy_tailed(key: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """Normal data times a lognormal factor per row, with a few large outliers."""
    k_normal, k_rows, k_where = jax.random.split(key, 3)
    x = jax.random.normal(k_normal, shape) * jnp.exp(2.0 * jax.random.normal(k_rows, (shape[0], 1)))
    outliers = jax.random.bernoulli(k_where, 1e-3, shape)
    return jnp.where(outliers, 50.0 * x, x)


def relative_mse(x: jax.Array, kwargs: dict, key: jax.Array, implementation: str | None) -> float:
    """Relative MSE ||dequantize(quantize(x)) - x||^2 / ||x||^2 of one scheme."""
    q = nvfp4_jax.quantize(x, key=key, implementation=implementation, **kwargs)
    x_hat = q.dequantize(jnp.float32)
    x32 = x.astype(jnp.float32)
    return float(jnp.sum((x_hat - x32) ** 2) / jnp.sum(x32**2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--implementation", choices=("reference", "ffi"), default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.rows % 16 or args.cols % 16:
        parser.error(f"--rows and --cols must be multiples of 16, got {args.rows}, {args.cols}")

    key = jax.random.key(args.seed)
    k_normal, k_heavy, k_sr = jax.random.split(key, 3)
    shape = (args.rows, args.cols)
    normal = jax.random.normal(k_normal, shape).astype(args.dtype)
    heavy = heavy_tailed(k_heavy, shape).astype(args.dtype)
    print(f"nvfp4_jax {nvfp4_jax.__version__} on {jax.default_backend()}: {shape} {args.dtype}")
    print(f"{'scheme':40s} {'normal':>9s} {'expected':>9s} {'heavy-tailed':>13s}")
    start = time.perf_counter()
    for name, kwargs, expected in SCHEMES:
        err_normal = relative_mse(normal, kwargs, k_sr, args.implementation)
        err_heavy = relative_mse(heavy, kwargs, k_sr, args.implementation)
        anchor = f"{expected:9.4f}" if expected is not None else f"{'-':>9s}"
        print(f"{name:40s} {err_normal:9.4f} {anchor} {err_heavy:13.4f}")
    print(f"(relative MSE; {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
