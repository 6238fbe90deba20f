"""The Hugging Face name maps (nvfp4_jax/_src/io/hf/names.py): the Llama map and the
mixture-of-experts maps (Qwen3-MoE, Mixtral) both ways, and the checks of a rule.
"""

from __future__ import annotations

import pytest

import nvfp4_jax
from nvfp4_jax import hf

# --- the name map ---------------------------------------------------------------------------


def test_llama_name_map_both_ways():
    nm = hf.llama_name_map()
    cases = {
        "layers/3/self_attn/q_proj/kernel": ("model.layers.3.self_attn.q_proj.weight", "linear", 2),
        "layers/3/mlp/down_proj/kernel": ("model.layers.3.mlp.down_proj.weight", "linear", 2),
        "layers/3/input_layernorm/scale": ("model.layers.3.input_layernorm.weight", "norm", 1),
        "layers/0/self_attn/q_norm/scale": ("model.layers.0.self_attn.q_norm.weight", "norm", 1),
        "layers/0/self_attn/q_proj/bias": ("model.layers.0.self_attn.q_proj.bias", "plain", 1),
        "norm/scale": ("model.norm.weight", "norm", 1),
        "embed_tokens/embedding": ("model.embed_tokens.weight", "embedding", 2),
        "lm_head/kernel": ("lm_head.weight", "linear", 2),
    }
    for path, (name, kind, ndim) in cases.items():
        assert nm.to_hf(path) == (name, kind), path
        assert nm.to_flax(name, ndim) == (path, kind), name
    assert nm.to_hf("rngs/quantize/count") is None
    assert nm.to_flax("model.layers.0.mlp.up_proj.weight_scale", 2) is None


def test_name_rules_are_checked():
    with pytest.raises(ValueError, match="same fields"):
        hf.NameRule("{a}/kernel", "model.{b}.weight", "linear")
    with pytest.raises(ValueError, match="kind"):
        hf.NameRule("x", "y", "conv")
    with pytest.raises(ValueError, match="end in '.weight'"):
        hf.NameRule("x/kernel", "x.w", "linear")
    custom = hf.NameMap([("blocks/{i}/attn/{p}/w", "transformer.h.{i}.attn.{p}.weight", "linear")])
    assert custom.to_hf("blocks/2/attn/c_attn/w") == (
        "transformer.h.2.attn.c_attn.weight",
        "linear",
    )
    assert custom.to_flax("transformer.h.2.attn.c_attn.weight") == (
        "blocks/2/attn/c_attn/w",
        "linear",
    )


# --- the mixture-of-experts name maps ------------------------------------------------------


def test_moe_name_maps_both_ways():
    qwen, mixtral = hf.qwen3_moe_name_map(), nvfp4_jax.mixtral_name_map()
    assert nvfp4_jax.qwen3_moe_name_map().rules == qwen.rules
    experts = "layers/1/mlp/experts/up_proj/kernel"
    assert qwen.to_hf(experts) == ("model.layers.1.mlp.experts.{expert}.up_proj.weight", "experts")
    assert mixtral.to_hf(experts) == (
        "model.layers.1.block_sparse_moe.experts.{expert}.w3.weight",
        "experts",
    )
    assert hf.NameMap.expert_names(qwen.to_hf(experts)[0], 2) == [
        "model.layers.1.mlp.experts.0.up_proj.weight",
        "model.layers.1.mlp.experts.1.up_proj.weight",
    ]
    for name_map, name in (
        (qwen, "model.layers.1.mlp.experts.12.up_proj.weight"),
        (mixtral, "model.layers.1.block_sparse_moe.experts.12.w3.weight"),
    ):
        assert name_map.to_flax(name, 2) == (experts, "experts")
        assert name_map.expert_of(name, 2) == 12
    for name_map, router in (
        (qwen, "model.layers.0.mlp.gate"),
        (mixtral, "model.layers.0.block_sparse_moe.gate"),
    ):
        assert name_map.to_hf("layers/0/mlp/gate/kernel") == (f"{router}.weight", "router")
        assert name_map.to_flax(f"{router}.weight", 2) == ("layers/0/mlp/gate/kernel", "router")
        assert name_map.expert_of(f"{router}.weight", 2) is None
    # The rest is Llama's: attention, Qwen3's q_norm/k_norm, dense MLPs (mlp_only_layers).
    assert qwen.to_hf("layers/0/self_attn/q_norm/scale") == (
        "model.layers.0.self_attn.q_norm.weight",
        "norm",
    )
    assert mixtral.to_hf("layers/3/mlp/gate_proj/kernel") == (
        "model.layers.3.mlp.gate_proj.weight",
        "linear",
    )
    assert ("w1", "w3") in hf.DEFAULT_FUSED_GROUPS


def test_experts_rules_are_checked():
    with pytest.raises(ValueError, match=r"\.\{expert\}\."):
        hf.NameRule("e/{p}/kernel", "experts.{p}.weight", "experts")
    with pytest.raises(ValueError, match="must not hold"):
        hf.NameRule("e/{expert}/kernel", "m.experts.{expert}.weight", "experts")
    with pytest.raises(ValueError, match="must end in '.weight'"):
        hf.NameRule("r/kernel", "m.r.w", "router")
    with pytest.raises(ValueError, match="same fields"):
        hf.NameRule("e/{p}/kernel", "m.experts.{expert}.{q}.weight", "experts")
    custom = hf.NameMap([("moe/{i}/w_in", "h.{i}.moe.experts.{expert}.fc1.weight", "experts")])
    assert custom.to_flax("h.2.moe.experts.7.fc1.weight") == ("moe/2/w_in", "experts")
    assert custom.to_flax("h.2.moe.experts.07.fc1.weight") is None  # one spelling per index
    # A field merely named "expert" in another kind is an ordinary field.
    plain = hf.NameMap([("x/{expert}/kernel", "m.{expert}.weight", "linear")])
    assert plain.to_flax("m.abc.weight") == ("x/abc/kernel", "linear")
