"""Generates text with the example Llama in JAX, with a KV cache, in bf16 and in NVFP4.

    python examples/generate.py                                  # a random model, for timing
    python examples/generate.py --checkpoint runs/train_lm --prompt "def f(x):" --tokens 200
    python examples/generate.py --hf out/llama-nvfp4             # an exported/ModelOpt folder
    python examples/generate.py --width 1024 --depth 8 --heads 8 # a larger random model
    python examples/generate.py --kv-cache nvfp4                 # the KV cache in NVFP4

The model is `lm_model.TransformerLM` (a `train_lm.py` run folder or one of its checkpoint
folders, a Hugging Face / ModelOpt checkpoint read by `nvfp4_jax.load_hf_checkpoint`, or
random weights of the example's default size). Of a Hugging Face folder it computes what its
`config.json` says, Llama's attention and MLP biases and tied embeddings included; a setting
the model does not compute (rope scaling, a sliding window, qk-norm, another architecture:
`lm_model.LMConfig.from_hf_config`), or weights that config's model does not hold or lacks,
exit with status 2 naming the key or the weight. Decoding is greedy (or sampled with
`--temperature`): the prompt is prefilled in one call, then one token per step with a jitted
step over (weights, cache, token, position) and a KV cache preallocated to the prompt's
length plus `--tokens`, updated in place. The math is lm_model's (its own modules compute
every layer; only attention reads the cache). The cache (`--kv-cache`):

* bf16 (the default): each layer's keys and values (B, length, G, E) in bf16, written with
  `jax.lax.dynamic_update_slice`, read by `jax.nn.dot_product_attention`.
* nvfp4, nvfp4_4over6: `nvfp4_jax.kv_cache`, vLLM's `--kv-cache-dtype` of the same name: each
  layer's keys and values in NVFP4 pages (9/32 of bf16's bytes at head size 128), appended in
  place, read by `nvfp4_jax.kv_cache.attention` (on the CPU the native kernel, which decodes
  the blocks in registers; the prefill over the dequantized cache). Each layer's decode scales
  are the checkpoint's `k_scale` / `v_scale` (a `--hf` export with KV scales), else
  `kv_cache.scale_from_amax` of the prompt's keys and values (calibrated by the prefill).

Two precisions of the same weights:

* bf16: every linear kernel cast to bf16 (embeddings and norms stay f32, as in training).
* nvfp4: the weights `nvfp4_jax.export_hf_checkpoint(..., quant_algo="W4A16_NVFP4")`
  writes, read back (`export_nvfp4`), so the text is the one an engine serving that export
  decodes: each linear quantized along its input axis in 16x16 blocks with the tensor amax of
  its fused group (q/k/v, gate/up), an MoE's experts each with their own tensor amax (gate
  and up sharing theirs), a train_lm NVFP4 run's linears as its rules trained them (in NVFP4
  or bf16, with the run's weight Four Over Six); the output head, embeddings, norms and an
  MoE's router stay as in bf16. They run frozen, weight-only (W4A16:
  `nvfp4_jax.nnx.Linear.from_quantized`, whose CPU path is the native `nvfp4_w4a16` kernel
  up to 32 rows; `nvfp4_jax.nnx.Experts.from_quantized`). With `--hf`, the weights are used
  as loaded: NVFP4 ones as they are (a Mixtral's experts too), and bf16 runs their
  dequantized values; a folder without NVFP4 weights is exported as above.

Prints, per precision, the prefill time, the decode tokens/s (median step after the first,
which compiles; times `--batch`) and the text, then how often NVFP4's tokens equal bf16's.
Every flag is checked before anything runs: a bad value exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from lm_model import LMConfig, MoE, TransformerLM, from_params

import nvfp4_jax
from nvfp4_jax import gemm, kernels, kv_cache

PRECISIONS = ("bf16", "nvfp4")
KV_CACHES = ("bf16", "nvfp4", "nvfp4_4over6")
DEFAULT_PROMPT = "The "
MAX_TOKENS = 1 << 16


class UsageError(Exception):
    """A command-line problem found after parsing (a checkpoint); exits like argparse."""


def _integer(low: int, high: int | None = None):
    """An argparse `type`: an integer in [low, high]."""
    what = f"an integer from {low} to {high}" if high is not None else f"an integer >= {low}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    return parse


def _non_negative_float(text: str) -> float:
    """An argparse `type`: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}") from None
    if not (np.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _folder(text: str) -> pathlib.Path:
    """An argparse `type`: an existing folder."""
    path = pathlib.Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a folder")
    return path


def build_parser() -> argparse.ArgumentParser:
    """The command line; each flag's `type` checks its own value."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--checkpoint",
        type=_folder,
        default=None,
        metavar="DIR",
        help="a train_lm.py --out folder, or one of its checkpoints/<recipe> folders",
    )
    source.add_argument(
        "--hf", type=_folder, default=None, metavar="DIR", help="a Hugging Face / ModelOpt folder"
    )
    p.add_argument(
        "--run",
        choices=("nvfp4", "bf16"),
        default=None,
        help="which run of a --checkpoint folder holding both (default: nvfp4)",
    )
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt, read as UTF-8 bytes")
    p.add_argument("--tokens", type=_integer(1, MAX_TOKENS), default=128, help="new tokens")
    p.add_argument("--batch", type=_integer(1, 1024), default=1, help="copies of the prompt")
    p.add_argument("--precision", choices=(*PRECISIONS, "both"), default="both")
    p.add_argument(
        "--kv-cache",
        choices=KV_CACHES,
        default="bf16",
        help="the KV cache: bf16, or NVFP4 (vLLM's nvfp4 / nvfp4_4over6 bytes)",
    )
    p.add_argument(
        "--temperature",
        type=_non_negative_float,
        default=0.0,
        help="0 (the default): greedy; else sample from softmax(logits / temperature)",
    )
    p.add_argument(
        "--seed", type=_integer(0, 2**32 - 1), default=0, help="random weights, sampling"
    )
    # The random model's shape (neither --checkpoint nor --hf); None: lm_model's defaults.
    p.add_argument("--width", type=_integer(16), default=None, help="random model only")
    p.add_argument("--depth", type=_integer(1), default=None, help="random model only")
    p.add_argument("--heads", type=_integer(1), default=None, help="random model only")
    p.add_argument(
        "--experts",
        type=_integer(1),
        default=None,
        help="random model only: a mixture of E experts in every block (top-2) for the MLP",
    )
    return p


def parse_args(argv=None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parses and checks the command line; bad values exit with a message naming the flag."""
    p = build_parser() if parser is None else parser
    args = p.parse_args(argv)
    loaded = args.checkpoint is not None or args.hf is not None
    for name in ("width", "depth", "heads", "experts"):
        if loaded and getattr(args, name) is not None:
            p.error(f"--{name} sets the random model's shape: not with --checkpoint or --hf")
    if args.run is not None and args.checkpoint is None:
        p.error("--run picks a run of a --checkpoint folder: it needs --checkpoint")
    if not args.prompt.encode("utf-8"):
        p.error("--prompt must not be empty (the first token needs a context)")
    if not loaded:
        try:
            random_config(args)
        except ValueError as error:
            p.error(f"--width/--depth/--heads/--experts make no working model: {error}")
    return args


# --- the weights -------------------------------------------------------------------------------


def random_config(args) -> LMConfig:
    """The random model's shape: lm_model's defaults, changed by --width/--depth/--heads/
    --experts."""
    keys = ("width", "depth", "heads", "experts")
    shape = {k: getattr(args, k) for k in keys if getattr(args, k, None)}
    return LMConfig(**shape)


def _plain(tree):
    """A restored nnx state as nested dicts of arrays: `value` wrappers dropped, int keys."""
    if isinstance(tree, dict):
        if set(tree) == {"value"}:
            return tree["value"]
        return {
            (int(k) if isinstance(k, str) and k.isdigit() else k): _plain(v)
            for k, v in tree.items()
        }
    return tree


PARAM_NAMES = ("kernel", "scale", "embedding", "bias")


def _params_only(tree: dict) -> dict:
    """The parameters of a model state (kernels, biases, norm scales, embeddings), without
    the NVFP4 layers' calibration amaxes and random streams."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            if inner := _params_only(value):
                out[key] = inner
        elif key in PARAM_NAMES:
            out[key] = np.asarray(value)
    return out


def _checkpoint_folder(folder: pathlib.Path, run: str | None) -> pathlib.Path:
    """The orbax folder of one run: `folder/checkpoints/<run>`, or `folder` itself."""
    if (folder / "checkpoints").is_dir():
        runs = [r for r in ("nvfp4", "bf16") if (folder / "checkpoints" / r).is_dir()]
        if run is not None:
            runs = [r for r in runs if r == run]
        if not runs:
            want = f"a {run} run" if run else "no run"
            raise UsageError(f"--checkpoint {folder}: {want} in {folder / 'checkpoints'}")
        return folder / "checkpoints" / runs[0]
    if run is not None:
        raise UsageError(f"--run {run}: --checkpoint {folder} is one run's folder already")
    return folder


def load_train_lm(folder: pathlib.Path, run: str | None) -> tuple[LMConfig, dict, list | None]:
    """(shape, parameters as nested dicts, the rules of an NVFP4 run or None) of a train_lm
    checkpoint."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    folder = _checkpoint_folder(folder, run)
    manager = ocp.CheckpointManager(
        folder.resolve(), options=ocp.CheckpointManagerOptions(create=False)
    )
    step = manager.latest_step()
    if step is None:
        raise UsageError(f"--checkpoint {folder}: no orbax checkpoint in it")
    restored = manager.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(), config=ocp.args.JsonRestore()),
    )
    flags = restored["config"]
    cfg = LMConfig(
        width=flags["width"],
        depth=flags["depth"],
        heads=flags["heads"],
        max_len=flags["seq_len"],
        experts=flags.get("experts", 0),
        top_k=flags.get("top_k", 2),
        expert_intermediate=flags.get("expert_intermediate"),
    )
    state = _plain(restored["state"]["model"])
    print(f"checkpoint: {folder} step {step}", flush=True)
    return cfg, _params_only(state), _run_rules(flags, state)


