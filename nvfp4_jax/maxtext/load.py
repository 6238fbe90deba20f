"""A released (ModelOpt NVFP4) Hugging Face checkpoint as MaxText's parameter checkpoint.

`python -m nvfp4_jax.maxtext.load HF_DIR <MaxText config and overrides> --out DIR`, to
fine-tune with `python -m nvfp4_jax.maxtext ... load_parameters_path=DIR/items`.

The public face of `nvfp4_jax._src.integrations.maxtext_load` (re-exports only);
docs/guides/maxtext.md shows the commands.
"""

from nvfp4_jax._src.integrations.maxtext_load import (
    import_checkpoint,
    load_params,
    main,
    save_params,
)

__all__ = ["import_checkpoint", "load_params", "main", "save_params"]

if __name__ == "__main__":
    main()
