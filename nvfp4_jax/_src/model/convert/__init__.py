"""Rules and `quantize_model`: which layers of a model get which NVFP4 recipe, applied.

`rules` (`Rule`, matching, `default_rules`) < `report` (`QuantizeReport`) < `nnx`
(`quantize_model`: an nnx model's layers converted in place) and `linen`
(`quantize_linen`, `quantized`: a linen model's layer calls intercepted). This package
holds no names of its own.
"""
