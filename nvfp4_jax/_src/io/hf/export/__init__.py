"""The export of a model as a ModelOpt NVFP4 Hugging Face checkpoint, one stage per module.

`options` (the keywords, checked once into a frozen `ExportOptions`) and `tensors` (the
leaves as HF tensors, an experts stack as E linears) < `plan` (which linears are quantized;
fused groups and MoE blocks whole) < `precision` (the model's own precision and Four Over
Six), `scales`, `kv` (a KV cache's `k_scale` / `v_scale`), `units` (each module's bytes),
`config` (`config.json`, `hf_quant_config.json`), `tokenizer`, `writer` (the shards, the
temporary directory, one writing process) and `report` < `main` (`export_hf_checkpoint`).
This package holds no names of its own.
"""
