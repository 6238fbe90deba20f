"""NVFP4 training for qwix users: `qwix.quantize_model(model, NVFP4Provider(rules), *inputs)`.

The public face of `nvfp4_jax._src.integrations.qwix`: it re-exports only
(docs/ARCHITECTURE.md). Needs the optional `qwix` package (`pip install 'nvfp4_jax[qwix]'`);
docs/guides/qwix.md shows the one-line switch.
"""

from nvfp4_jax._src.integrations.qwix import NVFP4Provider, NVFP4Rule, search_pattern

__all__ = ["NVFP4Provider", "NVFP4Rule", "search_pattern"]
