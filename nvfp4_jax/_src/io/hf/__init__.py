"""Hugging Face checkpoints in NVIDIA ModelOpt's NVFP4 format: export for engines, import.

The format (the one `nvidia/*-NVFP4` checkpoints use, and vLLM, SGLang and TensorRT-LLM load)
is a Hugging Face model directory: `config.json` (the model's config with a
`quantization_config`), ModelOpt's legacy `hf_quant_config.json`, and the weights in
`model.safetensors` or in HF's sharded layout (`model-0000N-of-0000M.safetensors` with
`model.safetensors.index.json`). A quantized linear `<m>` (HF names, PyTorch's (out, in)
orientation) is stored as

| tensor | dtype | shape | meaning |
| --- | --- | --- | --- |
| `<m>.weight` | U8 | (out, in/2) | E2M1 codes, element 2i in the low nibble |
| `<m>.weight_scale` | F8_E4M3 | (out, in/16) | block scales, row-major (not swizzled) |
| `<m>.weight_scale_2` | F32 | () | the decode scale D (amax / 2688) |
| `<m>.input_scale` | F32 | () | activation amax / 2688; "NVFP4" (W4A4) only |

and decodes as `e2m1[code] * (f32(weight_scale) * weight_scale_2)`. Every other tensor keeps
its HF name and is stored in the model dtype; excluded linears (`lm_head` by default) as a
float `<m>.weight` (out, in).

Flax names differ from HF's (a `NameMap` translates both ways, see `names`). A
mixture-of-experts layer's E experts, one stacked (E, in, out) kernel in Flax, are E linears
`...experts.{e}.<proj>` in the checkpoint (docs/SERVING_FORMATS.md section 5). Flax's (in, out)
kernel quantized along `in` (`quantize(w, axis=0)`) is stored as (out, in): its `codes` and
`scales` are the HF `.weight` and `.weight_scale` bytes, and `q.global_scale` is
`.weight_scale_2`. An imported weight is that array back, carrying the file's
`weight_scale_2` as its `decode_scale`, so it dequantizes exactly as ModelOpt decodes
(docs/NUMERICS.md section 3), the sign of zero aside.

The package, each module importing only the ones listed above it:

* `format`: the format's file names and constants; strict JSON reading, durable writing.
* `names`: `NameRule`, `NameMap`, `llama_name_map`, `qwen3_moe_name_map`,
  `mixtral_name_map` (Flax paths <-> HF tensor names), the default excluded modules.
* `safetensors_files`: safetensors files, read with every header number checked and written
  tensor by tensor (`read_safetensors`).
* `export/`: the stages of an export, one concern each (docs/ARCHITECTURE.md gives their
  order), and `export.main`: `export_hf_checkpoint` (its keywords checked into one
  `ExportOptions`, then the stages) and its `ExportReport`.
* `load/`: the stages of an import, and `load.main`: `load_hf_checkpoint`.

The face `nvfp4_jax.hf` re-exports their public names; this package holds no names of its
own.
"""
