"""Where NVFP4 hurts a model: per-layer quantization errors of the three GEMMs' operands.

`inspect_model(model, *inputs)` runs one forward and backward pass of an nnx model,
captures, for every linear layer that computes (or, under `rules`, would compute) in NVFP4,
the operands of its three GEMMs (x, W, dy), and quantizes each exactly as the layer's
`NVFP4Recipe` does:

| operand    | GEMM  | quantized                                                  |
| `x`        | fprop | 1x16 blocks along K                                        |
| `w`        | fprop | 16x16 tiles (`weight_2d`), else 1x16 along K               |
| `dy`       | dgrad | 1x16 along N, stochastic rounding (SR) if the recipe has it |
| `x_wgrad`  | wgrad | 1x16 along the tokens M, with the RHT (`wgrad_rht`)        |
| `dy_wgrad` | wgrad | 1x16 along the tokens M, with the RHT, SR                  |

Per operand it reports the relative error `||dequantize(q) - x|| / ||x||`, the share of
underflowing 16-blocks, the share of saturated values and the tensor amax; per layer the
relative errors of the NVFP4 fprop and dgrad products and the angle between the NVFP4 weight
gradient and the exact one `x^T dy`, each with and without stochastic rounding. The report
prints as a `rich` table, plots with matplotlib, serializes to JSON, and suggests `Rule`s
that keep the worst layers in high precision (ranked by the weight-gradient angle, or by
the summed relative error of the operands: `ModelReport.scores`).

The modules, each importing only those before it: `numbers` (one layer's numbers,
`analyze_layer`, and the definitions) < `capture` (the operands of a model's layers),
`report` (`ModelReport`) < `inspection` (`inspect_model`). The face `nvfp4_jax.diagnostics`
re-exports their public names; this package holds no names of its own.
"""