def _has_nvfp4_layers(tree: dict) -> bool:
    """Whether a model state holds NVFP4 layers (their calibration amax marks them)."""
    return "input_amax" in tree or any(
        _has_nvfp4_layers(v) for v in tree.values() if isinstance(v, dict)
    )


def _run_rules(flags: dict, state: dict) -> list | None:
    """The rules a train_lm NVFP4 run trained with (which linears in NVFP4, with which weight
    Four Over Six): the ones its checkpoint saved, or for a checkpoint saved before train_lm
    saved them, the ones its flags make. None for a bf16 run (no NVFP4 layer)."""
    import train_lm  # noqa: PLC0415  (its imports are heavy; only --checkpoint needs it)

    saved = train_lm.trained_rules(flags)
    if saved is not None or not _has_nvfp4_layers(state):
        return saved
    return train_lm.model_rules(argparse.Namespace(**(train_lm.RESUME_DEFAULTS | flags)))


def export_nvfp4(cfg: LMConfig, params: dict, *, config: dict | None = None, rules=None):
    """The weights `export_hf_checkpoint` writes for `params`, read back by `load_hf_checkpoint`.

    Weight-only (`quant_algo="W4A16_NVFP4"`), with the exporter's every other default: each
    linear quantized along `in` in 16x16 blocks with its fused group's tensor amax (q/k/v,
    gate/up), an MoE's experts each with their own (gate and up sharing theirs); the head,
    embeddings, norms and routers in high precision; `rules` (a train_lm NVFP4 run's) decide
    which linears were trained in NVFP4 and with which weight Four Over Six. `dtype=None`:
    the high-precision tensors keep their dtype, so that they are bf16's own.
    """
    name_map = nvfp4_jax.hf.mixtral_name_map() if cfg.experts else None
    with tempfile.TemporaryDirectory(prefix="generate-") as folder:
        target = pathlib.Path(folder) / "export"
        nvfp4_jax.export_hf_checkpoint(
            target,
            params,
            name_map=name_map,
            quant_algo="W4A16_NVFP4",
            config=cfg.hf_config() if config is None else config,
            rules=rules,
            dtype=None,
        )
        # The arrays are read into device memory: they outlive the folder.
        return nvfp4_jax.load_hf_checkpoint(target, name_map=name_map)


