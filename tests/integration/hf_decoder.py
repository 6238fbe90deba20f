"""A plain JAX decoder of a Hugging Face config and the tree `nvfp4_jax.load_hf_checkpoint`
returns: Llama (the default and "llama3" rotary embeddings), Mistral, Mixtral, Qwen3 and
Qwen3-MoE, as transformers computes them. The tests compare it with MaxText's forward on the
weights of an export (`test_maxtext_export.py`) and with vLLM.

`logits(config, tree, tokens)` runs in f32 with every NVFP4 weight dequantized (weight-only);
`activations="nvfp4"` quantizes the dense linears' inputs with their checkpoint's static input
scales, as engines run W4A4 (`nvfp4_jax.nnx.Linear.from_quantized`). Shape letters: T tokens,
D hidden size, H query heads, G key/value heads, E head size, X experts.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

import nvfp4_jax


def _weight(node: dict) -> jax.Array:
    """A linear's (in, out) kernel in f32, dequantized if NVFP4."""
    kernel = node["kernel"]
    if nvfp4_jax.is_nvfp4_array(kernel):
        return nvfp4_jax.dequantize(kernel, jnp.float32)
    return jnp.asarray(kernel, jnp.float32)


def _linear(node: dict, x: jax.Array, activations: str, dtype) -> jax.Array:
    kernel = node["kernel"]
    if activations == "nvfp4" and nvfp4_jax.is_nvfp4_array(kernel):
        layer = nvfp4_jax.nnx.Linear.from_quantized(
            kernel, input_scale=node.get("input_scale"), activations="nvfp4", dtype=dtype
        )
        return layer(x.astype(dtype)).astype(jnp.float32)
    return x @ _weight(node)


def _rms_norm(x: jax.Array, scale, eps: float) -> jax.Array:
    variance = jnp.mean(x * x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(variance + eps) * jnp.asarray(scale, jnp.float32)


def _inv_freq(config: dict, e: int) -> np.ndarray:
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    inv = 1.0 / theta ** (np.arange(0, e, 2, dtype=np.float64) / e)
    if rope.get("rope_type", rope.get("type")) == "llama3":  # Meta's frequency scaling
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        middle = (wavelen <= old / low) & (wavelen >= old / high)
        inv = np.where(middle, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.astype(np.float32)


def _rotary(x: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """HF's rotary embedding of (T, heads, E): the halves rotated."""
    t, e = x.shape[0], x.shape[-1]
    angles = np.arange(t, dtype=np.float32)[:, None] * inv_freq[None, :]
    cos = jnp.asarray(np.concatenate([np.cos(angles)] * 2, -1))[:, None, :]
    sin = jnp.asarray(np.concatenate([np.sin(angles)] * 2, -1))[:, None, :]
    rotated = jnp.concatenate([-x[..., e // 2 :], x[..., : e // 2]], axis=-1)
    return x * cos + rotated * sin


def _attention(config, node, x, activations, dtype) -> jax.Array:
    h, g = config["num_attention_heads"], config["num_key_value_heads"]
    e = config.get("head_dim") or config["hidden_size"] // h
    t = x.shape[0]
    q = _linear(node["q_proj"], x, activations, dtype).reshape(t, h, e)
    k = _linear(node["k_proj"], x, activations, dtype).reshape(t, g, e)
    v = _linear(node["v_proj"], x, activations, dtype).reshape(t, g, e)
    if "q_norm" in node:  # Qwen3: each head normalized before the rotary embedding
        q = _rms_norm(q, node["q_norm"]["scale"], config["rms_norm_eps"])
        k = _rms_norm(k, node["k_norm"]["scale"], config["rms_norm_eps"])
    inv = _inv_freq(config, e)
    q, k = _rotary(q, inv), _rotary(k, inv)
    k, v = jnp.repeat(k, h // g, axis=1), jnp.repeat(v, h // g, axis=1)
    scores = jnp.einsum("thd,shd->hts", q, k) / math.sqrt(e)
    scores = jnp.where(np.tril(np.ones((t, t), bool))[None], scores, -jnp.inf)
    out = jnp.einsum("hts,shd->thd", jax.nn.softmax(scores, axis=-1), v).reshape(t, h * e)
    return _linear(node["o_proj"], out, activations, dtype)


def _mlp(node, x, activations, dtype) -> jax.Array:
    gate = _linear(node["gate_proj"], x, activations, dtype)
    up = _linear(node["up_proj"], x, activations, dtype)
    return _linear(node["down_proj"], jax.nn.silu(gate) * up, activations, dtype)


def _moe(config, node, x) -> jax.Array:
    """Softmax over all experts, top-k; Mixtral and `norm_topk_prob` renormalize the k."""
    k = config["num_experts_per_tok"]
    probs = jax.nn.softmax(x @ _weight(node["gate"]), axis=-1)
    top, chosen = jax.lax.top_k(probs, k)
    if config.get("model_type") == "mixtral" or config.get("norm_topk_prob", False):
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    experts = node["experts"]
    gate, up, down = (_weight(experts[p]) for p in ("gate_proj", "up_proj", "down_proj"))
    hidden = jax.nn.silu(jnp.einsum("td,xdf->txf", x, gate)) * jnp.einsum("td,xdf->txf", x, up)
    out = jnp.einsum("txf,xfd->txd", hidden, down)  # every expert on every token
    picked = jnp.take_along_axis(out, chosen[..., None], axis=1)
    return jnp.sum(picked * top[..., None], axis=1)


def logits(
    config: dict, tree: dict, tokens, *, activations: str = "high_precision", dtype=jnp.bfloat16
) -> np.ndarray:
    """f32 logits (T, V) of one sequence of token ids (T,)."""
    eps = config["rms_norm_eps"]
    x = jnp.asarray(tree["embed_tokens"]["embedding"], jnp.float32)[jnp.asarray(tokens)]
    for i in range(config["num_hidden_layers"]):
        layer = tree["layers"][i]
        x = x + _attention(
            config,
            layer["self_attn"],
            _rms_norm(x, layer["input_layernorm"]["scale"], eps),
            activations,
            dtype,
        )
        y = _rms_norm(x, layer["post_attention_layernorm"]["scale"], eps)
        mlp = layer["mlp"]
        x = x + (_moe(config, mlp, y) if "experts" in mlp else _mlp(mlp, y, activations, dtype))
    x = _rms_norm(x, tree["norm"]["scale"], eps)
    if config.get("tie_word_embeddings"):
        return np.asarray(x @ jnp.asarray(tree["embed_tokens"]["embedding"], jnp.float32).T)
    return np.asarray(_linear(tree["lm_head"], x, "high_precision", dtype))
