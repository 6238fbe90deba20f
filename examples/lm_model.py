"""A small decoder-only transformer language model in Flax nnx whose dense layers can be NVFP4.

Shape letters: B batch, T sequence length, D model width, H heads, V vocabulary (256 bytes).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import nvfp4_jax


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMConfig:
    """The model's shape and which of its blocks compute in NVFP4."""

    # Vocabulary: bytes.
    vocab: int = 256
    # Model width D; a multiple of 16 (NVFP4 blocks) and of `heads`.
    width: int = 128
    # Number of transformer blocks.
    depth: int = 4
    # Attention heads.
    heads: int = 4
    # Longest sequence the position embedding covers.
    max_len: int = 128
    # None: every dense layer in bf16; else the NVFP4 recipe of the quantized layers.
    recipe: nvfp4_jax.NVFP4Recipe | None = None
    # Blocks kept in bf16 at the start and end of the stack (the NVFP4 paper keeps a few
    # final blocks in bf16); the output head counts as part of the last block.
    bf16_first: int = 0
    bf16_last: int = 0

    def __post_init__(self):
        if self.width % 16 or self.width % self.heads:
            raise ValueError(
                f"width must be a multiple of 16 and of heads={self.heads}, got {self.width}"
            )
        for name in ("depth", "heads", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.bf16_first < 0 or self.bf16_last < 0:
            raise ValueError(
                f"bf16_first/bf16_last must be >= 0, got {self.bf16_first}, {self.bf16_last}"
            )

    def block_is_nvfp4(self, index: int) -> bool:
        """Whether block `index` (0..depth-1; depth is the output head) runs in NVFP4."""
        if self.recipe is None:
            return False
        return self.bf16_first <= index < self.depth + 1 - self.bf16_last


def dense(cfg: LMConfig, block: int, d_in: int, d_out: int, rngs: nnx.Rngs) -> nnx.Module:
    """A bf16-compute dense layer: NVFP4 if block `block` is quantized, else plain nnx."""
    if cfg.block_is_nvfp4(block):
        return nvfp4_jax.nnx.Linear(
            d_in, d_out, recipe=cfg.recipe, dtype=jnp.bfloat16, use_bias=False, rngs=rngs
        )
    return nnx.Linear(d_in, d_out, dtype=jnp.bfloat16, use_bias=False, rngs=rngs)


class Block(nnx.Module):
    """Pre-norm causal self-attention and a GELU MLP, each with a residual connection."""

    def __init__(self, cfg: LMConfig, index: int, rngs: nnx.Rngs):
        d = cfg.width
        self.heads = cfg.heads
        self.norm_attn = nnx.RMSNorm(d, rngs=rngs)
        self.qkv = dense(cfg, index, d, 3 * d, rngs)
        self.proj = dense(cfg, index, d, d, rngs)
        self.norm_mlp = nnx.RMSNorm(d, rngs=rngs)
        self.up = dense(cfg, index, d, 4 * d, rngs)
        self.down = dense(cfg, index, 4 * d, d, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """(B, T, D) -> (B, T, D)."""
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.norm_attn(x)), 3, axis=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads) for z in (q, k, v))
        attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.reshape(b, t, d)).astype(x.dtype)
        hidden = jax.nn.gelu(self.up(self.norm_mlp(x)))
        return x + self.down(hidden).astype(x.dtype)


class TransformerLM(nnx.Module):
    """Byte-level decoder-only transformer: tokens (B, T) -> logits (B, T, V)."""

    def __init__(self, cfg: LMConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.width, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.max_len, cfg.width)))
        self.blocks = nnx.List([Block(cfg, i, rngs) for i in range(cfg.depth)])
        self.norm = nnx.RMSNorm(cfg.width, rngs=rngs)
        self.head = dense(cfg, cfg.depth, cfg.width, cfg.vocab, rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Returns f32 logits for every position."""
        t = tokens.shape[1]
        if t > self.cfg.max_len:
            raise ValueError(f"sequence length {t} exceeds max_len={self.cfg.max_len}")
        x = self.embed(tokens) + self.pos[...][:t]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).astype(jnp.float32)


def loss_fn(model: TransformerLM, batch: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy (nats) of a (B, T + 1) batch of bytes."""
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