def dequantize_params(params: dict) -> dict:
    """The parameters with every NVFP4 kernel decoded to bf16 (and no `input_scale`)."""

    def walk(node):
        if not isinstance(node, dict):
            return node
        return {
            k: (nvfp4_jax.dequantize(v, jnp.bfloat16) if nvfp4_jax.is_nvfp4_array(v) else walk(v))
            for k, v in node.items()
            if k != "input_scale"
        }

    return walk(params)


def _without_kv_scales(tree):
    """The parameters without a checkpoint's KV-cache scales (`k_scale`, `v_scale` leaves
    beside `k_proj` / `v_proj`: the cache's, not the model's; `kv_scales` reads them)."""
    if not isinstance(tree, dict):
        return tree
    return {k: _without_kv_scales(v) for k, v in tree.items() if k not in ("k_scale", "v_scale")}


def build_model(cfg: LMConfig, params: dict) -> TransformerLM:
    """The example model holding `params` (NVFP4Array kernels frozen weight-only), computing
    in bf16, with every high-precision linear kernel stored in bf16."""
    model = from_params(cfg, _without_kv_scales(params), dtype=jnp.bfloat16)
    for _, module in nnx.iter_modules(model):
        if type(module) is nnx.Linear:
            module.kernel = nnx.Param(module.kernel[...].astype(jnp.bfloat16))
    return model


