"""The activation amaxes a W4A4 export needs, recorded from MaxText's NVFP4 forward.

`AmaxRecorder` is the `NVFP4Provider` the launcher trains with, which also records, for
every op it computes in NVFP4, the amax of the activation operand (`max |x|`, what the fprop
GEMM quantizes x with) under the key `<module path>/<parameter name>` of the weight, the
MaxText leaf: `decoder/layers_0/self_attention/query/kernel`; an MoE block's `ragged_dot`s
under `<block path>/ragged_dot<n>`, n = 0, 1, 2 for wi_0, wi_1, wo, the order MaxText's
`RoutedMoE` calls them in (each takes all the tokens routed to the block's experts: the
maximum over the experts, the one input scale per projection engines use). Recording goes
through `jax.debug.callback`, so it works with the model's forward jitted or not; `amaxes`
holds the running maximum over the calls.

Importing this module imports qwix (as `nvfp4_jax.qwix` does).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from qwix._src.utils import flax_util

from nvfp4_jax._src.integrations.qwix import NVFP4Provider


class AmaxRecorder(NVFP4Provider):
    """`NVFP4Provider(rules)` that records each NVFP4 op's activation amax (`amaxes`).

    Args:
      rules: as `NVFP4Provider`'s (the launcher's: `rules_from_config(config, recipe,
        rules=...)`).

    Attributes:
      amaxes: `{MaxText leaf path: f32 amax}`, the maximum over every call since `clear()`.
    """

    def __init__(self, rules: Sequence):
        super().__init__(rules)
        self.amaxes: dict[str, np.float32] = {}
        self._lock = threading.Lock()

    def clear(self) -> None:
        """Forgets what was recorded (qwix's tracing pass on dummy inputs records too)."""
        with self._lock:
            self.amaxes.clear()

    def _observe(self, op: str, *operands) -> None:
        rule = self._nvfp4_rule(op)
        if rule is None or rule.recipe is None:
            return
        found = self._weight_name(*operands)
        if found is None or len(operands) < 2:
            return
        key, index = found
        x = operands[1 - index] if index < 2 else operands[0]
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return
        amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
        jax.debug.callback(lambda value, key=key: self.record(key, value), amax)

    def record(self, key: str, amax) -> None:
        """Takes one observed amax (the callback's target): the running maximum."""
        value = np.float32(np.asarray(amax))
        with self._lock:
            self.amaxes[key] = max(self.amaxes.get(key, np.float32(0)), value)

    def dot_general(self, lhs, rhs, *args, **kwargs):
        self._observe("dot_general", lhs, rhs)
        return super().dot_general(lhs, rhs, *args, **kwargs)

    def einsum(self, einsum_str, *operands, **kwargs):
        if len(operands) == 2:
            self._observe("einsum", *operands)
        return super().einsum(einsum_str, *operands, **kwargs)

    def ragged_dot(self, lhs, rhs, *args, **kwargs):
        out = super().ragged_dot(lhs, rhs, *args, **kwargs)
        rule = self._nvfp4_rule("ragged_dot")
        if rule is not None and rule.recipe is not None:
            # The experts' weights reach ragged_dot inside MaxText's shard_map, where they
            # cannot be told by identity: the op's index in its module names it instead
            # (`RoutedMoE` calls it for wi_0, wi_1, then wo).
            _, op_id = self._get_current_rule_and_op_id("ragged_dot", repeated_call=True)
            path = "/".join(map(str, flax_util.get_current_module_path()))
            amax = jnp.max(jnp.abs(lhs)).astype(jnp.float32)
            key = f"{path}/{op_id}"
            jax.debug.callback(lambda value, key=key: self.record(key, value), amax)
        return out


__all__ = ["AmaxRecorder"]
