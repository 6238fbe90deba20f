"""Post-training quantization: an nnx model's linear layers frozen to NVFP4, ready to export.

`quantize_for_export(model, batches, method=...)` takes a model trained in high precision
(plain `nnx.Linear` layers, or `nvfp4_jax.nnx.Linear` ones of a quantization-aware run), runs
the calibration batches through a copy of it, and returns a new model in which every linear
the rules select is an `nvfp4_jax.nnx.Linear.from_quantized` layer holding an `NVFP4Array`
kernel (weight-only, "W4A16", or with a static activation scale, "W4A4"), together with a
`PTQReport`. The new model computes what an engine serving its export computes, and
`export_hf_checkpoint(directory, nnx.state(frozen), config=...)` writes it as it is (the
NVFP4 kernels pass through unchanged, with their scales).

Every method writes plain NVFP4 (docs/NUMERICS.md sections 2-4): packed E2M1 codes, E4M3
block scales (1x16 along `in`, or 16x16 tiles) and one f32 global amax `A` per tensor, with
the decode factor `D` engines read as `weight_scale_2`. They differ in how they choose them:

* "max": round to nearest with `A = max |W|` (of the fused group): what the exporter writes
  for the float model, bit for bit.
* "mse": searches `A = c * max |W|` over a grid of c (values above `A` saturate) for the
  least squared weight error.
* "four_over_six": Four Over Six (section 13): each block keeps the better of its amax
  mapped to 6 or to 4.
* "gptq": GPTQ (Frantar et al. 2022): rounds the input channels in order, pushing each
  channel's error onto the later ones through the inverse Hessian `H = X^T X` of the
  layer's calibration inputs.

Fused groups (q/k/v, gate/up: siblings engines fuse into one layer) share one global amax,
hence one decode scale, as engines need. A fused group is quantized whole or kept whole in
high precision.

The modules, each importing only those before it: `settings` (the checked arguments) <
`report`, `calibration` (`X^T X` of the inputs), `methods` (the scale search) < `select`
(which layers) < `freeze` (`quantize_for_export`). The face `nvfp4_jax.ptq` re-exports their
public names; this package holds no names of its own.
"""