def load_weights(args) -> tuple[LMConfig, dict[str, dict], str]:
    """(shape, {precision: parameter tree}, a line saying where the weights came from)."""
    if args.hf is not None:
        if not (args.hf / "config.json").is_file():
            raise UsageError(f"--hf {args.hf}: no config.json, not a Hugging Face checkpoint")
        return load_hf(args.hf)
    if args.checkpoint is not None:
        try:
            cfg, params, rules = load_train_lm(args.checkpoint, args.run)
            nvfp4 = export_nvfp4(cfg, params, rules=rules)
        except (FileNotFoundError, KeyError, TypeError, ValueError) as error:
            raise UsageError(f"--checkpoint {args.checkpoint}: cannot load it ({error})") from None
        return cfg, {"bf16": params, "nvfp4": nvfp4}, f"--checkpoint {args.checkpoint}"
    cfg = random_config(args)
    model = TransformerLM(cfg, nnx.Rngs(params=args.seed))
    params = _params_only(_plain(nnx.to_pure_dict(nnx.state(model))))
    what = f"random weights (seed {args.seed})"
    return cfg, {"bf16": params, "nvfp4": export_nvfp4(cfg, params)}, what


def load_hf(folder: pathlib.Path) -> tuple[LMConfig, dict[str, dict], str]:
    """`load_weights` of a Hugging Face folder: its weights as loaded (NVFP4 ones as they are;
    bf16 runs their dequantized values); a folder without NVFP4 weights exported as NVFP4."""
    try:
        config = json.loads((folder / "config.json").read_text())
        # Refuses a config.json setting the example's model does not compute, naming it.
        cfg = LMConfig.from_hf_config(config)
        # A Mixtral's experts load stacked (E, in, out), as the example's MoE holds them.
        name_map = nvfp4_jax.hf.mixtral_name_map() if cfg.experts else None
        tree = nvfp4_jax.load_hf_checkpoint(folder, name_map=name_map)
        leaves = jax.tree.leaves(tree, is_leaf=nvfp4_jax.is_nvfp4_array)
        quantized = any(nvfp4_jax.is_nvfp4_array(x) for x in leaves)
        nvfp4 = tree if quantized else export_nvfp4(cfg, tree, config=config)
    except (KeyError, TypeError, ValueError, OSError) as error:
        raise UsageError(f"--hf {folder}: cannot load it ({error})") from None
    return cfg, {"bf16": dequantize_params(tree), "nvfp4": nvfp4}, f"--hf {folder}"


