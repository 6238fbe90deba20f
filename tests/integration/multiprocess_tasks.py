"""The programs `tests/integration/test_multiprocess.py` runs in two JAX processes and in one.

Each task takes a working directory and returns `{name: NumPy array}` of global values. It
is written for the global device set, whatever the processes: in the test's two processes
(4 CPU devices each, `multiprocess_child.py`) and in the pytest process (8 CPU devices) the
same code runs on a mesh of 8 devices, so the parent compares the two results directly.
Global inputs are built from the same host data in every process
(`jax.make_array_from_callback`: each process fills only its own devices' shards) and global
results are gathered with `multihost_utils.process_allgather`.

The native kernels run every case. The reference runs the hardest cases of each task (SR
with the RHT, a 3D tensor sharded along its middle axis, 2D blocks; the FSDP step under
Explicit axes): its multi-process behaviour is XLA's partitioning of the same jnp code in
every case, and tests/core shows it quantizes to the native bits. In a run with
`--reference-sweep` (tests/conftest.py sets `NVFP4_REFERENCE_SWEEP=1`, which the processes
the test starts inherit) the reference runs every case too.
"""

from __future__ import annotations

import contextlib
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import nvfp4_jax

AXIS = "x"
IMPLEMENTATIONS = ("reference", "ffi")
# The reference's cases outside the sweep (see the module's docstring).
REFERENCE_QUANTIZE_CASES = (
    "rows_sharded_rht_sr_bf16",
    "middle_axis_sharded_3d_sr",
    "rows_sharded_2d_sr",
)
REFERENCE_TRAIN_CASES = (("explicit", "fsdp"),)


def reference_runs(case) -> bool:
    """Whether the reference runs this case: a kept one, or any in the reference sweep."""
    kept = case in REFERENCE_QUANTIZE_CASES + REFERENCE_TRAIN_CASES
    return kept or os.environ.get("NVFP4_REFERENCE_SWEEP") == "1"


def mesh(axis_type: AxisType = AxisType.Auto) -> jax.sharding.Mesh:
    return jax.make_mesh(
        (jax.device_count(),), (AXIS,), axis_types=(axis_type,), devices=jax.devices()
    )


# How the train task uses its mesh: Auto axes (shardings on the arrays only), or Explicit
# axes under `jax.set_mesh` (the shardings in the types).
MESH_MODES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def put(value, spec: P, axis_type: AxisType = AxisType.Auto) -> jax.Array:
    """A global array holding the host value `value`, sharded by `spec` over `mesh()`."""
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        data = put(np.asarray(jax.random.key_data(value)), spec, axis_type)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(value))
    host = np.asarray(value)
    sharding = NamedSharding(mesh(axis_type), spec)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def gather(value) -> np.ndarray:
    """The whole global array on the host of every process (ml_dtypes' floats as their bits,
    which `np.savez` keeps)."""
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        value = jax.random.key_data(value)
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        value = multihost_utils.process_allgather(value, tiled=True)
    value = np.asarray(value)
    if value.dtype.kind == "V":  # bfloat16, float8_*: not NumPy's own
        value = value.view(f"uint{8 * value.dtype.itemsize}")
    return value


def gather_q(prefix: str, q) -> dict[str, np.ndarray]:
    return {f"{prefix}/{part}": gather(getattr(q, part)) for part in ("codes", "scales", "amax")}


# --- sharded quantization ----------------------------------------------------------------------


def _sharded_quantize_cases():
    from training.distributed_setup import JIT_CASES, data  # noqa: PLC0415

    return JIT_CASES, data


def quantize_task(workdir: str) -> dict[str, np.ndarray]:
    """test_distributed.py's JIT_CASES (in distributed_setup.py) on each implementation (the
    reference: see `reference_runs`)."""
    cases, data = _sharded_quantize_cases()
    out = {}
    for implementation in IMPLEMENTATIONS:
        for case, (shape, spec, kw) in cases.items():
            if implementation == "reference" and not reference_runs(case):
                continue
            x = np.asarray(data(shape))
            if case.endswith("bf16"):
                x = x.astype(jnp.bfloat16)

            def run(x, key, kw=kw, implementation=implementation):
                return nvfp4_jax.quantize(x, key=key, implementation=implementation, **kw)

            q = jax.jit(run)(put(x, spec), put(jax.random.key(3), P()))
            out.update(gather_q(f"{implementation}/{case}", q))
    return out


