"""MaxText's parameter tree <-> Hugging Face's names and layouts, for the decoders both have.

MaxText (0.2.5) stores a decoder as its own tree: `decoder/layers/self_attention/query/kernel`
(D, H, E), `.../out/kernel` (H, E, D), `decoder/layers/mlp/wi_0/kernel` (D, F), an MoE
block's experts as one (X, D, F) array per projection (`MoeBlock_0/wi_0`, Mixtral;
`moe_block/wi_0`, Qwen3-MoE) and its router as `.../gate/kernel` (D, X); with `scan_layers`
every layer's leaf is one array with the layers stacked on axis `param_scan_axis` (1 by
default: (D, L, H, E), (X, L, D, F), a norm's (D, L)). nvfp4_jax's Hugging Face exporter
and importer (`nvfp4_jax.hf`) read and write the tree of a Flax model written with HF's
module names (`layers/{i}/self_attn/q_proj/kernel` (in, out), `layers/{i}/mlp/experts/
gate_proj/kernel` (X, in, out), `embed_tokens/embedding`, `norm/scale`, `lm_head/kernel`;
`llama_name_map`, `mixtral_name_map`, `qwen3_moe_name_map`). This module maps one to the
other, both ways: `model_spec` reads what the mapping needs of a MaxText config (refusing,
with the key to change, what a Hugging Face model of the family cannot compute),
`hf_config` writes the model's `config.json`, `entries` lists every tensor with its source,
and `to_hf` / `to_maxtext` move the arrays.

Each tensor is a reshape (the kernel's contracted axes flattened to K, its free axes to N,
in MaxText's own order, as nvfp4_jax's `dot_general` flattens them in the training forward)
and at most two changes of value, both where MaxText and Hugging Face compute differently:

* the query of Llama, Mistral and Mixtral: MaxText folds attention's 1 / sqrt(E) into the
  query kernel (its attention does not scale `q k^T`; MaxText's own converter to Hugging
  Face multiplies by sqrt(E)), so the HF `q_proj` is the MaxText query times sqrt(E)
  (exact when sqrt(E) is a power of two, E = 16, 64, 256); Qwen3 scales in its attention
  (`query_pre_attn_scalar`), as HF does;
* the rotary embedding of `model_name=llama3.1*`: MaxText rotates interleaved pairs
  (d 2i, 2i+1), HF the halves (i, i + E/2), so the HF `q_proj` and `k_proj` rows of every
  head are MaxText's evens then odds.

Shape letters: L layers, D emb_dim, H query heads, G key/value heads, E head_dim, F the MLP
size (one expert's in an MoE), X experts, V vocab_size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Family:
    """A MaxText decoder block and the Hugging Face model it is.

    Attributes:
      block: MaxText's `decoder_block`.
      architecture: the HF `architectures` entry.
      model_type: the HF `model_type`.
      moe: the MaxText module of the MoE block (`MoeBlock_0`, `moe_block`), None if dense.
      hf_moe: the HF module of the MoE block (`block_sparse_moe`, `mlp`).
      qk_norm: the attention normalizes q and k per head (Qwen3's `q_norm`, `k_norm`).
      folded_query_scale: MaxText folds 1 / sqrt(E) into the query kernel.
    """

    block: str
    architecture: str
    model_type: str
    moe: str | None = None
    hf_moe: str | None = None
    qk_norm: bool = False
    folded_query_scale: bool = True


FAMILIES = {
    family.block: family
    for family in (
        Family("llama2", "LlamaForCausalLM", "llama"),
        Family("mistral", "MistralForCausalLM", "mistral"),
        Family("mixtral", "MixtralForCausalLM", "mixtral", "MoeBlock_0", "block_sparse_moe"),
        Family("qwen3", "Qwen3ForCausalLM", "qwen3", qk_norm=True, folded_query_scale=False),
        Family(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            "qwen3_moe",
            "moe_block",
            "mlp",
            qk_norm=True,
            folded_query_scale=False,
        ),
    )
}
ARCHITECTURES = {family.architecture: family for family in FAMILIES.values()}
# MaxText's llama3.1 rotary embedding (`LLaMARotaryEmbedding`, its constants): HF's "llama3".
LLAMA31_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
BLOCK = 16


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the mapping needs of a MaxText config, checked (`model_spec`).

    Attributes:
      family: the decoder family.
      layers, width, heads, kv_heads, head_dim, mlp, vocab: L, D, H, G, E, F, V.
      experts, top_k: X and the experts per token (0 and 0 for a dense model).
      scan_layers: the layers are stacked on axis `scan_axis` of every layer leaf.
      scan_axis: MaxText's `param_scan_axis`.
      tied: the output head is the embedding (`logits_via_embedding`).
      interleaved_rope: MaxText rotates interleaved pairs (`model_name=llama3.1*`).
      llama3_rope_scaling: with it, MaxText's llama3.1 frequency scaling (`rope_use_scale`).
      rope_theta: `rope_max_timescale`.
      rms_norm_eps: `normalization_layer_epsilon`.
      max_len: `max_target_length`.
      router_aux_loss_coef: `load_balance_loss_weight` (MoE).
    """

    family: Family
    layers: int
    width: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    experts: int = 0
    top_k: int = 0
    scan_layers: bool = True
    scan_axis: int = 1
    tied: bool = False
    interleaved_rope: bool = False
    llama3_rope_scaling: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_len: int = 2048
    router_aux_loss_coef: float = 0.0

    @property
    def query_scale(self) -> float:
        """The factor from MaxText's query kernel to HF's `q_proj`: sqrt(E) or 1."""
        return math.sqrt(self.head_dim) if self.family.folded_query_scale else 1.0


def _value(config: Any, name: str, default: Any = None) -> Any:
    """A config field; an enum (MaxText's `DecoderBlockType`, `RopeType`) as its value."""
    value = getattr(config, name, default)
    return getattr(value, "value", value)


def _refuse(name: str, value: Any, why: str) -> ValueError:
    return ValueError(f"nvfp4_jax.maxtext: MaxText's {name}={value!r}: {why}")


# MaxText settings the Hugging Face model of these families cannot compute: (key, the value
# that it can, why). Each is refused by name rather than exported to a model computing
# something else than what was trained.
_MUST_BE = (
    (
        "fused_qkv",
        False,
        "a fused query/key/value kernel is not mapped; train with fused_qkv=False",
    ),
    ("fused_mlp", False, "a fused MLP kernel is not mapped; train with fused_mlp=False"),
    ("attn_logits_soft_cap", None, "HF's attention has no logit soft cap"),
    ("final_logits_soft_cap", None, "HF's output head has no logit soft cap"),
    ("use_post_attn_norm", False, "HF's layer has no post-attention norm of this kind"),
    ("use_post_ffw_norm", False, "HF's layer has no post-MLP norm"),
    ("rope_min_timescale", 1, "HF's rotary frequencies start at 1 (theta^0)"),
    ("routed_scaling_factor", 1.0, "HF's router does not scale the expert weights"),
    ("shared_experts", 0, "these families have no shared experts"),
    ("first_num_dense_layers", 0, "every layer of these MoE families is an MoE layer"),
    ("interleave_moe_layer_step", 1, "every layer of these MoE families is an MoE layer"),
    ("inhomogeneous_layer_cycle_interval", 1, "every layer is alike in these families"),
    ("sliding_window_size", 0, "the layers attend to the whole sequence"),
    ("share_kv_projections", False, "HF's key and value are two projections"),
    ("prefuse_moe_weights", False, "a fused (X, D, 2F) expert kernel is not mapped"),
)


def _check_settings(config: Any, family: Family) -> None:
    for name, expected, why in _MUST_BE:
        value = _value(config, name, expected)
        if value != expected and not (expected is None and not value):
            raise _refuse(name, value, why)
    activations = list(_value(config, "mlp_activations", ["silu", "linear"]))
    if activations != ["silu", "linear"]:
        raise _refuse("mlp_activations", activations, "the HF MLP is SwiGLU: ['silu', 'linear']")
    if _value(config, "attention_type", "global") != "global":
        raise _refuse("attention_type", _value(config, "attention_type"), "must be 'global'")
    rope = str(_value(config, "rope_type", "default") or "default").lower()
    if rope not in ("default", "llama3.1"):
        raise _refuse("rope_type", rope, "the families' rotary embeddings are the default one")
    if family.qk_norm and not _value(config, "use_qk_norm", False):
        raise _refuse(
            "use_qk_norm", False, f"{family.architecture} normalizes q and k; set use_qk_norm=True"
        )
    if not family.qk_norm and _value(config, "use_qk_norm", False):
        raise _refuse("use_qk_norm", True, f"{family.architecture} has no q/k norms")
    tied = bool(_value(config, "logits_via_embedding", False))
    if tied and _value(config, "normalize_embedding_logits", False):
        raise _refuse(
            "normalize_embedding_logits",
            True,
            "HF's tied output head does not divide the logits by sqrt(emb_dim)",
        )


def model_spec(config: Any) -> ModelSpec:
    """The `ModelSpec` of a MaxText config (`pyconfig.HyperParameters`, or its fields).

    Raises:
      ValueError: a `decoder_block` outside `FAMILIES`, or a setting the family's Hugging
        Face model cannot compute (soft caps, fused kernels, other activations or rotary
        embeddings, ...), naming the MaxText key.
    """
    block = _value(config, "decoder_block")
    family = FAMILIES.get(str(block))
    if family is None:
        raise _refuse(
            "decoder_block",
            block,
            f"the export maps {sorted(FAMILIES)} (deepseek: see docs/guides/maxtext.md)",
        )
    _check_settings(config, family)
    experts = int(_value(config, "num_experts", 1) or 1)
    if (experts > 1) != (family.moe is not None):
        raise _refuse(
            "num_experts",
            experts,
            f"decoder_block={block} is {'an MoE' if family.moe else 'a dense'} family",
        )
    mlp = _value(config, "moe_mlp_dim" if block == "qwen3_moe" else "mlp_dim")
    model_name = str(_value(config, "model_name", "default"))
    interleaved = model_name.startswith("llama3.1") or str(
        _value(config, "rope_type", "default")
    ).lower().startswith("llama3.1")
    return ModelSpec(
        family=family,
        layers=int(_value(config, "num_decoder_layers")),
        width=int(_value(config, "emb_dim")),
        heads=int(_value(config, "num_query_heads")),
        kv_heads=int(_value(config, "num_kv_heads")),
        head_dim=int(_value(config, "head_dim")),
        mlp=int(mlp),
        vocab=int(_value(config, "vocab_size")),
        experts=experts if family.moe else 0,
        top_k=int(_value(config, "num_experts_per_tok", 0)) if family.moe else 0,
        scan_layers=bool(_value(config, "scan_layers", True)),
        scan_axis=int(_value(config, "param_scan_axis", 1)),
        tied=bool(_value(config, "logits_via_embedding", False)),
        interleaved_rope=interleaved,
        llama3_rope_scaling=interleaved and bool(_value(config, "rope_use_scale", True)),
        rope_theta=float(_value(config, "rope_max_timescale", 10000)),
        rms_norm_eps=float(_value(config, "normalization_layer_epsilon", 1e-5)),
        max_len=int(_value(config, "max_target_length", 2048)),
        router_aux_loss_coef=float(_value(config, "load_balance_loss_weight", 0.0) or 0.0),
    )


def hf_config(spec: ModelSpec) -> dict:
    """The Hugging Face `config.json` of the model (without its `quantization_config`)."""
    family = spec.family
    rope: dict[str, Any] = {"rope_theta": spec.rope_theta, "rope_type": "default"}
    if spec.llama3_rope_scaling:
        rope = {"rope_theta": spec.rope_theta, **LLAMA31_ROPE_SCALING}
    config = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "hidden_act": "silu",
        "hidden_size": spec.width,
        "intermediate_size": spec.mlp,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_len,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_parameters": rope,
        "attention_bias": False,
        "tie_word_embeddings": spec.tied,
        "torch_dtype": "bfloat16",
    }
    if spec.llama3_rope_scaling:
        config["rope_scaling"] = dict(LLAMA31_ROPE_SCALING)
    if family.model_type == "llama":
        config["mlp_bias"] = False
    if family.model_type in ("mistral", "mixtral", "qwen3", "qwen3_moe"):
        config["sliding_window"] = None
    if family.model_type in ("qwen3", "qwen3_moe"):
        config |= {"use_sliding_window": False, "max_window_layers": spec.layers}
    if family.model_type == "mixtral":
        config |= {
            "num_local_experts": spec.experts,
            "num_experts_per_tok": spec.top_k,
            "router_aux_loss_coef": spec.router_aux_loss_coef,
            "output_router_logits": False,
            "router_jitter_noise": 0.0,
        }
    if family.model_type == "qwen3_moe":
        # MaxText softmaxes the top-k router logits, i.e. renormalizes the top-k probabilities.
        config |= {
            "num_experts": spec.experts,
            "num_experts_per_tok": spec.top_k,
            "moe_intermediate_size": spec.mlp,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "router_aux_loss_coef": spec.router_aux_loss_coef,
            "output_router_logits": False,
        }
    return config