# --- decoding ----------------------------------------------------------------------------------


def rotary_at(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """`lm_model.rotary` of (B, T, heads, E) at absolute `positions` (T,)."""
    e = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, e, 2, dtype=jnp.float32) / e))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[None, :, None, :]
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., e // 2 :], xf[..., : e // 2]], axis=-1)
    return (xf * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


def kv_config(cfg: LMConfig, kind: str) -> kv_cache.KVCacheConfig | None:
    """The NVFP4 cache's `KVCacheConfig` for `--kv-cache kind`, None for bf16.

    vLLM's defaults (16-token pages, HND, V scales swizzled); a head size that is not a
    multiple of 64 stores linear scales (vLLM's 4-token interleave needs 4 scale groups).
    """
    if kind == "bf16":
        return None
    return kv_cache.KVCacheConfig(
        kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        scale_swizzle="v" if cfg.head_dim % 64 == 0 else "none",
        four_over_six=kind == "nvfp4_4over6",
    )


def empty_cache(cfg: LMConfig, batch: int, length: int, kind: str = "bf16", scales=None):
    """The KV cache, empty: a tuple of one cache per layer, each either bf16 keys and values
    (B, length, G, E) as a dict {"k", "v"}, or a `kv_cache.NVFP4KVCache` (its `scales[i]` =
    (k_scale, v_scale), or 1.0 until the prefill calibrates them). One buffer per layer and
    side, so that a donated cache is updated in place (a stack of the layers would be copied
    whole every step)."""
    config = kv_config(cfg, kind)
    if config is None:
        shape = (batch, length, cfg.kv_heads, cfg.head_dim)
        return tuple(
            {"k": jnp.zeros(shape, jnp.bfloat16), "v": jnp.zeros(shape, jnp.bfloat16)}
            for _ in range(cfg.depth)
        )
    scales = [(1.0, 1.0)] * cfg.depth if scales is None else scales
    return tuple(
        kv_cache.init_cache(config, batch, length, k_scale=k_scale, v_scale=v_scale)
        for k_scale, v_scale in scales
    )


def _calibrated(layer_cache, k: jax.Array, v: jax.Array):
    """A layer's NVFP4 cache with the decode scales of these keys' and values' amaxes."""
    amax = [jnp.max(jnp.abs(x.astype(jnp.float32))) for x in (k, v)]
    scales = [kv_cache.scale_from_amax(a) for a in amax]
    return dataclasses.replace(layer_cache, k_scale=scales[0], v_scale=scales[1])


def _attend(cache, i: int, q, k, v, pos, mask, calibrate: bool):
    """Layer i's attention output (B, T, H, E) and layer i's cache, the new tokens written."""
    if isinstance(cache[i], dict):
        start = (0, pos, 0, 0)
        k_all = jax.lax.dynamic_update_slice(cache[i]["k"], k.astype(jnp.bfloat16), start)
        v_all = jax.lax.dynamic_update_slice(cache[i]["v"], v.astype(jnp.bfloat16), start)
        attended = jax.nn.dot_product_attention(
            q, k_all.astype(q.dtype), v_all.astype(q.dtype), mask=mask
        )
        return attended, {"k": k_all, "v": v_all}
    layer = _calibrated(cache[i], k, v) if calibrate else cache[i]
    layer = kv_cache.append(layer, k, v, pos)
    return kv_cache.attention(q, layer, pos + k.shape[1]), layer


def forward_cached(
    model: TransformerLM, cache, tokens: jax.Array, pos: jax.Array, calibrate: bool = False
):
    """Logits (B, T, V) f32 of `tokens` (B, T) at positions pos..pos+T-1, reading and writing
    the cache (`empty_cache`'s); lm_model's forward with attention over the cached keys and
    values. With `calibrate` (an NVFP4 cache's prefill) each layer's decode scales are set
    from these tokens' keys and values first."""
    cfg = model.cfg
    b, t = tokens.shape
    positions = pos + jnp.arange(t, dtype=jnp.int32)
    mask = None
    if isinstance(cache[0], dict):
        length = cache[0]["k"].shape[1]
        # Query i (at pos + i) sees the cached positions j <= pos + i.
        mask = (jnp.arange(length, dtype=jnp.int32)[None, :] <= positions[:, None])[None, None]
    x = model.embed_tokens(tokens)
    layers = []
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).reshape(b, t, cfg.heads, cfg.head_dim)
        k = attn.k_proj(h).reshape(b, t, cfg.kv_heads, cfg.head_dim)
        v = attn.v_proj(h).reshape(b, t, cfg.kv_heads, cfg.head_dim)
        q, k = rotary_at(q, positions, cfg.rope_theta), rotary_at(k, positions, cfg.rope_theta)
        attended, written = _attend(cache, i, q, k, v, pos, mask, calibrate)
        layers.append(written)
        x = x + attn.o_proj(attended.reshape(b, t, cfg.heads * cfg.head_dim)).astype(x.dtype)
        y = layer.mlp(layer.post_attention_layernorm(x))
        y = y[0] if isinstance(layer.mlp, MoE) else y
        x = x + y.astype(x.dtype)
    logits = model.head(model.norm(x))
    return logits, tuple(layers)


