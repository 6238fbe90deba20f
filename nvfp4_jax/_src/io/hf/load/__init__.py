"""The import of a ModelOpt NVFP4 Hugging Face checkpoint, one stage per module.

`config` (the quantization config) < `files` (the files, each linear's tensors checked) <
`place` (placing the arrays) < `experts` (MoE stacks) < `main` (`load_hf_checkpoint`). This
package holds no names of its own.
"""
