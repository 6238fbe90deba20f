"""quantize_master_weights on 8 CPU devices, bit for bit against unsharded `quantize`.

Run as a script (by tests/test_interop.py): the flag below must be set before JAX starts.
Prints one line per check, `PASS name` or `FAIL name: why`; exits 1 if any failed.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from nvfp4_jax import quantize  # noqa: E402
from nvfp4_jax.interop import quantize_master_weights  # noqa: E402

# (name, weight spec, quantized axis, block_2d, mesh shape)
CASES = {
    "rows_1d": (PartitionSpec("x", None), -1, False, (8,)),
    "cols_1d": (PartitionSpec(None, "x"), -1, False, (8,)),
    "rows_2d_blocks": (PartitionSpec("x", None), -1, True, (8,)),
    "cols_2d_blocks_axis0": (PartitionSpec(None, "x"), 0, True, (8,)),
    "both_axes_2d_blocks": (PartitionSpec("x", "y"), -1, True, (4, 2)),
    # NaN on one device: the stored amax is NaN on every device, as unsharded (NUMERICS 8).
    "nan_on_one_shard": (PartitionSpec("x", None), -1, False, (8,)),
}


def weight(name):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 512)) * rng.lognormal(0, 1.5, (256, 1))
    w[3, 7] = 900.0  # the global amax lives on one device only
    if name == "nan_on_one_shard":
        w[200, 5] = np.nan
    return jnp.asarray(w, jnp.float32)


def run(name):
    spec, axis, block_2d, mesh_shape = CASES[name]
    names = ("x", "y")[: len(mesh_shape)]
    mesh = jax.make_mesh(mesh_shape, names)
    w = weight(name)
    sharded = jax.device_put(w, NamedSharding(mesh, spec))
    q = jax.jit(
        lambda a: quantize_master_weights(a, axis=axis, block_2d=block_2d, mesh=mesh, spec=spec)
    )(sharded)
    expected = quantize(w, axis=axis, block_2d=block_2d)
    if np.isnan(expected.amax):
        # Codes and scales are unspecified for NaN input (NUMERICS 8); the amax must say NaN.
        return None if np.isnan(q.amax) else f"amax {q.amax}, unsharded NaN"
    for part in ("codes", "scales", "amax"):
        got, want = np.asarray(getattr(q, part)), np.asarray(getattr(expected, part))
        if got.shape != want.shape or not np.array_equal(
            got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)
        ):
            return f"{part} differs from the unsharded quantize"
    if q.axis != expected.axis or q.block_2d != expected.block_2d:
        return "metadata differs"
    for part in ("codes", "scales"):
        leaf = getattr(q, part)
        if len(leaf.sharding.device_set) != 8 or leaf.addressable_shards[0].data.size == leaf.size:
            return f"{part} is not sharded over 8 devices: {leaf.sharding}"
    return None


def main(names):
    failed = False
    assert jax.device_count() == 8, jax.devices()
    for name in names:
        if name not in CASES:
            print(f"FAIL {name}: unknown check")
            failed = True
            continue
        try:
            error = run(name)
        except Exception as exc:  # noqa: BLE001  (report and go on)
            error = f"{type(exc).__name__}: {exc}"
        print(f"PASS {name}" if error is None else f"FAIL {name}: {error}", flush=True)
        failed |= error is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(CASES)))