# --- data-parallel and FSDP train steps -------------------------------------------------------


def train_task(workdir: str) -> dict[str, np.ndarray]:
    """test_distributed_training.py's NVFP4 MLP step (in distributed_setup.py), data-parallel
    and FSDP, under Auto and Explicit axes, on each implementation (the reference: see
    `reference_runs`)."""
    from training.distributed_setup import TRAIN_SPECS, mlp_loss, train_setup  # noqa: PLC0415

    out = {}
    for implementation, (mode, axis_type) in itertools.product(IMPLEMENTATIONS, MESH_MODES.items()):
        recipe = nvfp4_jax.NVFP4Recipe(implementation=implementation)
        step = jax.jit(jax.value_and_grad(mlp_loss), static_argnums=4)
        for layout, specs in TRAIN_SPECS.items():
            if implementation == "reference" and not reference_runs((mode, layout)):
                continue
            params, x, y, key = train_setup()
            params = {name: put(value, specs[name], axis_type) for name, value in params.items()}
            batch = P(AXIS, None)
            args = (put(x, batch, axis_type), put(y, batch, axis_type), put(key, P(), axis_type))
            with jax.set_mesh(mesh(axis_type)) if mode == "explicit" else contextlib.nullcontext():
                loss, grads = step(params, *args, recipe)
            name = f"{implementation}/{mode}/{layout}"
            out[f"{name}/loss"] = gather(loss)
            out.update({f"{name}/{k}": gather(v) for k, v in grads.items()})
    return out


# --- load_hf_checkpoint with a sharding: each process reads only its slices -------------------

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELOPT_FIXTURE = os.path.join(TESTS, "fixtures", "modelopt_llama_nvfp4")


def hf_load_task(workdir: str) -> dict[str, np.ndarray]:
    """The ModelOpt fixture loaded with one sharding over all devices: its leaves, and the
    bytes of distinct tensor slices each process read from the files."""
    from nvfp4_jax._src.io.hf import safetensors_files  # noqa: PLC0415

    slices: dict[tuple, int] = {}
    original = safetensors_files.SafetensorsFile.read

    def read(self, name, index=None):
        array = original(self, name, index)
        slices[(self.path, name, repr(index))] = array.nbytes
        return array

    safetensors_files.SafetensorsFile.read = read
    try:
        sharding = NamedSharding(mesh(), P(None, AXIS))
        tree = nvfp4_jax.load_hf_checkpoint(MODELOPT_FIXTURE, sharding=sharding)
    finally:
        safetensors_files.SafetensorsFile.read = original
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    out = {jax.tree_util.keystr(path): gather(value) for path, value in flat}
    read_bytes = np.array([sum(slices.values())], np.int64)
    out["bytes read by each process"] = np.asarray(
        multihost_utils.process_allgather(read_bytes)
    ).reshape(-1)
    return out


# --- export_hf_checkpoint of a sharded model: written once -------------------------------------


def hf_export_task(workdir: str) -> dict[str, np.ndarray]:
    """The fixture loaded sharded, layer 1's MLP turned into float kernels (so the exporter
    quantizes those, the rest it writes as loaded), exported: every file's bytes."""
    import json  # noqa: PLC0415

    sharding = NamedSharding(mesh(), P(None, AXIS))
    tree = nvfp4_jax.load_hf_checkpoint(MODELOPT_FIXTURE, sharding=sharding)
    mlp = tree["layers"][1]["mlp"]
    for name in ("gate_proj", "up_proj", "down_proj"):
        mlp[name]["kernel"] = jax.jit(nvfp4_jax.dequantize)(mlp[name]["kernel"])
    with open(os.path.join(MODELOPT_FIXTURE, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    directory = os.path.join(workdir, "export")
    report = nvfp4_jax.export_hf_checkpoint(directory, tree, config=config)
    assert "model.layers.1.mlp.down_proj" in report.quantized
    try:  # process 0 alone looks at the folder: every process raises what it found
        nvfp4_jax.export_hf_checkpoint(directory, tree, config=config)
    except FileExistsError as error:
        assert "holds weights" in str(error), error
    else:
        raise AssertionError("an export over weights without force=True did not raise")
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = np.frombuffer(f.read(), np.uint8)
    return out


TASKS = {
    "quantize": quantize_task,
    "train": train_task,
    "hf_load": hf_load_task,
    "hf_export": hf_export_task,
}
