"""The native kernels: loading, one `ffi_call` per XLA FFI target, each with its sharding rule.

Every function takes the *stored layout* (the quantized axis last, C a multiple of 16) and
arguments the public ops (`nvfp4_jax.ops`) have already checked; each raises a ValueError
saying why when the native library cannot run on the current platform. One module per
target: `_amax`, `_quantize` (quantize and fake quantize, each taking the `QuantSpec` whole),
`_dequantize`, `_rht`, `_gemm` (the NVFP4 GEMM and the weight-only GEMM, CPU only),
`_grouped` (ragged_dot's grouped quantize, CPU only), `_threefry` (the hash of the SR keys,
CPU only), `_kv_cache` (the NVFP4 KV cache's write, read and attention, CPU only). Which of them
runs where is `backends.runs_natively`'s question, asked nowhere else. The face
`nvfp4_jax.kernels` re-exports their public names; this package holds no names of its own.
"""
