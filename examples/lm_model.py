"""A small Llama in Flax nnx whose linear layers can be NVFP4, dense or mixture-of-experts.

The architecture and the module names are Hugging Face's `LlamaForCausalLM` (RMSNorm, rotary
position embeddings, SwiGLU MLP, grouped-query attention; Llama's optional attention and MLP
biases and tied embeddings), so a trained model exports with `nvfp4_jax.export_hf_checkpoint`
and `nvfp4_jax.hf.llama_name_map()` as a checkpoint vLLM serves, and a Hugging Face / ModelOpt
Llama checkpoint loads into it. `LMConfig.from_hf_config` reads a Llama or Mixtral
`config.json` and refuses (ValueError naming the key) any setting the model does not compute
(rope scaling, sliding windows, another activation, another architecture's keys): a model
that computes something else than its checkpoint's would decode wrong without a sign.

With `experts > 0` every MLP is a Mixtral-style dropless mixture of experts (`MoE`): a
high-precision router `mlp/gate` (D, X) picks the top-k of X SwiGLU experts per token, whose
(X, in, out) kernels `mlp/experts/{gate,up,down}_proj` are `nvfp4_jax.nnx.Experts` (each
expert's GEMMs in NVFP4 with its own tensor amaxes, or in high precision). The layout is
Mixtral's and Qwen3-MoE's, `hf_config()` a `MixtralForCausalLM` config.

Shape letters: B batch, T sequence length, D hidden size, H query heads, G key/value heads,
E head size (D / H), F MLP size, V vocabulary; MoE: X experts, K experts per token, F_x the
size of one expert's MLP, N = B * T tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import nvfp4_jax


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMConfig:
    """The model's shape and which of its blocks compute in NVFP4."""

    # Vocabulary: bytes, by default.
    vocab: int = 256
    # Hidden size D; a multiple of 16 (NVFP4 blocks) and of `heads`.
    width: int = 128
    # Number of decoder layers.
    depth: int = 4
    # Query heads H.
    heads: int = 4
    # Key/value heads G (grouped-query attention); divides `heads`. None: heads // 2 when
    # heads is even, else heads.
    kv_heads: int | None = None
    # MLP size F; None: 8/3 * D rounded up to a multiple of 32 (SwiGLU's usual size).
    intermediate: int | None = None
    # Longest sequence (rotary embeddings need no table, this is for the HF config).
    max_len: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    # None: every linear layer in bf16; else every one in NVFP4 with this recipe (to keep some
    # in bf16, build the model in bf16 and quantize it by rules: nvfp4_jax.quantize_model).
    # The MoE router is in f32 either way.
    recipe: nvfp4_jax.NVFP4Recipe | None = None
    # Mixture of experts: X experts per MLP (0: dense MLPs), K of them per token.
    experts: int = 0
    top_k: int = 2
    # F_x, one expert's MLP size; None: F / K rounded up to a multiple of 16, so that a
    # token's K experts cost what the dense MLP does (the same active FLOPs per token).
    expert_intermediate: int | None = None
    # The weight of the load-balancing loss (Switch Transformer's, 0.01 there) in training.
    router_aux_loss_coef: float = 0.01
    # Hugging Face Llama's biases: on q/k/v/o_proj, and on gate/up/down_proj (dense MLPs).
    attention_bias: bool = False
    mlp_bias: bool = False
    # The output head is the embedding table, transposed (no lm_head of its own).
    tie_word_embeddings: bool = False

    def __post_init__(self):
        for name in ("depth", "heads", "max_len", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.width % 16 or self.width % self.heads:
            raise ValueError(
                f"width must be a multiple of 16 and of heads={self.heads}, got {self.width}"
            )
        if self.kv_heads is None:
            object.__setattr__(
                self, "kv_heads", self.heads // 2 if self.heads % 2 == 0 else self.heads
            )
        if self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ValueError(f"kv_heads={self.kv_heads} must divide heads={self.heads}")
        if self.intermediate is None:
            object.__setattr__(self, "intermediate", _round_up(8 * self.width // 3, 32))
        if self.intermediate % 16 or self.head_dim * self.kv_heads % 16:
            raise ValueError(
                f"the MLP size {self.intermediate} and the key/value width "
                f"{self.head_dim * self.kv_heads} must be multiples of 16 (NVFP4 blocks)"
            )
        self._check_experts()

    def _check_experts(self):
        """Checks the mixture-of-experts fields; derives `expert_intermediate` when None."""
        if self.experts < 0:
            raise ValueError(f"experts must be >= 0 (0: dense MLPs), got {self.experts}")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k={self.top_k} must be from 1 to experts={self.experts}")
        if self.expert_intermediate is None:
            size = _round_up(-(-self.intermediate // self.top_k), 16) if self.experts else 0
            object.__setattr__(self, "expert_intermediate", size)
        if self.experts and (self.expert_intermediate < 16 or self.expert_intermediate % 16):
            raise ValueError(
                f"the expert MLP size {self.expert_intermediate} must be a positive multiple "
                "of 16 (NVFP4 blocks)"
            )
        if not self.router_aux_loss_coef >= 0:
            raise ValueError(f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")
        if self.experts and self.mlp_bias:
            raise ValueError("mlp_bias is for dense MLPs: the experts have no biases")

    @property
    def head_dim(self) -> int:
        """E = D / H."""
        return self.width // self.heads

    def hf_config(self) -> dict:
        """The Hugging Face config of this model (what `config.json` holds): a `LlamaConfig`,
        or with experts a `MixtralConfig` (its `intermediate_size` is one expert's)."""
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": self.width,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.depth,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_len,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype": "bfloat16",
            "torch_dtype": "bfloat16",
        }
        if self.experts:
            del config["mlp_bias"]
            config |= {
                "architectures": ["MixtralForCausalLM"],
                "model_type": "mixtral",
                "intermediate_size": self.expert_intermediate,
                "num_local_experts": self.experts,
                "num_experts_per_tok": self.top_k,
                "router_aux_loss_coef": self.router_aux_loss_coef,
                "output_router_logits": False,
                "router_jitter_noise": 0.0,
                "sliding_window": None,
            }
        return config

    @classmethod
    def from_hf_config(cls, config: dict, **overrides) -> LMConfig:
        """The model of a Hugging Face Llama or Mixtral config (`config.json` as a dict).

        Every key is either read (`HF_READ_KEYS`, each value one the model computes) or
        without effect on the logits (`HF_INERT_KEYS`); any other key, or a value the model
        does not compute (rope scaling, a sliding window, another activation, a head size
        other than hidden_size / num_attention_heads), is a ValueError naming it.
        """
        check_hf_config(config)
        fields = {}
        if config.get("num_local_experts"):
            fields = {
                "experts": config["num_local_experts"],
                "top_k": config["num_experts_per_tok"],
                "expert_intermediate": config["intermediate_size"],
                "router_aux_loss_coef": config.get("router_aux_loss_coef", 0.01),
            }
        kv_heads = config.get("num_key_value_heads")
        fields |= {
            "vocab": config["vocab_size"],
            "width": config["hidden_size"],
            "depth": config["num_hidden_layers"],
            "heads": config["num_attention_heads"],
            "kv_heads": config["num_attention_heads"] if kv_heads is None else kv_heads,
            "intermediate": config["intermediate_size"],
            "max_len": config.get("max_position_embeddings", 256),
            "rope_theta": _hf_rope_theta(config),
            "rms_norm_eps": config.get("rms_norm_eps", 1e-6),
            "attention_bias": config.get("attention_bias", False),
            "mlp_bias": config.get("mlp_bias", False),
            "tie_word_embeddings": config.get("tie_word_embeddings", False),
        }
        return cls(**(fields | overrides))


# What `LMConfig.from_hf_config` reads of a config.json (each value checked by check_hf_config).
HF_READ_KEYS = frozenset(
    {
        "model_type",
        "architectures",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "hidden_act",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
        "attention_bias",
        "mlp_bias",
        "tie_word_embeddings",
        "sliding_window",
        "num_local_experts",
        "num_experts_per_tok",
        "router_aux_loss_coef",
    }
)
# Keys that do not change the logits: metadata, token ids, the storage dtype, the quantization
# (read by load_hf_checkpoint), and training-only settings (dropout, router jitter and logits;
# pretraining_tp splits a GEMM into slices whose sum is the same product).
HF_INERT_KEYS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "initializer_range",
        "quantization_config",
        "attention_dropout",
        "pretraining_tp",
        "router_jitter_noise",
        "output_router_logits",
    }
)
# The architectures the model is, by model_type.
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}


def _hf_rope_theta(config: dict) -> float:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return rope.get("rope_theta", config.get("rope_theta", 10000.0))


def check_hf_config(config: dict) -> None:
    """Raises a ValueError naming the first key of `config` the model does not compute."""
    model_type = config.get("model_type")
    if model_type not in HF_ARCHITECTURES:
        raise ValueError(
            f"config.json key 'model_type' (= {model_type!r}): the example's model is a Llama "
            f"or a Mixtral ({' or '.join(map(repr, HF_ARCHITECTURES))})"
        )
    unknown = sorted(set(config) - HF_READ_KEYS - HF_INERT_KEYS)
    if unknown:
        raise ValueError(
            f"config.json key {unknown[0]!r} (= {config[unknown[0]]!r}): the example's model "
            "does not know it, so it cannot honour it"
        )
    for key, problem in _hf_values(config, model_type):
        raise ValueError(f"config.json key {key!r} (= {config.get(key)!r}): {problem}")


def _hf_rope(config: dict):
    """(key, why) of a rotary embedding other than the default (scaled, partial, ...)."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = config.get(key) or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default" or set(rope) - {"rope_type", "type", "rope_theta"}:
            yield key, "the model computes the default rotary embedding only"


def _hf_values(config: dict, model_type: str):
    """(key, what the model computes instead) of each key whose value it does not compute."""
    architecture = HF_ARCHITECTURES[model_type]
    if config.get("architectures", [architecture]) != [architecture]:
        yield "architectures", f"model_type {model_type!r} is [{architecture!r}]"
    if config.get("hidden_act", "silu") != "silu":
        yield "hidden_act", "the MLPs compute SwiGLU ('silu')"
    head_dim, heads = config.get("head_dim"), config.get("num_attention_heads")
    if head_dim is not None and head_dim * (heads or 0) != config.get("hidden_size"):
        yield "head_dim", "the head size is hidden_size / num_attention_heads"
    yield from _hf_rope(config)
    if config.get("sliding_window") is not None:
        yield "sliding_window", "every layer attends to the whole sequence"
    for key in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if not isinstance(config.get(key, False), bool):
            yield key, "must be true or false"
    if model_type == "mixtral" and config.get("attention_bias"):
        yield "attention_bias", "MixtralForCausalLM has no attention biases"
    if bool(config.get("num_local_experts")) != (model_type == "mixtral"):
        yield (
            "num_local_experts",
            f"model_type {model_type!r} "
            + ("has experts" if model_type == "mixtral" else "has none"),
        )


def linear(cfg: LMConfig, d_in: int, d_out: int, rngs: nnx.Rngs, bias: bool = False):
    """A bf16-compute linear layer (with a bias if `bias`): NVFP4 when `cfg.recipe` is set."""
    if cfg.recipe is not None:
        return nvfp4_jax.nnx.Linear(
            d_in, d_out, recipe=cfg.recipe, dtype=jnp.bfloat16, use_bias=bias, rngs=rngs
        )
    return nnx.Linear(d_in, d_out, dtype=jnp.bfloat16, use_bias=bias, rngs=rngs)


def rotary(x: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding of (B, T, heads, E), Hugging Face's "default" (half split)."""
    t, e = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, e, 2, dtype=jnp.float32) / e))
    freqs = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[None, :, None, :]
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., e // 2 :], xf[..., : e // 2]], axis=-1)
    return (xf * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


class Attention(nnx.Module):
    """Causal grouped-query self-attention with rotary embeddings: (B, T, D) -> (B, T, D)."""

    def __init__(self, cfg: LMConfig, rngs: nnx.Rngs):
        d, e = cfg.width, cfg.head_dim
        self.cfg = cfg
        bias = cfg.attention_bias
        self.q_proj = linear(cfg, d, cfg.heads * e, rngs, bias)
        self.k_proj = linear(cfg, d, cfg.kv_heads * e, rngs, bias)
        self.v_proj = linear(cfg, d, cfg.kv_heads * e, rngs, bias)
        self.o_proj = linear(cfg, cfg.heads * e, d, rngs, bias)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).reshape(b, t, cfg.heads, cfg.head_dim)
        k = self.k_proj(x).reshape(b, t, cfg.kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(b, t, cfg.kv_heads, cfg.head_dim)
        q, k = rotary(q, cfg.rope_theta), rotary(k, cfg.rope_theta)
        attended = jax.nn.dot_product_attention(q, k, v.astype(q.dtype), is_causal=True)
        return self.o_proj(attended.reshape(b, t, cfg.heads * cfg.head_dim))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LMConfig, rngs: nnx.Rngs):
        bias = cfg.mlp_bias
        self.gate_proj = linear(cfg, cfg.width, cfg.intermediate, rngs, bias)
        self.up_proj = linear(cfg, cfg.width, cfg.intermediate, rngs, bias)
        self.down_proj = linear(cfg, cfg.intermediate, cfg.width, rngs, bias)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nnx.Module):
    """A mixture of experts' router: (N, D) -> f32 logits (N, X), `x @ kernel` in f32, no bias.

    Not an `nnx.Linear`, so that no rule ever puts it in NVFP4: engines serve routers in high
    precision (ModelOpt leaves `gate` out of quantization), and a router's small logit
    differences decide which experts run.
    """

    def __init__(self, width: int, experts: int, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()  # nnx.Linear's default
        self.kernel = nnx.Param(init(rngs.params(), (width, experts), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...]
        return jnp.dot(x.astype(jnp.float32), kernel, precision=jax.lax.Precision.HIGHEST)


class ExpertsMLP(nnx.Module):
    """X SwiGLU MLPs on tokens sorted by expert: down(silu(gate(x)) * up(x)), each grouped.

    Each projection is an `nvfp4_jax.nnx.Experts` with an (X, in, out) kernel: every expert's
    GEMMs in NVFP4 with its own tensor amaxes (`cfg.recipe`, or the recipe a rule gives it
    through `nvfp4_jax.quantize_model`), or in bf16 with `recipe=None`.
    """

    def __init__(self, cfg: LMConfig, rngs: nnx.Rngs):
        x, d, f = cfg.experts, cfg.width, cfg.expert_intermediate

        def experts(d_in, d_out):
            return nvfp4_jax.nnx.Experts(
                x, d_in, d_out, recipe=cfg.recipe, dtype=jnp.bfloat16, rngs=rngs
            )

        self.gate_proj = experts(d, f)
        self.up_proj = experts(d, f)
        self.down_proj = experts(f, d)

    def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        h = jax.nn.silu(self.gate_proj(x, group_sizes)) * self.up_proj(x, group_sizes)
        return self.down_proj(h, group_sizes)


def load_balancing_loss(probs: jax.Array, chosen: jax.Array) -> jax.Array:
    """Switch Transformer's auxiliary loss: `X * sum_x f_x * P_x`, 1 for a uniform router.

    `f_x` is the share of the N * K (token, choice) pairs routed to expert x (no gradient),
    `P_x` the mean router probability of expert x; `probs` (N, X), `chosen` (N, K).
    """
    x = probs.shape[-1]
    share = jnp.mean(jax.nn.one_hot(chosen, x, dtype=jnp.float32), axis=(0, 1))
    return x * jnp.sum(share * jnp.mean(probs, axis=0))


class MoE(nnx.Module):
    """A Mixtral-style dropless mixture of SwiGLU experts: (B, T, D) -> (f32 (B, T, D), aux).

    The router `gate` scores the X experts of every token in f32 (softmax), the top K are
    kept and their weights renormalized to sum to 1 (Mixtral). The N * K (token, choice)
    pairs are sorted by expert (a stable sort: each expert's tokens stay in token order),
    the tokens gathered and run through `experts` grouped (`group_sizes`, a bincount), and
    the results put back in pair order and summed over each token's K choices with their
    weights. No token is dropped: every expert takes all the tokens routed to it.
    """

    def __init__(self, cfg: LMConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.gate = Router(cfg.width, cfg.experts, rngs)
        self.experts = ExpertsMLP(cfg, rngs)

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Tokens (N, D) -> (router probabilities (N, X), chosen experts (N, K) int32, their
        renormalized weights (N, K) f32)."""
        probs = jax.nn.softmax(self.gate(x), axis=-1)
        top_p, chosen = jax.lax.top_k(probs, self.cfg.top_k)
        return probs, chosen, top_p / jnp.sum(top_p, axis=-1, keepdims=True)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        shape, k = x.shape, self.cfg.top_k
        # Dropless routing sorts all the tokens: under Explicit mesh axes they are gathered
        # here and the result sharded as x again (XLA does the same by itself under Auto axes).
        tokens = _gathered(x).reshape(-1, shape[-1])
        probs, chosen, weights = self.route(tokens)
        expert = chosen.reshape(-1)  # pair p: token p // K, its choice p % K
        order = jnp.argsort(expert, stable=True)
        group_sizes = jnp.bincount(expert, length=self.cfg.experts).astype(jnp.int32)
        out = self.experts(tokens[order // k], group_sizes)
        pairs = jnp.arange(order.shape[0], dtype=order.dtype)
        place = jnp.zeros_like(order).at[order].set(pairs)  # the inverse permutation
        out = out[place].reshape(tokens.shape[0], k, -1).astype(jnp.float32)
        y = jnp.sum(out * weights[..., None], axis=1)
        return _sharded_as(y.reshape(shape), x), load_balancing_loss(probs, chosen)


class DecoderLayer(nnx.Module):
    """Pre-norm attention and MLP (dense or `MoE`), each with a residual connection."""

    def __init__(self, cfg: LMConfig, rngs: nnx.Rngs):
        eps = cfg.rms_norm_eps
        self.input_layernorm = nnx.RMSNorm(cfg.width, epsilon=eps, rngs=rngs)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = nnx.RMSNorm(cfg.width, epsilon=eps, rngs=rngs)
        self.mlp = MoE(cfg, rngs) if cfg.experts else MLP(cfg, rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Returns the output and the MoE's load-balancing loss (0 for a dense MLP)."""
        x = x + self.self_attn(self.input_layernorm(x)).astype(x.dtype)
        y = self.mlp(self.post_attention_layernorm(x))
        y, aux = y if isinstance(self.mlp, MoE) else (y, jnp.zeros((), jnp.float32))
        return x + y.astype(x.dtype), aux


def _embedding_sharding(tokens: jax.Array):
    """The embeddings' sharding where the types hold shardings (Explicit mesh axes): the tokens'.

    A gather from a replicated table by sharded tokens must state its result's sharding there;
    elsewhere None (XLA decides).
    """
    sharding = _explicit_sharding(tokens)
    return None if sharding is None else jax.sharding.PartitionSpec(*sharding.spec, None)


def _explicit_sharding(x: jax.Array):
    """x's sharding where the types hold shardings (Explicit mesh axes), else None."""
    sharding = jax.typeof(x).sharding
    if sharding.mesh.empty or not sharding.mesh.explicit_axes:
        return None
    return sharding


def _gathered(x: jax.Array) -> jax.Array:
    """x replicated where its type holds a sharding, else x."""
    sharding = _explicit_sharding(x)
    return x if sharding is None else jax.sharding.reshard(x, sharding.update(spec=()))


def _sharded_as(y: jax.Array, like: jax.Array) -> jax.Array:
    """y with the sharding `like`'s type holds, if any."""
    sharding = _explicit_sharding(like)
    return y if sharding is None else jax.sharding.reshard(y, sharding)


class TransformerLM(nnx.Module):
    """A Llama: tokens (B, T) -> f32 logits (B, T, V). Module names are Hugging Face's."""

    def __init__(self, cfg: LMConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_tokens = nnx.Embed(cfg.vocab, cfg.width, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.depth)])
        self.norm = nnx.RMSNorm(cfg.width, epsilon=cfg.rms_norm_eps, rngs=rngs)
        # Tied embeddings: no head of its own (`head` multiplies by the embedding table).
        self.lm_head = None if cfg.tie_word_embeddings else linear(cfg, cfg.width, cfg.vocab, rngs)

    def head(self, x: jax.Array) -> jax.Array:
        """f32 logits (B, T, V) of the normalized hidden states x (B, T, D): `lm_head(x)`, or
        `x @ embed_tokens.embedding.T` with tied embeddings."""
        if self.lm_head is None:
            return self.embed_tokens.attend(x).astype(jnp.float32)
        return self.lm_head(x).astype(jnp.float32)

    def forward(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(f32 logits for every position, the mean load-balancing loss of the MoE layers)."""
        x = self.embed_tokens(tokens, out_sharding=_embedding_sharding(tokens))
        aux = jnp.zeros((), jnp.float32)
        for layer in self.layers:
            x, layer_aux = layer(x)
            aux = aux + layer_aux
        return self.head(self.norm(x)), aux / len(self.layers)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Returns f32 logits for every position."""
        return self.forward(tokens)[0]


Llama = TransformerLM


def _cross_entropy(logits: jax.Array, batch: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def loss_fn(model: TransformerLM, batch: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats) of a (B, T + 1) batch of tokens."""
    return _cross_entropy(model(batch[:, :-1]), batch)


def train_loss_fn(model: TransformerLM, batch: jax.Array) -> tuple[jax.Array, tuple]:
    """The training objective and (cross-entropy, load-balancing loss), for `has_aux=True`.

    The objective is the cross-entropy (`loss_fn`) plus, with experts, the load-balancing
    loss times `router_aux_loss_coef`.
    """
    logits, aux = model.forward(batch[:, :-1])
    loss = _cross_entropy(logits, batch)
    if not model.cfg.experts:
        return loss, (loss, aux)
    return loss + model.cfg.router_aux_loss_coef * aux, (loss, aux)


def _module_at(model: nnx.Module, path: tuple, where: str) -> nnx.Module:
    """The module at `path`; a ValueError naming the leaf `where` when the model has none."""
    try:
        for key in path:
            model = model[key] if isinstance(key, int) else getattr(model, key)
    except (AttributeError, IndexError, KeyError, TypeError):
        model = None
    if not isinstance(model, nnx.Module):
        raise ValueError(f"from_params: {where}: the model has no module {_name(path)}")
    return model


# The message of parameters the tree lacks: its config (e.g. attention_bias) makes them.
MISSING = "the tree lacks parameters the config's model has:"


def _name(path: tuple) -> str:
    return "/".join(map(str, path))


def _variable(module: nnx.Module, path: tuple, leaf) -> nnx.Variable:
    """`module`'s variable `path[-1]`, checked to exist and to have `leaf`'s shape."""
    variable = getattr(module, path[-1], None)
    if not isinstance(variable, nnx.Variable):
        raise ValueError(
            f"from_params: {_name(path)}: the model has no such parameter (its config: no "
            "bias, tied embeddings, another architecture?)"
        )
    if tuple(variable.shape) != tuple(leaf.shape):
        raise ValueError(
            f"from_params: {_name(path)} is {tuple(leaf.shape)}, the model's is "
            f"{tuple(variable.shape)}"
        )
    return variable


def _flat_params(params: dict) -> dict[tuple, object]:
    """`{path: leaf}` of the tree, NVFP4Arrays whole, digit keys as ints (layer indices)."""
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=nvfp4_jax.is_nvfp4_array)[0]
    out = {}
    for key_path, leaf in flat:
        path = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in key_path)
        out[tuple(int(p) if isinstance(p, str) and p.isdigit() else p for p in path)] = leaf
    return out


def _set_module(model: nnx.Module, path: tuple, layer: nnx.Module) -> None:
    owner = _module_at(model, path[:-1], _name(path))
    if isinstance(path[-1], int):
        owner[path[-1]] = layer
    else:
        setattr(owner, path[-1], layer)


def _freeze(model, leaves: dict, path: tuple, activations: str, dtype) -> set[tuple]:
    """Replaces the layer of the NVFP4 kernel at `path` by its frozen form; returns the leaf
    paths it took (the kernel, and a linear's bias and input_scale)."""
    parent, q = path[:-1], leaves[path]
    plain = _module_at(model, parent, _name(path))
    _variable(plain, path, q)
    if len(q.shape) == 3:  # an MoE layer's stacked experts: frozen weight-only (W4A16)
        if activations != "high_precision":
            raise ValueError(
                f"from_params: {_name(path)} is a quantized experts kernel; experts load "
                f"weight-only, activations={activations!r} is for linears"
            )
        _set_module(model, parent, nvfp4_jax.nnx.Experts.from_quantized(q, dtype=dtype))
        return {path}
    if len(q.shape) != 2:
        raise ValueError(
            f"from_params: {_name(path)} is a quantized {q.shape} kernel; only (in, out) "
            "linears and (E, in, out) experts load frozen"
        )
    bias_path, scale_path = (*parent, "bias"), (*parent, "input_scale")
    bias = leaves.get(bias_path)
    if getattr(plain, "use_bias", False) and bias is None:
        raise ValueError(f"from_params: {MISSING} {_name(bias_path)}")
    if bias is not None:
        _variable(plain, bias_path, bias)
    layer = nvfp4_jax.nnx.Linear.from_quantized(
        q, bias=bias, input_scale=leaves.get(scale_path), activations=activations, dtype=dtype
    )
    _set_module(model, parent, layer)
    return {path, bias_path, scale_path}


def _check_complete(model: nnx.Module) -> None:
    """Raises naming every parameter no leaf set; other variables (the experts' calibration
    amax) start at zeros, as the layers' own initializers make them."""
    missing = []
    for path, variable in nnx.iter_graph(model):
        if isinstance(variable, nnx.Variable) and isinstance(
            variable.get_value(), jax.ShapeDtypeStruct
        ):
            if isinstance(variable, nnx.Param):
                missing.append(_name(path))
            else:
                variable.set_value(jnp.zeros(variable.shape, variable.dtype))
    if missing:
        raise ValueError(f"from_params: {MISSING} {', '.join(missing)}")


def from_params(
    cfg: LMConfig,
    params: dict,
    *,
    activations: str = "high_precision",
    dtype=jnp.float32,
) -> TransformerLM:
    """A model holding `params`: the nested Flax tree `nvfp4_jax.load_hf_checkpoint` returns.

    A linear whose `kernel` is an `NVFP4Array` becomes `nvfp4_jax.nnx.Linear.from_quantized`
    (with its `bias`; weight-only, or W4A4 with `activations="nvfp4"` and the `input_scale`
    beside it), an MoE layer's stacked (E, in, out) `NVFP4Array` experts
    `nvfp4_jax.nnx.Experts.from_quantized` (weight-only); every other leaf is set as the
    parameter of the same path. Computes in `dtype`. The tree must be the model `cfg` makes:
    a leaf the model has no parameter for (a bias, an `lm_head` with tied embeddings), one of
    another shape, or a parameter without a leaf is a ValueError naming it.
    """
    # Built abstract with plain layers: every variable is replaced below.
    plain = dataclasses.replace(cfg, recipe=None)
    model = nnx.eval_shape(lambda: TransformerLM(plain, nnx.Rngs(0)))
    leaves = _flat_params(params)
    taken = set()
    for path, leaf in leaves.items():
        if nvfp4_jax.is_nvfp4_array(leaf):
            taken |= _freeze(model, leaves, path, activations, dtype)
    for path, leaf in leaves.items():
        # An input_scale beside a float kernel is unused (weight-only; a high-precision layer).
        if path in taken or path[-1] == "input_scale":
            continue
        module = _module_at(model, path[:-1], _name(path))
        _variable(module, path, leaf)
        if path[-1] == "kernel" and not isinstance(module, Router):  # the router stays f32
            module.dtype = dtype
        setattr(module, path[-1], nnx.Param(jnp.asarray(leaf).astype(jnp.float32)))
    _check_complete(model)
    return model