def _pick(logits: jax.Array, temperature: float, key: jax.Array) -> jax.Array:
    """The next token (B,) int32 of the last position's logits (B, V)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


class Decoder:
    """Jitted prefill and decode step of one model; the weights are a jit argument.

    `kv_cache`: "bf16", "nvfp4" or "nvfp4_4over6"; `kv_scales`: an NVFP4 cache's (k_scale,
    v_scale) per layer, or None to calibrate them from the prompt in the prefill.
    """

    def __init__(
        self,
        model: TransformerLM,
        temperature: float = 0.0,
        kv_cache: str = "bf16",
        kv_scales: list | None = None,
    ):
        self.cfg = model.cfg
        self.kv_cache = kv_cache
        self.kv_scales = kv_scales
        self.graphdef, self.state = nnx.split(model)
        graphdef = self.graphdef
        calibrate = kv_cache != "bf16" and kv_scales is None

        def prefill(state, cache, tokens, key):
            model = nnx.merge(graphdef, state)
            logits, cache = forward_cached(model, cache, tokens, jnp.int32(0), calibrate)
            return _pick(logits[:, -1], temperature, key), logits, cache

        def step(state, cache, token, pos, key):
            model = nnx.merge(graphdef, state)
            logits, cache = forward_cached(model, cache, token[:, None], pos)
            return _pick(logits[:, -1], temperature, key), logits[:, -1], cache

        self.prefill = jax.jit(prefill, donate_argnums=1)
        self.step = jax.jit(step, donate_argnums=1)


def generate(decoder: Decoder, prompt: np.ndarray, new_tokens: int, seed: int = 0) -> dict:
    """Decodes `new_tokens` after `prompt` (B, P); returns the tokens (B, new_tokens), every
    step's logits (new_tokens, B, V) and the timings (seconds)."""
    b, p = prompt.shape
    tokens = jnp.asarray(prompt, jnp.int32)
    keys = jax.random.split(jax.random.key(seed), new_tokens)
    length = p + new_tokens

    def prefill():
        cache = empty_cache(decoder.cfg, b, length, decoder.kv_cache, decoder.kv_scales)
        begin = time.perf_counter()
        out = jax.block_until_ready(decoder.prefill(decoder.state, cache, tokens, keys[0]))
        return out, time.perf_counter() - begin

    _, prefill_first = prefill()  # compiles
    (token, logits, cache), prefill_seconds = prefill()
    out, all_logits, steps = [token], [logits[:, -1]], []
    for i in range(1, new_tokens):
        begin = time.perf_counter()
        token, step_logits, cache = decoder.step(
            decoder.state, cache, token, jnp.int32(p + i - 1), keys[i]
        )
        token = jax.block_until_ready(token)
        steps.append(time.perf_counter() - begin)
        out.append(token)
        all_logits.append(step_logits)
    steady = steps[1:] or steps
    step_seconds = float(np.median(steady)) if steady else float("nan")
    return {
        "tokens": np.stack([np.asarray(t) for t in out], axis=1),
        "logits": np.stack([np.asarray(x) for x in all_logits]),
        "prefill_first_seconds": prefill_first,
        "prefill_seconds": prefill_seconds,
        "first_step_seconds": steps[0] if steps else float("nan"),
        "step_seconds": step_seconds,
        "tokens_per_second": b / step_seconds if steady else float("nan"),
    }


