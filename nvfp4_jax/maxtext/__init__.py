"""NVFP4 for MaxText users: train, export for serving, import a released model.

Train with `python -m nvfp4_jax.maxtext <MaxText train arguments>`, export for serving with
`python -m nvfp4_jax.maxtext.export`, import a released NVFP4 model to fine-tune with
`python -m nvfp4_jax.maxtext.load`.

The public face of `nvfp4_jax._src.integrations.maxtext` (the launcher and its hook),
`maxtext_export` and `maxtext_load`: it re-exports only (docs/ARCHITECTURE.md). Needs MaxText
(Python >= 3.12) and qwix, imported only when used: `bash scripts/maxtext_env.sh` makes that
environment; docs/guides/maxtext.md shows the commands.
"""

from nvfp4_jax._src.integrations.maxtext import (
    QUANTIZATION,
    check_config,
    install,
    main,
    provider_from_config,
    rules_from_config,
)
from nvfp4_jax._src.integrations.maxtext_export import MaxTextExport, export_checkpoint
from nvfp4_jax._src.integrations.maxtext_load import import_checkpoint, load_params

__all__ = [
    "QUANTIZATION",
    "MaxTextExport",
    "check_config",
    "export_checkpoint",
    "import_checkpoint",
    "install",
    "load_params",
    "main",
    "provider_from_config",
    "rules_from_config",
]