def check_hf_config(config: Mapping, spec: ModelSpec) -> None:
    """Raises a ValueError naming the first field of an HF `config.json` that disagrees.

    (With the MaxText config's model: another architecture, other sizes.)
    """
    ours = hf_config(spec)
    architecture = list(config.get("architectures") or [])
    if architecture != ours["architectures"]:
        raise ValueError(
            f"nvfp4_jax.maxtext: the checkpoint is {architecture or config.get('model_type')}, "
            f"the MaxText config (decoder_block={spec.family.block}) makes "
            f"{ours['architectures']}"
        )
    keys = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"]
    keys += ["vocab_size", "num_local_experts", "num_experts", "num_experts_per_tok"]
    keys += ["moe_intermediate_size"] if spec.family.model_type == "qwen3_moe" else []
    keys += ["intermediate_size"] if spec.family.model_type != "qwen3_moe" else []
    for key in keys:
        if key in ours and config.get(key) != ours[key]:
            raise ValueError(
                f"nvfp4_jax.maxtext: the checkpoint's config.json has {key}={config.get(key)!r}, "
                f"the MaxText config's model {ours[key]!r}"
            )
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim != spec.head_dim:
        raise ValueError(
            f"nvfp4_jax.maxtext: the checkpoint's head_dim is {head_dim}, the MaxText config's "
            f"{spec.head_dim}"
        )
    if bool(config.get("tie_word_embeddings", False)) != spec.tied:
        raise ValueError(
            f"nvfp4_jax.maxtext: the checkpoint's tie_word_embeddings is "
            f"{config.get('tie_word_embeddings')}, MaxText's logits_via_embedding {spec.tied}"
        )


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of the HF tree and the MaxText leaf (of one layer) it is.

    Attributes:
      hf: its path in the HF-named Flax tree, e.g. "layers/0/self_attn/q_proj/kernel".
      maxtext: the MaxText leaf's path, e.g. ("decoder", "layers", "self_attention",
        "query", "kernel").
      layer: the layer's index on the scan axis of a stacked leaf; None if not stacked.
      kind: "linear" (a kernel, (K, N) on the HF side), "experts" (X, K, N), "router",
        "embedding", "norm" or "head" (the output projection, kept as the exporter's
        `lm_head` linear).
      contracted: how many leading axes of the MaxText kernel (after the expert axis) are
        contracted (flattened to K); the rest are N.
      module: the module path qwix sees for the op that uses the leaf, e.g.
        "decoder/layers/self_attention/query" (the MoE block itself for its experts).
      op: the op the module issues with it ("dot_general"; "ragged_dot" for the experts).
      scale: the HF tensor is `scale` times MaxText's (the query's sqrt(E)).
      rope: the HF rows (N) of every head are MaxText's evens then odds.
    """

    hf: str
    maxtext: tuple[str, ...]
    layer: int | None
    kind: str
    contracted: int = 1
    module: str = ""
    op: str = "dot_general"
    scale: float = 1.0
    rope: bool = False

    @property
    def hf_module(self) -> str:
        """The HF-named Flax module path (the tensor's path without its last component)."""
        return self.hf.rpartition("/")[0]


def _layer_prefix(spec: ModelSpec, i: int) -> tuple[str, ...]:
    return ("decoder", "layers") if spec.scan_layers else ("decoder", f"layers_{i}")


def _attention(spec: ModelSpec, i: int) -> Iterator[Entry]:
    prefix = _layer_prefix(spec, i)
    layer = i if spec.scan_layers else None
    for name, hf, scale, rope in (
        ("query", "q_proj", spec.query_scale, spec.interleaved_rope),
        ("key", "k_proj", 1.0, spec.interleaved_rope),
        ("value", "v_proj", 1.0, False),
        ("out", "o_proj", 1.0, False),
    ):
        module = "/".join((*prefix, "self_attention", name))
        yield Entry(
            f"layers/{i}/self_attn/{hf}/kernel",
            (*prefix, "self_attention", name, "kernel"),
            layer,
            "linear",
            contracted=2 if name == "out" else 1,
            module=module,
            scale=scale,
            rope=rope,
        )
    if spec.family.qk_norm:
        for name, hf in (("query_norm", "q_norm"), ("key_norm", "k_norm")):
            path = (*prefix, "self_attention", name, "scale")
            yield Entry(f"layers/{i}/self_attn/{hf}/scale", path, layer, "norm")


def _mlp(spec: ModelSpec, i: int) -> Iterator[Entry]:
    prefix = _layer_prefix(spec, i)
    layer = i if spec.scan_layers else None
    names = (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))
    if spec.family.moe is None:
        for name, hf in names:
            module = "/".join((*prefix, "mlp", name))
            yield Entry(
                f"layers/{i}/mlp/{hf}/kernel",
                (*prefix, "mlp", name, "kernel"),
                layer,
                "linear",
                module=module,
            )
        return
    block = (*prefix, spec.family.moe)
    yield Entry(
        f"layers/{i}/mlp/gate/kernel",
        (*block, "gate", "kernel"),
        layer,
        "router",
        module="/".join((*block, "gate")),
    )
    for name, hf in names:
        yield Entry(
            f"layers/{i}/mlp/experts/{hf}/kernel",
            (*block, name),
            layer,
            "experts",
            module="/".join(block),
            op="ragged_dot",
        )