# --- reporting ---------------------------------------------------------------------------------


def host_line() -> str:
    """The machine: CPU, the native CPU kernels' ISA variant, cores, load, jax."""
    isa = kernels.cpu_isa()
    if isa is None:
        isa = f"none (no native CPU kernels: {kernels.unavailable_reason('cpu')})"
    # /proc/cpuinfo is Linux's; elsewhere the CPU's name is platform's.
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.is_file() else ""
    names = [x.split(":", 1)[1] for x in flags.splitlines() if x.startswith("model name")]
    model = names[0] if names else platform.processor() or "unknown CPU"
    vnni = ""
    if flags:
        vnni = " avx512_vnni" if "avx512_vnni" in flags else " (no avx512_vnni)"
    load = os.getloadavg()
    return (
        f"host: {model.strip()} ({platform.machine()}), kernel ISA {isa}{vnni}, "
        f"{os.cpu_count()} cpus, load {load[0]:.2f}, jax {jax.__version__} on "
        f"{jax.default_backend()}"
    )


def text_of(tokens: np.ndarray) -> str:
    """Byte tokens as text (undecodable bytes replaced)."""
    return bytes(int(t) & 0xFF for t in tokens).decode("utf-8", errors="replace")


def _native_line(state, batch: int) -> str:
    """Whether the frozen NVFP4 layers run the native W4A16 kernel at decode."""
    kernels_ = [
        x
        for x in jax.tree.leaves(state, is_leaf=nvfp4_jax.is_nvfp4_array)
        if nvfp4_jax.is_nvfp4_array(x)
    ]
    if not kernels_:
        return "no NVFP4 layer"
    stacks = [q for q in kernels_ if len(q.shape) == 3]  # an MoE layer's experts
    q = kernels_[0] if len(kernels_[0].shape) == 2 else gemm.expert_weight(kernels_[0], 0)
    native = gemm.uses_native_weight_only((batch, 1, q.shape[0]), jnp.bfloat16, q)
    how = "native nvfp4_w4a16 kernel" if native else "dequantize + XLA dot"
    experts = f" and {len(stacks)} expert stacks" if stacks else ""
    linears = len(kernels_) - len(stacks)
    return f"{linears} frozen NVFP4 linears{experts}, weight-only, decode GEMMs: {how}"


def _cache_line(cfg: LMConfig, kind: str, length: int) -> str:
    """The KV cache: its kind and bytes per sequence against a bf16 cache's."""
    bf16 = 2 * cfg.depth * length * cfg.kv_heads * cfg.head_dim * 2
    config = kv_config(cfg, kind)
    if config is None:
        return f"KV cache: bf16, {bf16 / 2**20:.2f} MiB per sequence"
    nvfp4 = cfg.depth * config.cache_bytes(length)
    return (
        f"KV cache: {kind} (vLLM's --kv-cache-dtype {config.kv_cache_dtype}, {config.layout}, "
        f"{config.page_size}-token pages), {nvfp4 / 2**20:.2f} MiB per sequence, "
        f"{nvfp4 / bf16:.3f}x bf16's"
    )


