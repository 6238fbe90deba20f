"""How often the NVFP4 KV cache's exact arithmetic can differ from vLLM's approximate reciprocals.

    python benchmarks/kv_cache_rcp.py            # 2^20 values per data set, prints a table

vLLM's writer (`nvfp4_kv_cache_kernels.cu` with `cvt_warp_fp16_to_fp4` of
`nvfp4_utils.cuh`) computes a block's scale as `e4m3(SFScale * (vecMax * rcp(6)))` and its
element multiplier as `rcp(SF * rcp(SFScale))`, `SFScale = 1 / k_scale`, where `rcp` is PTX's
`rcp.approx.ftz.f32`. PTX documents its error as at most 1 ulp, without saying which of the
two f32 neighbours of the true reciprocal it returns; `nvfp4_jax.kv_cache` (docs/NUMERICS.md
section 15) rounds every reciprocal correctly instead. This script takes each of the three
reciprocals as either neighbour (8 combinations) and counts, against the exact path:

* "can differ": blocks (scale bytes) or elements (codes) where at least one combination
  gives other bits (an upper bound on what a GPU's `rcp.approx` changes);
* "must differ": where every combination does (a lower bound).

The data: keys-like bf16 vectors (N(0, 1)) and heavy-tailed ones (N(0, 1) times a lognormal
factor per 16-block), each with the decode scale `amax / 448` (`scale_from_amax`) and with
vLLM's default scale 1.0. No GPU is needed (the bounds hold for any faithful `rcp`).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform

import ml_dtypes
import numpy as np

F32 = np.float32
E4M3_MAX = F32(448)


def _neighbours(exact: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two f32 values a faithful reciprocal may return: RD and RU of the true value.

    `exact` is f64; where it is an f32 value both are that value.
    """
    down = exact.astype(F32)
    down = np.where(down.astype(np.float64) > exact, np.nextafter(down, F32(-np.inf)), down)
    up = np.where(down.astype(np.float64) < exact, np.nextafter(down, F32(np.inf)), down)
    return down.astype(F32), up.astype(F32)


def _e4m3(v: np.ndarray) -> np.ndarray:
    """cvt to e4m3 with saturation (`__nv_fp8_e4m3(v)`): RNE, clamped to 448."""
    return np.minimum(v, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)


def _e2m1(y: np.ndarray) -> np.ndarray:
    """cvt.rn.satfinite.e2m1: the magnitude code of |y| (nearest even), sign ignored."""
    a = np.abs(y)
    edges = [
        (0.25, False),
        (0.75, True),
        (1.25, False),
        (1.75, True),
        (2.5, False),
        (3.5, True),
        (5.0, False),
    ]  # (edge, a tie goes up)
    code = np.zeros(a.shape, np.uint8)
    for edge, up in edges:
        code += (a >= edge) if up else (a > edge)
    return code


def exact_path(blocks: np.ndarray, s: F32):
    """(scale bytes, codes) of nvfp4_jax: S_enc = 1/s, RN(1/6), enc = 1/(sf * s)."""
    amax = np.max(np.abs(blocks), axis=-1)
    s_enc = F32(1) / s
    sf = _e4m3((s_enc * (amax * (F32(1) / F32(6)))).astype(F32))
    sf32 = sf.astype(F32)
    with np.errstate(divide="ignore"):
        enc = np.where(sf32 == 0, F32(0), F32(1) / (sf32 * s)).astype(F32)
    return sf.view(np.uint8), _e2m1(blocks * enc[..., None])


def vllm_paths(blocks: np.ndarray, s: F32):
    """Every (scale bytes, codes) vLLM's writer can give with faithful reciprocals."""
    amax = np.max(np.abs(blocks), axis=-1)
    sf_scale = F32(1) / s
    rcp6s = _neighbours(np.array(1 / 6))
    inners = _neighbours(np.array(1 / np.float64(sf_scale)))
    out = []
    for rcp6, inner, outer in itertools.product(rcp6s, inners, range(2)):
        sf = _e4m3((sf_scale * (amax * F32(rcp6))).astype(F32))
        sf32 = sf.astype(F32)
        product = (sf32 * F32(inner)).astype(F32)
        with np.errstate(divide="ignore"):
            candidates = _neighbours(1 / product.astype(np.float64))
        enc = np.where(sf32 == 0, F32(0), candidates[outer]).astype(F32)
        out.append((sf.view(np.uint8), _e2m1(blocks * enc[..., None])))
    return out


def measure(blocks: np.ndarray, s: F32) -> dict:
    scales, codes = exact_path(blocks, s)
    others = vllm_paths(blocks, s)
    scale_diff = np.stack([o[0] != scales for o in others])
    code_diff = np.stack([o[1] != codes for o in others])
    return {
        "scale can": scale_diff.any(0).mean(),
        "scale must": scale_diff.all(0).mean(),
        "code can": code_diff.any(0).mean(),
        "code must": code_diff.all(0).mean(),
    }


def data_sets(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    gauss = rng.standard_normal(n).astype(ml_dtypes.bfloat16).astype(F32)
    factor = np.exp(2 * rng.standard_normal(n // 16)).repeat(16)
    heavy = (rng.standard_normal(n) * factor).astype(ml_dtypes.bfloat16).astype(F32)
    return {"N(0,1)": gauss.reshape(-1, 16), "heavy-tailed": heavy.reshape(-1, 16)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=1 << 20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(
        f"host: {platform.machine()}, {os.cpu_count()} cpus; {datetime.date.today()}; "
        f"{args.values} values per data set (bf16), seed {args.seed}"
    )
    print(
        "| data | decode scale | blocks whose scale can / must differ | elements whose code "
        "can / must differ |"
    )
    print("| --- | --- | --- | --- |")
    for name, blocks in data_sets(args.values, args.seed).items():
        amax = np.max(np.abs(blocks))
        for label, s in (("amax / 448", F32(amax) / F32(448)), ("1.0 (vLLM's default)", F32(1))):
            r = measure(blocks, s)
            print(
                f"| {name} | {label} | {100 * r['scale can']:.4f}% / {100 * r['scale must']:.4f}% "
                f"| {100 * r['code can']:.4f}% / {100 * r['code must']:.4f}% |"
            )


if __name__ == "__main__":
    main()
