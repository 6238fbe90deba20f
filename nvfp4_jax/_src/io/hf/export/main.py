"""Export: a Flax model as a ModelOpt NVFP4 Hugging Face checkpoint (`export_hf_checkpoint`).

The entry point checks its keywords once into an `ExportOptions`, then runs the stages, each
in a module of its own: the leaves sorted and mapped to HF names, a stacked (E, in, out)
experts kernel to E linears (`tensors`); each linear's precision decided
(`exclude=`, the layers the model computed in NVFP4 or `rules=`: `precision`) and
checked with its fused group and its mixture-of-experts block (`plan`); the scales
(`scales`); the configs (`config`, `tokenizer`); the tensors converted,
quantized and written one module (one expert) at a time (`units`) into a temporary
directory, moved into place when complete (`writer`); and the `ExportReport`
(`report`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
from flax import nnx

from nvfp4_jax._src.core import formats
from nvfp4_jax._src.flax.walk import DEFAULT_FUSED_GROUPS
from nvfp4_jax._src.io.hf.export.config import (
    check_config_against,
    legacy_quant_config,
    quantization_config,
    read_model_config,
)
from nvfp4_jax._src.io.hf.export.kv import kv_scales, kv_units
from nvfp4_jax._src.io.hf.export.options import ExportOptions
from nvfp4_jax._src.io.hf.export.plan import plan_modules
from nvfp4_jax._src.io.hf.export.precision import (
    decider,
    experts_recipes,
    four_over_six_of,
    model_four_over_six,
)
from nvfp4_jax._src.io.hf.export.report import ExportReport, build_report
from nvfp4_jax._src.io.hf.export.scales import input_scales, weight_amaxes
from nvfp4_jax._src.io.hf.export.tensors import Leaves, Tensor, collect_leaves, map_tensors
from nvfp4_jax._src.io.hf.export.tokenizer import byte_tokenizer, check_tokenizer
from nvfp4_jax._src.io.hf.export.units import make_units
from nvfp4_jax._src.io.hf.export.writer import check_target, write_once, write_weights
from nvfp4_jax._src.io.hf.format import CONFIG_NAME, QUANT_CONFIG_NAME, write_json
from nvfp4_jax._src.io.hf.names import DEFAULT_EXCLUDE, NameMap
from nvfp4_jax._src.io.hf.safetensors_files import Unit

__all__ = ["ExportReport", "export_hf_checkpoint"]


def export_hf_checkpoint(
    directory: str | os.PathLike,
    params: Any,
    *,
    name_map: NameMap | Sequence | None = None,
    quant_algo: str = "NVFP4",
    input_amax: Mapping[str, Any] | None = None,
    exclude: Sequence[str] = DEFAULT_EXCLUDE,
    config: Mapping[str, Any] | None = None,
    fused_groups: Sequence[Sequence[str]] = DEFAULT_FUSED_GROUPS,
    block_2d: bool = True,
    four_over_six: str | None = "model",
    four_over_six_e4m3_max: int = formats.FOUR_OVER_SIX_DEFAULT_E4M3_MAX,
    dtype=jnp.bfloat16,
    max_shard_size: int | str = "5GB",
    skip: Sequence[str] = (),
    force: bool = False,
    implementation: str | None = None,
    rules: Any = None,
    tokenizer: str | None = None,
    kv_cache_quant_algo: str | None = None,
    kv_cache_amax: Mapping[str, Any] | None = None,
) -> ExportReport:
    """Writes a Flax model as a ModelOpt NVFP4 Hugging Face checkpoint that engines load.

    Every linear (a `kernel` (in, out) the name map calls "linear") not excluded is quantized
    along `in` (`quantize(kernel, axis=0, block_2d=block_2d, amax=group amax)`) and written as
    `.weight` U8 (out, in/2), `.weight_scale` F8_E4M3 (out, in/16), `.weight_scale_2` F32 ()
    and, for W4A4, `.input_scale` F32 () (`f32(input_amax) * f32(1/2688)`). Members of a fused
    group (same parent module, names in one group of `fused_groups`) use the group's max
    weight amax and max input scale, so their scales are equal, as engines need. A kernel
    that already is an `NVFP4Array` (from `load_hf_checkpoint`, or quantized along axis 0) is
    written as it is, with its decode scale. Everything else is written in `dtype` under its
    HF name; excluded linears as `.weight` (out, in).

    Mixture-of-experts blocks (a name map with "experts" and "router" rules:
    `qwen3_moe_name_map()`, `mixtral_name_map()`) are written as ModelOpt writes them
    (docs/SERVING_FORMATS.md section 5). A stacked kernel (E, in, out) becomes E linears, one
    per expert (`...experts.{e}.gate_proj`), each quantized as a tensor of its own with its
    own weight amax (M1, M3); gate and up of one expert (a fused group: `gate_proj`/`up_proj`,
    Mixtral's `w1`/`w3`) with the larger of their two amaxes (M2). An `NVFP4Array` stack (E,
    in, out) with one amax per expert (`load_hf_checkpoint`'s) is written as it is. W4A4
    writes one `input_scale` per layer and projection kind on every expert: the max over all
    experts of gate and up together, and of down (M4); its source is a scalar or (E,) amax
    per stacked layer (`nvfp4_jax.nnx.Experts.input_amax`, `input_amax=`), where an expert
    may have 0 (no calibration token) if the layer's max is positive. The router stays in
    high precision, `.weight` (E, hidden) in `dtype`, and is listed in `ignore` (M5); an
    `NVFP4Array` router, or one the model computed in NVFP4, is an error. An MoE block is
    quantized whole or kept whole in high precision (listed in `ignore` by its block name,
    e.g. `model.layers.0.mlp.experts`). `config` must hold the expert count
    (`num_experts` or `num_local_experts`), `num_experts_per_tok` and one expert's MLP size
    (`moe_intermediate_size`, Qwen3-MoE; `intermediate_size`, Mixtral), checked against
    the kernels.

    The exporter follows the precision the model was trained in: given the model (or its
    `nnx.state`) holding `nvfp4_jax.nnx.Linear` layers, every other linear (a plain
    `nnx.Linear`, e.g. kept in bf16 by `quantize_model`'s rules) is written in high precision
    and listed in `ignore`; `rules=` (the `QuantizeReport` `quantize_model` returned, or its
    rules) decides instead. An `nvfp4_jax.nnx.Experts` layer follows its recipe (None: high
    precision), which only the model itself records: give the model, not its state, or
    `rules=`. A fused group or MoE block partly trained in high precision is written whole
    in high precision (the safe choice; engines need a group all quantized or all not), and
    reported in `ExportReport.group_high_precision`. A model with no NVFP4 layer (trained in
    bf16), and a plain pytree, are quantized whole (post-training).

    A quantized KV cache (`kv_cache_quant_algo="NVFP4"`, implied by `kv_cache_amax`) is
    declared as ModelOpt declares it (`kv_cache_quant_algo` in `hf_quant_config.json`,
    `kv_cache_scheme` in `quantization_config`), with each attention's decode scales as
    `<attention>.k_proj.k_scale` and `<attention>.v_proj.v_scale`, F32 scalars: vLLM's
    `k_scale` / `v_scale` (`--kv-cache-dtype nvfp4`; without them it uses 1.0). They are
    `f32(amax / 448)` of `kv_cache_amax` (ModelOpt's convention), or the `k_scale` /
    `v_scale` leaves the params hold beside the `k_proj` / `v_proj` kernels (as
    `load_hf_checkpoint` returns them), written as they are (docs/SERVING_FORMATS.md
    section 6).

    The directory is written into a temporary sibling and moved into place when complete.
    Tensors are converted, quantized and written one module at a time, so host memory stays
    at about one layer.

    Args:
      directory: the checkpoint directory to create (or, with `force`, replace).
      params: the weights: the nnx model itself, the whole `nnx.state(model)` (only
        `nnx.Param`s are weights; a variable named `input_amax` on a linear is its recorded
        activation amax; rng state is skipped), or a pytree of arrays (Flax params,
        `nnx.to_pure_dict`).
      name_map: a `NameMap` or a list of rules; default `llama_name_map()`.
      quant_algo: "NVFP4" (W4A4: weights and activations in NVFP4; needs input amaxes) or
        "W4A16_NVFP4" (weight-only: what Hopper and Ampere serve, through Marlin).
      input_amax: `{Flax module path or HF module name: activation amax}`, overriding what
        `params` holds (`input_amax` or `input_scale` leaves). A stacked experts layer takes
        a scalar or one amax per expert, (E,), by its Flax path
        (`layers/0/mlp/experts/up_proj`), or one expert's by its HF module name. W4A4 only.
      exclude: fnmatch patterns on HF module names kept in high precision and listed in
        `ignore`; a fused group is excluded whole or not at all.
      config: the model's HF config (a dict: architectures, hidden_size, num_attention_heads,
        num_key_value_heads, ...); default: the `config.json` already in `directory`. Its
        `quantization_config` is replaced.
      fused_groups: names of sibling linears engines fuse into one layer.
      block_2d: quantize weights in 16x16 blocks (the training recipe's; the forward pass of a
        model trained with `NVFP4Recipe()` sees these values), else 1x16.
      four_over_six: how the float kernels are quantized: "model" (the default) as the
        training recipe quantized each layer's weight in the forward pass (its
        `weight_four_over_six` and `four_over_six_e4m3_max`, from `rules=` or else from the
        model's `nvfp4_jax.nnx` layers; plain NVFP4 for a state, a pytree or a model trained
        in high precision); None: plain NVFP4; "mae" or "mse": Four Over Six (docs/NUMERICS.md
        section 13) for every kernel, with the global scale's E4M3 maximum
        `four_over_six_e4m3_max` (256 or 448). The files are plain NVFP4 either way
        (`weight_scale_2` is the 4/6 decode scale `amax / (6M)`); engines load them
        unchanged. A fused group shares its amax, hence its decode scale, and must share
        its setting. `NVFP4Array` kernels are written as they are.
      four_over_six_e4m3_max: M for `four_over_six="mae"` or `"mse"`: 256 (the default) or
        448.
      dtype: the dtype of every float tensor not quantized (None keeps each leaf's).
      max_shard_size: bytes (or "5GB", "500MiB") per safetensors file; above it the weights
        are split into `model-0000N-of-0000M.safetensors` with an index.
      skip: regexes of Flax paths to leave out (fullmatch).
      force: replace the weights of a directory that holds some (`*.safetensors`, an index,
        `hf_quant_config.json`, `*.bin`). Not needed for a directory holding only a config
        and tokenizer files (what `save_pretrained` leaves); its files besides weights and
        configs are kept either way, and its `config.json` is the default `config`.
      implementation: as in `quantize`.
      rules: which linears were trained in NVFP4: the `QuantizeReport` of
        `nvfp4_jax.quantize_model` (action "nvfp4": NVFP4; "high_precision", "skipped":
        high precision; "unmatched": as the model holds it), or the `Rule`s it was given
        (first match by module path, e.g. `layers/0/mlp/up_proj`; recipe None: high
        precision; no match: as the model holds it). Default: what `params` holds.
      tokenizer: None (write none; tokenizer files already in the folder are kept) or
        "bytes": write `tokenizer.json` and `tokenizer_config.json` of a byte-level tokenizer
        (token i is byte i, as in examples/lm_model.py), so that engines take text prompts.
      kv_cache_quant_algo: None (no KV-cache scales; `k_scale` / `v_scale` leaves are
        skipped) or "NVFP4": the KV-cache quantization the checkpoint declares.
      kv_cache_amax: `{attention path: (k_amax, v_amax)}`, the calibrated max |k| and |v|
        of each attention (its Flax path, e.g. `layers/0/self_attn`, or its HF module name;
        `PTQReport.kv_cache_amax` of `quantize_for_export(..., kv_cache=True)`), written as
        `k_scale = f32(k_amax / 448)`, `v_scale` likewise; implies "NVFP4".

    Returns:
      An `ExportReport`.

    Raises:
      ValueError: a leaf no rule maps, two leaves on one HF name, missing input amaxes for
        W4A4 (all named in one message) or ones that are NaN, infinite or negative, a fused
        group or MoE block half excluded by `exclude=`, a kernel that cannot be quantized and
        is not excluded, an experts kernel that is not (E, in, out), a router in NVFP4, a
        model config lacking what engines need (MoE keys included), disagreeing with the
        kernels or not strict JSON (a NaN or infinite number, a key twice once keys are
        strings, nesting deeper than 64 levels), a `QuantizeReport` without a decision for a
        linear, an nnx state holding `Experts` layers without the model or `rules=`; and
        whatever `load_hf_checkpoint` would refuse to read back: a float kernel holding NaN
        or inf, an `NVFP4Array` kernel (or an expert of a stack) whose decode scale is NaN,
        infinite or negative or whose block scales hold E4M3 NaN or negative values, named
        by module and tensor. Every check runs before anything is written.
      TypeError: `rules` is neither a QuantizeReport nor a sequence of Rules; an
        `NVFP4Array` kernel whose parts have the wrong dtypes; a tensor kept in high
        precision that is no float, unless its name map kind is "plain"; a config value
        JSON cannot hold.
      FileExistsError: `directory` holds weights and `force` is False.
    """
    options = ExportOptions.from_keywords(
        directory,
        name_map=name_map,
        quant_algo=quant_algo,
        input_amax=input_amax,
        exclude=exclude,
        config=config,
        fused_groups=fused_groups,
        block_2d=block_2d,
        four_over_six=four_over_six,
        four_over_six_e4m3_max=four_over_six_e4m3_max,
        dtype=dtype,
        max_shard_size=max_shard_size,
        skip=skip,
        force=force,
        implementation=implementation,
        rules=rules,
        tokenizer=tokenizer,
        kv_cache_quant_algo=kv_cache_quant_algo,
        kv_cache_amax=kv_cache_amax,
    )
    return _export(params, options)


def _export(params: Any, options: ExportOptions) -> ExportReport:
    """The stages of an export, in order: target, config, tensors, plan, units, files."""
    check_target(options.directory, options.force)
    model_config = read_model_config(options.config, options.directory)
    check_tokenizer(options.tokenizer, model_config)
    model = _Model.of(params)
    leaves = collect_leaves(model.state, options.skip)
    tensors = map_tensors(leaves, options.name_map)
    if not tensors:
        raise ValueError("export_hf_checkpoint: params hold no weights")
    plan = _plan(tensors, leaves, model, options)
    model_config = check_config_against(model_config, tensors, options.dtype)
    units = _units(tensors, leaves, model, options)
    model_config["quantization_config"] = quantization_config(
        options.quant_algo, plan[1], options.kv_cache_quant_algo
    )
    write = _writer(units, model_config, plan[1], options)
    written = write_once(options.directory, write, units)
    return build_report(options, tensors, leaves, plan, written)


class _Model:
    """The exported state, and what only an nnx model (not its state) records of its layers.

    Attributes:
      state: the pytree or nnx state to export.
      experts: `{Flax path: computes in NVFP4}` of its `nvfp4_jax.nnx.Experts` layers.
      four_over_six: `{Flax path: (weight_four_over_six, M)}` of its NVFP4 layers.
    """

    def __init__(self, state: Any, experts: Mapping[str, bool], four_over_six: Mapping):
        self.state, self.experts, self.four_over_six = state, experts, four_over_six

    @classmethod
    def of(cls, params: Any) -> _Model:
        """`params` as given: an nnx model is read for its layers, then exported as its state."""
        if isinstance(params, nnx.Module):
            return cls(nnx.state(params), experts_recipes(params), model_four_over_six(params))
        return cls(params, {}, {})


def _plan(
    tensors: list[Tensor], leaves: Leaves, model: _Model, options: ExportOptions
) -> tuple[str, list[str]]:
    """(where the precisions came from, the `ignore` list), every tensor marked and checked."""
    followed, decide = decider(options.rules, leaves, model.experts)
    ignore = plan_modules(tensors, options.exclude, options.fused_groups, options.block_2d, decide)
    return followed, ignore


def _units(
    tensors: list[Tensor], leaves: Leaves, model: _Model, options: ExportOptions
) -> list[Unit]:
    """The units of every tensor, with the scales and quantization flags of the quantized."""
    scales = input_scales(tensors, leaves, options.input_amax) if options.w4a4 else {}
    amaxes = weight_amaxes(tensors, options.implementation)
    fos = four_over_six_of(
        options.four_over_six,
        options.four_over_six_e4m3_max,
        model.four_over_six,
        options.rules,
        tensors,
    )

    def flags_of(t: Tensor) -> dict:
        mode, e4m3_max = fos(t)
        return dict(block_2d=options.block_2d, four_over_six=mode, four_over_six_e4m3_max=e4m3_max)

    units = make_units(tensors, amaxes, scales, flags_of, options.dtype, options.implementation)
    if options.kv_cache_quant_algo is None:
        leaves.skipped.extend(leaves.kv_scale)
        return units
    return units + kv_units(kv_scales(tensors, leaves, options.kv_cache_amax))


def _writer(units: list[Unit], model_config: dict, ignore: list[str], options: ExportOptions):
    """`write(tmp)`: the weights, `config.json`, `hf_quant_config.json` (and a tokenizer)."""

    def write(tmp: str, units: list[Unit] = units) -> tuple[list[str], int]:
        files, total = write_weights(tmp, units, options.max_size)
        write_json(os.path.join(tmp, CONFIG_NAME), model_config)
        legacy = legacy_quant_config(options.quant_algo, ignore, options.kv_cache_quant_algo)
        write_json(os.path.join(tmp, QUANT_CONFIG_NAME), legacy)
        if options.tokenizer == "bytes":
            for name, content in byte_tokenizer(model_config).items():
                write_json(os.path.join(tmp, name), content)
        return files, total

    return write