def entries(spec: ModelSpec) -> list[Entry]:
    """Every tensor of the model: the embedding, each layer's, the final norm and the head."""
    out = [Entry("embed_tokens/embedding", ("token_embedder", "embedding"), None, "embedding")]
    for i in range(spec.layers):
        prefix = _layer_prefix(spec, i)
        layer = i if spec.scan_layers else None
        norms = (
            ("pre_self_attention_layer_norm", "input_layernorm"),
            ("post_self_attention_layer_norm", "post_attention_layernorm"),
        )
        for name, hf in norms:
            out.append(Entry(f"layers/{i}/{hf}/scale", (*prefix, name, "scale"), layer, "norm"))
        out.extend(_attention(spec, i))
        out.extend(_mlp(spec, i))
    out.append(Entry("norm/scale", ("decoder", "decoder_norm", "scale"), None, "norm"))
    if not spec.tied:
        path = ("decoder", "logits_dense", "kernel")
        out.append(Entry("lm_head/kernel", path, None, "head", module="decoder/logits_dense"))
    return out


# --- the arrays -------------------------------------------------------------------------------


def leaf(tree: Mapping, path: tuple[str, ...]) -> Any:
    """The leaf of a nested dict at `path`; a ValueError naming the path where it is missing."""
    node: Any = tree
    for depth, key in enumerate(path):
        if not isinstance(node, Mapping) or key not in node:
            raise ValueError(
                f"nvfp4_jax.maxtext: the MaxText tree has no {'/'.join(path[: depth + 1])} "
                f"(looking for {'/'.join(path)}): a checkpoint of another architecture, or "
                "scan_layers not as it was trained?"
            )
        node = node[key]
    return node


