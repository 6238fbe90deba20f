"""A MaxText checkpoint trained in NVFP4 as a ModelOpt NVFP4 Hugging Face checkpoint.

`python -m nvfp4_jax.maxtext.export <MaxText config and overrides> load_parameters_path=...
--out DIR`: for vLLM, SGLang and TensorRT-LLM.

The public face of `nvfp4_jax._src.integrations.maxtext_export` (re-exports only);
docs/guides/maxtext.md shows the command.
"""

from nvfp4_jax._src.integrations.maxtext_export import MaxTextExport, export_checkpoint, main

__all__ = ["MaxTextExport", "export_checkpoint", "main"]

if __name__ == "__main__":
    main()