def kv_scales(tree: dict, args) -> list | None:
    """The checkpoint's (k_scale, v_scale) of every layer (`load_hf_checkpoint` puts them at
    `layers/<i>/self_attn/{k,v}_proj/{k,v}_scale`), or None: calibrate on the prompt."""
    if args.kv_cache == "bf16":
        return None
    layers = tree.get("model", tree).get("layers", {}) if isinstance(tree, dict) else {}
    scales = []
    for i in sorted(layers):
        attn = layers[i].get("self_attn", {})
        k = attn.get("k_proj", {}).get("k_scale")
        v = attn.get("v_proj", {}).get("v_scale")
        if k is None or v is None:
            return None
        scales.append(
            (jnp.asarray(k, jnp.float32).reshape(()), jnp.asarray(v, jnp.float32).reshape(()))
        )
    return scales or None


def run(args) -> dict:
    """`main` after parsing: loads the weights, decodes in each precision, prints."""
    print(host_line(), flush=True)
    cfg, trees, source = load_weights(args)
    prompt_bytes = np.frombuffer(args.prompt.encode("utf-8"), np.uint8)
    if int(prompt_bytes.max()) >= cfg.vocab:
        raise UsageError(f"--prompt has bytes >= the model's vocabulary of {cfg.vocab}")
    prompt = np.tile(prompt_bytes.astype(np.int32), (args.batch, 1))
    print(
        f"model: {source}; width {cfg.width}, depth {cfg.depth}, heads {cfg.heads}/"
        f"{cfg.kv_heads}, MLP {cfg.intermediate}, vocab {cfg.vocab}"
        + (f", {cfg.experts} experts" if cfg.experts else ""),
        flush=True,
    )
    print(
        f"prompt {len(prompt_bytes)} bytes, batch {args.batch}, {args.tokens} new tokens, "
        + ("greedy" if args.temperature == 0 else f"temperature {args.temperature}"),
        flush=True,
    )
    print(_cache_line(cfg, args.kv_cache, len(prompt_bytes) + args.tokens), flush=True)
    names = PRECISIONS if args.precision == "both" else (args.precision,)
    results = {}
    for name in names:
        try:
            model = build_model(cfg, trees[name])
        except ValueError as error:  # weights its config's model does not hold, or lacks
            raise UsageError(f"{source}: {error}") from None
        scales = kv_scales(trees[name], args)
        decoder = Decoder(model, args.temperature, args.kv_cache, scales)
        if args.kv_cache != "bf16":
            origin = "the checkpoint's k_scale/v_scale" if scales else "calibrated on the prompt"
            print(f"[{name}] KV cache decode scales: {origin}", flush=True)
        if name == "nvfp4":
            print(f"[nvfp4] {_native_line(decoder.state, args.batch)}", flush=True)
        result = generate(decoder, prompt, args.tokens, args.seed)
        results[name] = result
        print(
            f"[{name}] prefill {1e3 * result['prefill_seconds']:.1f} ms "
            f"(first call, compiling: {result['prefill_first_seconds']:.2f} s); decode "
            f"{result['tokens_per_second']:.1f} tokens/s ({1e3 * result['step_seconds']:.2f} "
            f"ms/step, first step {result['first_step_seconds']:.2f} s)",
            flush=True,
        )
        print(f"[{name}] text: {args.prompt!r} + {text_of(result['tokens'][0])!r}", flush=True)
    if len(results) == 2:
        a, b = results["bf16"]["tokens"], results["nvfp4"]["tokens"]
        same = a == b
        differ = np.nonzero(~same.all(axis=0))[0]
        first = f"first difference at new token {differ[0]}" if differ.size else "identical"
        ratio = results["nvfp4"]["tokens_per_second"] / results["bf16"]["tokens_per_second"]
        print(
            f"nvfp4 vs bf16: {same.mean():.1%} of the tokens agree ({first}); decode speed "
            f"{ratio:.2f}x bf16's",
            flush=True,
        )
        results["agreement"] = float(same.mean())
    return results


def main(argv=None) -> dict:
    """Parses the flags, decodes, prints; a problem with the flags exits with status 2."""
    parser = build_parser()
    args = parse_args(argv, parser)
    try:
        return run(args)
    except UsageError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
