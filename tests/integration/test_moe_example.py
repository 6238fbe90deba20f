"""The example's mixture-of-experts Llama (`--experts`): routing, NVFP4, flags, training, EP.

* the MoE block against a dense per-token reference (f32 experts, `recipe=None`): router
  softmax, top-k, renormalized weights, grouped SwiGLU experts, load-balancing loss;
* an all-NVFP4 MoE model: loss and gradients finite, the same bits from the same seed;
* the flags (`--experts`, `--top-k`, `--expert-intermediate`, `--aux-loss-coef`) and their
  errors, the rules reaching the experts (bf16-kept blocks), the same initial weights;
* a tiny `train_lm.py --experts 4 --top-k 2` run of both recipes, and an exact resume;
* expert parallelism: the expert kernels sharded along X over 8 CPU devices, one train step
  gives one device's loss and load-balancing loss bit for bit, its updated parameters to a
  few f32 ulps (the two programs' f32 router math and the clipping's sum differ in order).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_same_bits
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import nvfp4_jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
import lm_model
import train_lm

# A one-block model, every layer in NVFP4 (--bf16-last 0), with 4 experts top-2 of MLP size
# 48 (the dense 96 / 2). One head: the key/value width is 32, two NVFP4 blocks (a 16-wide
# axis is one block, which the native kernels' sharding rule cannot shard; see the EP test).
TINY = [
    *("--width", "32", "--depth", "1", "--heads", "1", "--batch", "8", "--seq-len", "32"),
    *("--bf16-last", "0"),
]
MOE = ["--experts", "4", "--top-k", "2"]
# One schedule for every training run here: they share the cached optimizer, so the compiled
# train and evaluation steps too.
STEPS = ["--steps", "4", "--lr", "1e-2"]


@pytest.fixture
def no_diagnostics(monkeypatch):
    """`train_lm.diagnose` returning the rules it would (no --suggest-share) without running
    `inspect_model`: 45 s for this model on 2 cores, covered by
    tests/model/test_rules_experts.py."""
    calls = []

    def rules_only(args, train, out, console):
        calls.append(args)
        return train_lm.model_rules(args)

    monkeypatch.setattr(train_lm, "diagnose", rules_only)
    return calls


def _experts(model) -> dict[str, nvfp4_jax.nnx.Experts]:
    return {
        "/".join(map(str, path)): module
        for path, module in nnx.iter_graph(model)
        if isinstance(module, nvfp4_jax.nnx.Experts)
    }


# --- the MoE block ---------------------------------------------------------------------------


def _reference(moe: lm_model.MoE, x: np.ndarray, top_k: int):
    """A token at a time in f64: (output, chosen experts, weights, load-balancing loss)."""
    gate = np.asarray(moe.gate.kernel[...], np.float64)
    kernels = {
        name: np.asarray(getattr(moe.experts, name).kernel[...], np.float64)
        for name in ("gate_proj", "up_proj", "down_proj")
    }
    tokens = x.reshape(-1, x.shape[-1]).astype(np.float64)
    out, chosen, weights, probs = np.zeros_like(tokens), [], [], []
    for i, token in enumerate(tokens):
        logits = token @ gate
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p, kind="stable")[:top_k]
        w = p[top] / p[top].sum()
        for e, w_e in zip(top, w, strict=True):
            h = token @ kernels["gate_proj"][e]
            h = h / (1 + np.exp(-h)) * (token @ kernels["up_proj"][e])
            out[i] += w_e * (h @ kernels["down_proj"][e])
        chosen.append(top)
        weights.append(w)
        probs.append(p)
    chosen, probs = np.array(chosen), np.array(probs)
    experts = gate.shape[1]
    share = np.bincount(chosen.reshape(-1), minlength=experts) / chosen.size
    aux = experts * np.sum(share * probs.mean(axis=0))
    return out.reshape(x.shape), chosen, np.array(weights), aux


@pytest.mark.parametrize("experts, top_k", [(4, 2), (4, 1), (3, 3)])
def test_moe_routes_like_a_dense_per_token_reference(experts, top_k):
    cfg = lm_model.LMConfig(width=32, depth=1, heads=2, experts=experts, top_k=top_k)
    moe = lm_model.MoE(cfg, nnx.Rngs(0))
    for name in ("gate_proj", "up_proj", "down_proj"):
        layer = getattr(moe.experts, name)
        assert layer.recipe is None and layer.kernel.shape[0] == experts
        layer.dtype = jnp.float32  # the example computes them in bf16; f32 for the reference
    x = np.random.default_rng(1).standard_normal((2, 24, 32)).astype(np.float32)
    y, aux = moe(jnp.asarray(x))
    expected, chosen, weights, expected_aux = _reference(moe, x, top_k)
    _, got_chosen, got_weights = moe.route(jnp.asarray(x.reshape(-1, 32)))
    np.testing.assert_array_equal(np.asarray(got_chosen), chosen)
    np.testing.assert_allclose(np.asarray(got_weights), weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_weights).sum(-1), 1.0, rtol=1e-6)
    assert len(np.unique(chosen)) == experts  # every expert gets tokens: a real test
    assert y.dtype == jnp.float32 and y.shape == x.shape
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(aux), expected_aux, rtol=1e-5)


def test_load_balancing_loss_is_one_for_a_uniform_router():
    probs = jnp.full((8, 4), 0.25)
    chosen = jnp.array([[0, 1], [2, 3]] * 4)
    assert float(lm_model.load_balancing_loss(probs, chosen)) == pytest.approx(1.0)
    # All tokens on expert 0 with all the probability: the worst, X.
    probs = jnp.zeros((8, 4)).at[:, 0].set(1.0)
    assert float(lm_model.load_balancing_loss(probs, jnp.zeros((8, 1), jnp.int32))) == 4.0


def test_moe_layout_and_hf_config():
    cfg = lm_model.LMConfig(width=32, depth=2, heads=2, experts=4, top_k=2)
    model = lm_model.TransformerLM(cfg, nnx.Rngs(0))
    shapes = {
        "/".join(map(str, path)): tuple(v.shape)
        for path, v in nnx.iter_graph(model)
        if isinstance(v, nnx.Param)
    }
    # The layout the Mixtral / Qwen3-MoE exporter maps: router (D, X), experts (X, in, out).
    f = cfg.expert_intermediate
    assert f == 48  # the dense 96 / top-2, a multiple of 16
    for i in range(2):
        assert shapes[f"layers/{i}/mlp/gate/kernel"] == (32, 4)
        assert shapes[f"layers/{i}/mlp/experts/gate_proj/kernel"] == (4, 32, f)
        assert shapes[f"layers/{i}/mlp/experts/up_proj/kernel"] == (4, 32, f)
        assert shapes[f"layers/{i}/mlp/experts/down_proj/kernel"] == (4, f, 32)
    assert not any("mlp/gate_proj" in path for path in shapes)
    config = cfg.hf_config()
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)
    assert config["intermediate_size"] == f
    # Mixtral's config gives one expert's MLP size; the dense one is not part of the model.
    loaded = lm_model.LMConfig.from_hf_config(config)
    assert dataclasses.replace(loaded, intermediate=cfg.intermediate) == cfg
    with pytest.raises(ValueError, match="top_k=3 must be from 1 to experts=2"):
        lm_model.LMConfig(width=32, heads=2, experts=2, top_k=3)
    with pytest.raises(ValueError, match="expert MLP size 40 must be a positive multiple of 16"):
        lm_model.LMConfig(width=32, heads=2, experts=2, expert_intermediate=40)


def test_nvfp4_moe_loss_and_gradients_are_finite_and_reproducible():
    cfg = lm_model.LMConfig(
        width=32, depth=1, heads=2, experts=4, top_k=2, recipe=nvfp4_jax.NVFP4Recipe()
    )
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 17)), jnp.int32)

    @nnx.jit
    def loss_and_grads(model, batch):
        return nnx.value_and_grad(lm_model.train_loss_fn, has_aux=True)(model, batch)

    def run():
        model = lm_model.TransformerLM(cfg, nnx.Rngs(params=0, quantize=1))
        assert all(e.recipe == cfg.recipe for e in _experts(model).values())
        (total, (loss, aux)), grads = loss_and_grads(model, batch)
        return total, loss, aux, nnx.to_pure_dict(grads)

    first, again = run(), run()
    total, loss, aux, grads = first
    assert math.isfinite(float(loss)) and 1 <= float(aux) <= 4
    assert float(total) == pytest.approx(float(loss) + 0.01 * float(aux), rel=1e-6)
    mlp = grads["layers"][0]["mlp"]
    for name in ("gate_proj", "up_proj", "down_proj"):
        g = np.asarray(mlp["experts"][name]["kernel"])
        assert np.isfinite(g).all() and (np.abs(g).reshape(4, -1).max(axis=1) > 0).any(), name
    assert np.abs(np.asarray(mlp["gate"]["kernel"])).max() > 0  # the router learns
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again), strict=True):
        assert_same_bits(a, b, "a second model from the same seed")


# --- the command line --------------------------------------------------------------------------


def _usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as info:
        train_lm.parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


BAD_FLAGS = {
    "experts-negative": (["--experts", "-1"], "argument --experts: must be an integer >= 0"),
    "top-k-0": (["--experts", "4", "--top-k", "0"], "argument --top-k: must be a positive"),
    "top-k-past-experts": (["--experts", "2", "--top-k", "3"], "--top-k 3 is more than --experts"),
    "top-k-without-experts": (["--top-k", "2"], "--top-k needs --experts"),
    "expert-intermediate-40": (
        ["--experts", "4", "--expert-intermediate", "40"],
        "argument --expert-intermediate: must be a positive multiple of 16",
    ),
    "expert-intermediate-without-experts": (
        ["--expert-intermediate", "64"],
        "--expert-intermediate needs --experts",
    ),
    "aux-loss-coef-negative": (
        ["--experts", "4", "--aux-loss-coef", "-1"],
        "argument --aux-loss-coef: must be a finite number >= 0",
    ),
    "aux-loss-coef-nan": (["--experts", "4", "--aux-loss-coef", "nan"], "finite number >= 0"),
    "aux-loss-coef-without-experts": (["--aux-loss-coef", "0"], "--aux-loss-coef needs --experts"),
}


@pytest.mark.parametrize("flags, message", list(BAD_FLAGS.values()), ids=list(BAD_FLAGS))
def test_bad_moe_flags_exit_with_a_message(flags, message, capsys):
    assert message in _usage_error(capsys, flags)


def test_moe_flag_defaults():
    args = train_lm.parse_args(["--experts", "4"])
    assert (args.top_k, args.aux_loss_coef) == (2, 0.01)
    cfg = train_lm.model_config(args, "bf16")
    assert (cfg.experts, cfg.top_k, cfg.intermediate, cfg.expert_intermediate) == (4, 2, 352, 176)
    assert train_lm.parse_args(["--experts", "1"]).top_k == 1
    assert train_lm.model_config(train_lm.parse_args([]), "bf16").experts == 0
    args = train_lm.parse_args(["--experts", "8", "--top-k", "1", "--expert-intermediate", "64"])
    assert train_lm.model_config(args, "bf16").expert_intermediate == 64


def test_rules_reach_the_experts_and_both_runs_start_equal():
    # Two blocks, the last kept in bf16 (--bf16-last 2: it and the head): its experts too.
    args = train_lm.parse_args([*TINY, *MOE, "--depth", "2", "--bf16-last", "2"])
    nvfp4, bf16 = train_lm.make_model(args, "nvfp4"), train_lm.make_model(args, "bf16")
    recipes = {path: layer.recipe for path, layer in _experts(nvfp4).items()}
    assert recipes.keys() == {
        f"layers/{i}/mlp/experts/{name}"
        for i in (0, 1)
        for name in ("gate_proj", "up_proj", "down_proj")
    }
    for path, recipe in recipes.items():
        assert (recipe is None) == path.startswith("layers/1/"), path
    assert all(layer.recipe is None for layer in _experts(bf16).values())
    assert isinstance(nvfp4.layers[0].mlp.gate, lm_model.Router)  # no rule makes it NVFP4
    params = [nnx.to_pure_dict(nnx.state(m, nnx.Param)) for m in (nvfp4, bf16)]
    for a, b in zip(jax.tree.leaves(params[0]), jax.tree.leaves(params[1]), strict=True):
        assert_same_bits(a, b, "the initial weights")
    keep = train_lm.parse_args([*TINY, *MOE, "--keep-bf16", "experts"])
    assert all(e.recipe is None for e in _experts(train_lm.make_model(keep, "nvfp4")).values())


# --- training ----------------------------------------------------------------------------------


def test_tiny_moe_trains_with_both_recipes(tmp_path, capsys, no_diagnostics):
    flags = [*TINY, *MOE, *STEPS, "--eval-every", "2", "--out", str(tmp_path)]
    results = train_lm.main(flags)
    assert no_diagnostics and no_diagnostics[0].experts == 4
    out = capsys.readouterr().out
    assert "mixture of experts: 4 experts of MLP size 48, top-2" in out
    assert "aux loss" in out  # the summary's column
    for name in ("nvfp4", "bf16"):
        history = results["histories"][name]
        assert history["step"] == [1, 2, 3, 4] and len(history["val_loss"]) == 2
        assert all(map(math.isfinite, history["train_loss"] + history["val_loss"]))
        assert all(1 <= aux <= 4 for aux in history["aux_loss"])  # X * sum f P, 1 if uniform
        assert history["val_loss"][-1] < 5.0  # uniform bytes: ln(256) = 5.55
        assert results["results"][name]["step_ms"] > 0
    # The same initial weights and batches: the first losses are close, not equal (NVFP4).
    first = [results["histories"][name]["train_loss"][0] for name in ("nvfp4", "bf16")]
    assert first[0] != first[1] and abs(first[0] - first[1]) < 0.05 * first[1]
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["results"]["nvfp4"]["final_aux_loss"] >= 1
    assert written["config"]["experts"] == 4 and written["config"]["top_k"] == 2


def test_moe_resume_continues_exactly(tmp_path, capsys, no_diagnostics):
    flags = [*TINY, *MOE, *STEPS, "--recipe", "nvfp4", "--eval-every", "2", "--save-every", "2"]
    straight = train_lm.main([*flags, "--out", str(tmp_path / "a")])["histories"]["nvfp4"]
    train_lm.main([*flags, "--out", str(tmp_path / "b"), "--stop-after", "2"])
    resumed = train_lm.main([*flags, "--out", str(tmp_path / "b"), "--resume"])
    resumed = resumed["histories"]["nvfp4"]
    for key in ("step", "train_loss", "aux_loss", "val_loss"):
        assert resumed[key] == straight[key], key
    # Another number of experts is another model: the checkpoint says which.
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train_lm.main([*flags, "--out", str(tmp_path / "b"), "--resume", "--experts", "8"])
    assert "was made with --experts 4 (now 8)" in capsys.readouterr().err


# --- expert parallelism --------------------------------------------------------------------------

EP_AXIS = "expert"


def _place(tree, sharding_of):
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jax.device_put(x, sharding_of(jax.tree_util.keystr(path), x)), tree
    )


@nnx.jit
def _step_with_grads(model, optimizer, batch):
    """`train_lm.train_step` that also returns the gradients it applies."""
    loss, aux, grads = train_lm._loss_and_grads(model, batch)
    optimizer.update(model, grads)
    return loss, aux, nnx.to_pure_dict(grads)


def _train_step(args, batch, sharding_of=None):
    """One training step of the NVFP4 model (`_step_with_grads`), its state and batch placed
    by `sharding_of(path, array)` (None: left as made, on the default device); returns
    (loss, aux, gradients, updated params, the model)."""
    model = train_lm.make_model(args, "nvfp4")
    optimizer = train_lm.make_optimizer(model, args)
    if sharding_of is not None:
        nnx.update((model, optimizer), _place(nnx.state((model, optimizer)), sharding_of))
        batch = _place(batch, sharding_of)
    loss, aux, grads = _step_with_grads(model, optimizer, batch)
    return loss, aux, grads, nnx.to_pure_dict(nnx.state(model, nnx.Param)), model


@pytest.mark.skipif(jax.device_count("cpu") < 8, reason="needs 8 CPU devices")
def test_experts_sharded_over_devices_train_like_one_device():
    args = train_lm.parse_args([*TINY, *MOE, *STEPS])
    batch = train_lm.batch_at(train_lm.load_text(None), 1, args.batch, args.seq_len, 0)
    # 8 devices: the 4 experts over the "expert" axis, the other axis holds copies.
    mesh = jax.make_mesh(
        (4, 2), (EP_AXIS, "copy"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices("cpu")
    )

    def expert_parallel(path: str, x):
        # Every array of the experts with a leading X axis (kernels, their Adam moments,
        # calibration amaxes) split over the expert axis, one expert per device pair.
        split = "'experts'" in path and x.ndim >= 1 and x.shape[0] == 4
        return NamedSharding(mesh, P(EP_AXIS) if split else P())

    loss_1, aux_1, grads_1, params_1, _ = _train_step(args, batch)
    assert jax.tree.leaves(params_1)[0].devices() == {jax.devices("cpu")[0]}
    loss_8, aux_8, grads_8, params_8, model = _train_step(args, batch, expert_parallel)
    kernel = model.layers[0].mlp.experts.gate_proj.kernel[...]
    assert kernel.sharding.spec == P(EP_AXIS) and len(kernel.sharding.device_set) == 8
    assert kernel.addressable_shards[0].data.shape == (1, 32, 48)
    # The loss and load-balancing loss: the same bits. The experts' gradients are too (the
    # NVFP4 GEMMs' operands are quantized alike, sharded or not), but XLA compiles the two
    # programs' f32 router math differently (e.g. the renormalization's divide is a multiply
    # by the reciprocal in one), and clipping sums the squared gradients across devices:
    # a few parameters move by a few f32 ulps of their update (Adam's step is about lr =
    # 3e-3 here, so an absolute tolerance of 1e-7 is a few hundredths of a step; a relative
    # one alone fails for a parameter that the step takes near zero).
    assert_same_bits(loss_8, loss_1, "loss")
    assert_same_bits(aux_8, aux_1, "load-balancing loss")
    flat_1 = jax.tree_util.tree_flatten_with_path(params_1)[0]
    for (path, a), b in zip(flat_1, jax.tree.leaves(params_8), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    # The experts' gradients themselves: bit for bit.
    flat_1 = jax.tree_util.tree_flatten_with_path(grads_1)[0]
    experts = 0
    for (path, a), b in zip(flat_1, jax.tree.leaves(grads_8), strict=True):
        if "'experts'" in jax.tree_util.keystr(path):
            assert_same_bits(b, a, jax.tree_util.keystr(path))
            experts += 1
    assert experts == 3 * args.depth
