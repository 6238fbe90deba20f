"""A function using the native kernels, serialized with `jax.export`, runs in a fresh process.

The fresh process only imports nvfp4_jax (which registers the FFI targets) before it
deserializes and calls the function: no op has to run first.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import assert_same_bits, make_impl

EXPORT = """
import jax, jax.numpy as jnp, numpy as np, nvfp4_jax

def f(x, key):
    q = nvfp4_jax.quantize(x, rht=True, stochastic_rounding=True, key=key, implementation="ffi")
    values = nvfp4_jax.fake_quantize(x, block_2d=True, implementation="ffi")
    return nvfp4_jax.dequantize(q, implementation="ffi"), values, nvfp4_jax.apply_rht(x)

x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 128)), jnp.bfloat16)
key = jax.random.key_data(jax.random.key(1))
fn = jax.jit(lambda x, k: f(x, jax.random.wrap_key_data(k)))
exported = jax.export.export(fn, disabled_checks=nvfp4_jax.kernels.export_safety_checks())(x, key)
open({path!r} + "/f.bin", "wb").write(exported.serialize())
np.save({path!r} + "/x.npy", np.asarray(x.astype(jnp.float32)))
np.save({path!r} + "/key.npy", np.asarray(key))
for i, y in enumerate(fn(x, key)):
    np.save({path!r} + f"/y{{i}}.npy", np.asarray(y.astype(jnp.float32)))
"""

RUN = """
import jax, jax.numpy as jnp, numpy as np
import nvfp4_jax  # registers the targets; nothing else runs before the call

exported = jax.export.deserialize(bytearray(open({path!r} + "/f.bin", "rb").read()))
x = jnp.asarray(np.load({path!r} + "/x.npy"), jnp.bfloat16)
for i, y in enumerate(exported.call(x, np.load({path!r} + "/key.npy"))):
    np.save({path!r} + f"/z{{i}}.npy", np.asarray(y.astype(jnp.float32)))
"""


def run_python(source: str):
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.slow
def test_exported_function_runs_in_a_fresh_process(tmp_path):
    make_impl("cpu")
    pytest.importorskip("flatbuffers")  # what jax.export's serialization needs
    run_python(EXPORT.format(path=str(tmp_path)))
    run_python(RUN.format(path=str(tmp_path)))
    for i in range(3):
        assert_same_bits(np.load(tmp_path / f"z{i}.npy"), np.load(tmp_path / f"y{i}.npy"), f"{i}")
