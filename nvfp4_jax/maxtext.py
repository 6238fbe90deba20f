"""NVFP4 training for MaxText users: `python -m nvfp4_jax.maxtext <MaxText train arguments>`.

The public face of `nvfp4_jax._src.integrations.maxtext`: it re-exports only
(docs/ARCHITECTURE.md), and runs the launcher as `python -m nvfp4_jax.maxtext`. Needs MaxText
(Python >= 3.12) and qwix, imported only when used: `bash scripts/maxtext_env.sh` makes that
environment; docs/guides/maxtext.md shows the one line.
"""

from nvfp4_jax._src.integrations.maxtext import (
    QUANTIZATION,
    check_config,
    install,
    main,
    provider_from_config,
    rules_from_config,
)

__all__ = [
    "QUANTIZATION",
    "check_config",
    "install",
    "main",
    "provider_from_config",
    "rules_from_config",
]

if __name__ == "__main__":
    main()