def layer_of(array, entry: Entry, spec: ModelSpec) -> np.ndarray:
    """The entry's layer of a MaxText leaf (the leaf itself when not stacked)."""
    if entry.layer is None:
        return array
    return np.take(np.asarray(array), entry.layer, axis=spec.scan_axis)


def _rope_to_hf(n_axis: np.ndarray, head_dim: int) -> np.ndarray:
    """N (heads * E) of the last axis: each head's evens, then its odds."""
    shaped = n_axis.reshape(*n_axis.shape[:-1], -1, head_dim)
    halves = np.concatenate([shaped[..., 0::2], shaped[..., 1::2]], axis=-1)
    return halves.reshape(n_axis.shape)


def _rope_to_maxtext(n_axis: np.ndarray, head_dim: int) -> np.ndarray:
    shaped = n_axis.reshape(*n_axis.shape[:-1], -1, head_dim)
    half = head_dim // 2
    pairs = np.stack([shaped[..., :half], shaped[..., half:]], axis=-1)
    return pairs.reshape(n_axis.shape)


def hf_shape(entry: Entry, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF-side shape of a MaxText layer array of `shape`: (K, N) for a linear."""
    if entry.kind not in ("linear", "head"):
        return tuple(shape)
    k = math.prod(shape[: entry.contracted])
    return (k, math.prod(shape[entry.contracted :]))


def to_hf(entry: Entry, array, spec: ModelSpec) -> np.ndarray:
    """One layer's MaxText array as its HF-side tensor (a kernel as (K, N) or (X, K, N)).

    The dtype is kept where the value is only reshaped; a scaled query is computed in f32
    (`f32(x) * f32(sqrt(E))`) and stays f32.
    """
    array = np.asarray(array)
    out = array.reshape(hf_shape(entry, array.shape))
    if entry.scale != 1.0:
        out = out.astype(np.float32) * np.float32(entry.scale)
    if entry.rope:
        out = _rope_to_hf(out, spec.head_dim)
    return out


def to_maxtext(entry: Entry, array, shape: tuple[int, ...], dtype) -> np.ndarray:
    """One HF-side tensor as the entry's MaxText layer array of `shape` in `dtype`.

    The inverse of `to_hf`: the RoPE order undone, the query divided by sqrt(E) in f32
    (correctly rounded, `f32(x) / f32(sqrt(E))`), reshaped, cast.
    """
    out = np.asarray(array)
    expected = hf_shape(entry, shape)
    if tuple(out.shape) != expected:
        raise ValueError(
            f"nvfp4_jax.maxtext: {entry.hf} is {tuple(out.shape)}; the MaxText config's "
            f"{'/'.join(entry.maxtext)} needs {expected}"
        )
    if entry.rope:
        out = _rope_to_maxtext(out, _head_dim(entry, shape))
    if entry.scale != 1.0:
        out = out.astype(np.float32) / np.float32(entry.scale)
    return out.reshape(shape).astype(dtype)


def _head_dim(entry: Entry, shape: tuple[int, ...]) -> int:
    """E of a query or key kernel (D, heads, E)."""
    return shape[-1]


def layer_shape(entry: Entry, stacked_shape: tuple[int, ...], spec: ModelSpec) -> tuple:
    """One layer's shape of a (possibly stacked) MaxText leaf."""
    if entry.layer is None:
        return tuple(stacked_shape)
    shape = list(stacked_shape)
    del shape[spec.scan_axis]
    return tuple(shape)


def stack(entries_of_leaf: list[Entry], arrays: list[np.ndarray], spec: ModelSpec):
    """The MaxText leaf of a group of entries: one array, or the layers stacked."""
    if entries_of_leaf[0].layer is None:
        return arrays[0]
    order = np.argsort([entry.layer for entry in entries_of_leaf])
    return np.stack([arrays[i] for i in order], axis=spec.scan_axis)


def by_leaf(all_entries: list[Entry]) -> dict[tuple[str, ...], list[Entry]]:
    """The entries grouped by their MaxText leaf (the layers of a stacked leaf together)."""
    out: dict[tuple[str, ...], list[Entry]] = {}
    for entry in all_entries:
        out.setdefault(entry.maxtext, []).append(entry)
    return out


def expected_shapes(spec: ModelSpec) -> dict[tuple[str, ...], tuple[int, ...]]:
    """The shape of every MaxText leaf of the model (stacked where `scan_layers`)."""
    d, e, f, x = spec.width, spec.head_dim, spec.mlp, spec.experts
    one = {
        "query": (d, spec.heads, e),
        "key": (d, spec.kv_heads, e),
        "value": (d, spec.kv_heads, e),
        "out": (spec.heads, e, d),
        "query_norm": (e,),
        "key_norm": (e,),
        "wi_0": (x, d, f) if x else (d, f),
        "wi_1": (x, d, f) if x else (d, f),
        "wo": (x, f, d) if x else (f, d),
        "gate": (d, x),
        "pre_self_attention_layer_norm": (d,),
        "post_self_attention_layer_norm": (d,),
        "token_embedder": (spec.vocab, d),
        "decoder_norm": (d,),
        "logits_dense": (d, spec.vocab),
    }
    out = {}
    for leaf_path, group in by_leaf(entries(spec)).items():
        name = leaf_path[-2] if leaf_path[-1] in ("kernel", "scale", "embedding") else leaf_path[-1]
        shape = one[name]
        if group[0].layer is not None:
            shape = (*shape[: spec.scan_axis], spec.layers, *shape[spec.scan_axis :])
        out[leaf_path] = shape
    return out


def nested(flat: Mapping[tuple[str, ...], Any]) -> dict:
    """A nested dict from `{path tuple: leaf}`."""
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def hf_tree(flat: Mapping[str, Any]) -> dict:
    """The nested HF-named Flax tree of `{"layers/0/...": leaf}` (layer indices as ints)."""
    tree: dict = {}
    for path, value in flat.items():
        keys = [int(k) if k.isdigit() else k for k in path.split("/")]
        node = tree
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return tree


def flat_hf(tree: Mapping) -> dict[str, Any]:
    """`{"layers/0/...": leaf}` of a nested HF-named tree (`load_hf_checkpoint`'s)."""
    out: dict[str, Any] = {}

    def walk(node, prefix):
        if isinstance(node, Mapping):
            for key, value in node.items():
                walk(value, f"{prefix}/{key}" if prefix else str(key))
        else:
            out[prefix] = node

    walk(tree, "")
    return out


def check_blocks(entry: Entry, shape: tuple[int, ...]) -> str:
    """Why NVFP4 cannot block the linear (K or N not a multiple of 16), or ""."""
    k, n = shape[-2:]
    if k % BLOCK or n % BLOCK:
        return f"K={k} and N={n} must be multiples of 16"
    return ""


def restack(params: Mapping, source: ModelSpec, target: ModelSpec) -> dict:
    """MaxText's tree of `source` (scanned or not) laid out as `target`'s (same model)."""
    by_hf = {e.hf: layer_of(leaf(params, e.maxtext), e, source) for e in entries(source)}
    flat = {}
    for leaf_path, group in by_leaf(entries(target)).items():
        flat[leaf_path] = stack(group, [np.asarray(by_hf[e.hf]) for e in group], target)
    return nested(flat)
