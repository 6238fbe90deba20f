"""Export a MaxText-trained NVFP4 model for vLLM, SGLang and TensorRT-LLM.

`python -m nvfp4_jax.maxtext.export <MaxText config and overrides>
load_parameters_path=... --out DIR`.

`export_checkpoint` reads the trained weights with MaxText itself (the trainer's orbax
checkpoint, `scan_layers` on or off), maps them to Hugging Face's names and layouts
(`maxtext_names`), quantizes the linears the launcher's rules trained in NVFP4 with the
recipe's weight settings and leaves the others in bf16 (`maxtext_plan`), takes W4A4's
activation amaxes from a calibration pass over MaxText's data pipeline
(`maxtext_model.calibrate`), and writes the ModelOpt NVFP4 folder `export_hf_checkpoint`
writes, with `config.json` made from the MaxText config and the tokenizer MaxText used.
The folder appears whole or not at all: everything is written into a temporary sibling,
moved to `--out` when complete.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import sys
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from nvfp4_jax._src.core import checks
from nvfp4_jax._src.integrations import maxtext as launcher
from nvfp4_jax._src.integrations import maxtext_model as mt
from nvfp4_jax._src.integrations import maxtext_names as names
from nvfp4_jax._src.integrations import maxtext_plan as plan_module
from nvfp4_jax._src.io.hf.export.main import ExportReport, export_hf_checkpoint
from nvfp4_jax._src.io.hf.format import CONFIG_NAME, QUANT_ALGOS, QuantAlgo
from nvfp4_jax._src.io.hf.load.main import load_hf_checkpoint
from nvfp4_jax._src.io.hf.names import (
    NameMap,
    expert_block,
    llama_name_map,
    mixtral_name_map,
    qwen3_moe_name_map,
)
from nvfp4_jax._src.model.convert.rules import Rule, check_rules
from nvfp4_jax._src.training.recipe import NVFP4Recipe

PROG = "python -m nvfp4_jax.maxtext.export"
NO_TOKENIZER = (
    "none (MaxText's tokenizer_path not found, or its vocabulary is not the model's): add the "
    "tokenizer's files to the folder"
)
# The files of a released checkpoint the export carries over: its tokenizer and generation
# settings (its weights, configs and other notes are not the export's).
_CARRIED = ("tokenizer", "special_tokens_map", "added_tokens", "generation_config", "vocab")
_CARRIED_SUFFIXES = (".model", ".tiktoken", ".jinja", "merges.txt")


def name_map_of(spec: names.ModelSpec) -> NameMap:
    """The `nvfp4_jax.hf` name map of the family (Mixtral's and Qwen3-MoE's MoE blocks)."""
    return {"mixtral": mixtral_name_map, "qwen3_moe": qwen3_moe_name_map}.get(
        spec.family.model_type, llama_name_map
    )()


def hf_module(name_map: NameMap, flax_module: str) -> str:
    """The HF module name of an HF-named Flax module path; `path[e]` is expert e's."""
    expert = None
    if flax_module.endswith("]"):
        flax_module, _, index = flax_module[:-1].rpartition("[")
        expert = int(index)
    found = name_map.to_hf(f"{flax_module}/kernel")
    if found is None:
        return flax_module
    name = found[0].removesuffix(".weight")
    if expert is None:  # a whole expert stack: `...experts.*.w1`
        return name.replace("{expert}", "*")
    return NameMap.expert_names(name, expert + 1)[expert]


@dataclasses.dataclass(frozen=True)
class MaxTextExport:
    """What `export_checkpoint` wrote (module names are Hugging Face's).

    Attributes:
      directory: the checkpoint folder.
      decoder_block: the MaxText family.
      quant_algo: "NVFP4" (W4A4) or "W4A16_NVFP4".
      nvfp4: the linears written in NVFP4 (an expert stack as `...experts.*.w1`).
      high_precision: `{linear: why}` of the linears written in bf16.
      training_exact: NVFP4 linears whose codes and block scales are those the training
        forward quantized the weight to, bit for bit (one name per expert).
      requantized: `{linear: why}` of the NVFP4 linears quantized otherwise (the fused
        group's amax, a RoPE reorder or a scale that is no power of two).
      from_base: tensors written as the released checkpoint (`base=`) holds them.
      tokenizer: where the tokenizer files came from ("" if none was found, or MaxText's
        SentencePiece model has another vocabulary size than the model).
      calibration_batches: the batches the W4A4 input amaxes were taken over.
      files: the export's report (`nvfp4_jax.hf.ExportReport`).
    """

    directory: str
    decoder_block: str
    quant_algo: str
    nvfp4: tuple[str, ...]
    high_precision: dict[str, str]
    training_exact: tuple[str, ...]
    requantized: dict[str, str]
    from_base: tuple[str, ...]
    tokenizer: str
    calibration_batches: int
    files: ExportReport

    def to_dict(self) -> dict:
        """A JSON-ready dict (the export's report as its fields)."""
        out = dataclasses.asdict(self)
        out["files"] = dataclasses.asdict(self.files)
        return out


def check_out(directory: str, force: bool, what: str = PROG) -> str:
    """The absolute `--out`, refused if it holds files (unless `force`) or cannot be made."""
    directory = os.path.abspath(directory)
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise ValueError(f"{what}: --out {directory} exists and is not a folder")
    if os.path.isdir(directory) and os.listdir(directory) and not force:
        raise ValueError(
            f"{what}: --out {directory} is not empty; nothing is written over files "
            "(give another folder, or force=True / --force to replace it)"
        )
    parent = os.path.dirname(directory)
    if os.path.lexists(parent) and not os.path.isdir(parent):
        raise ValueError(f"{what}: --out {directory}: {parent} is not a folder")
    return directory


def _read_base(base: str, spec: names.ModelSpec) -> tuple[dict, dict]:
    """(the released tree, flat; its config.json without `quantization_config`)."""
    config_path = pathlib.Path(base) / CONFIG_NAME
    if not config_path.is_file():
        raise ValueError(f"{PROG}: base={base}: no config.json there")
    config = json.loads(config_path.read_text())
    names.check_hf_config(config, spec)
    config.pop("quantization_config", None)
    tree = load_hf_checkpoint(base, name_map=name_map_of(spec))
    return names.flat_hf(tree), config


def _tokenizer_files(base: str | None, config) -> list[tuple[str, str]]:
    """[(source file, name in the export)] of the tokenizer files.

    The released checkpoint's, else the one MaxText's config names (a Hugging Face folder,
    or a SentencePiece model).
    """
    if base is not None:
        return [(str(p), p.name) for p in sorted(pathlib.Path(base).iterdir()) if _carried(p)]
    found = mt.tokenizer_file(config)
    if found is None:
        return []
    path, kind = found
    if os.path.isdir(path):
        return [(str(p), p.name) for p in sorted(pathlib.Path(path).iterdir()) if _carried(p)]
    if kind == "sentencepiece":
        if _sentencepiece_size(path) not in (None, getattr(config, "vocab_size", None)):
            return []  # another model's tokenizer: its ids would fall outside the embedding
        return [(path, "tokenizer.model")]
    return [(path, os.path.basename(path))]


def _sentencepiece_size(path: str) -> int | None:
    """The vocabulary size of a SentencePiece model, None if sentencepiece cannot tell."""
    try:
        import sentencepiece  # noqa: PLC0415  (MaxText's dependency, optional here)

        return int(sentencepiece.SentencePieceProcessor(model_file=path).GetPieceSize())
    except Exception:  # noqa: BLE001  (no sentencepiece, or not a model file: no check)
        return None


def _carried(path: pathlib.Path) -> bool:
    """Whether a released checkpoint's file is one the export carries over."""
    name = path.name
    return path.is_file() and (name.startswith(_CARRIED) or name.endswith(_CARRIED_SUFFIXES))


def _write_tokenizer(folder: str, files: list[tuple[str, str]], spec) -> None:
    for source, name in files:
        shutil.copy2(source, os.path.join(folder, name))
    names_written = {name for _, name in files}
    if names_written == {"tokenizer.model"}:  # a SentencePiece model alone: say what reads it
        settings = {
            "tokenizer_class": "LlamaTokenizer",
            "model_max_length": spec.max_len,
            "clean_up_tokenization_spaces": False,
        }
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as file:
            json.dump(settings, file, indent=1)


def _exclude(name_map: NameMap, high_precision: Mapping[str, str], spec) -> list[str]:
    """`exclude=` patterns: each linear written in bf16, an MoE block's experts as a block."""
    out = ["model.embed_tokens"]
    for module in high_precision:
        found = name_map.to_hf(f"{module}/kernel")
        if found is None:
            continue
        name, kind = found
        if kind == "experts":
            out.append(expert_block(name) + ".*")
        else:
            out.append(name.removesuffix(".weight"))
    return list(dict.fromkeys(out))


def _reject_quantization(config) -> None:
    if getattr(config, "quantization", ""):
        raise ValueError(
            f"{PROG}: quantization={config.quantization} was given; the export reads the "
            "trained weights of the plain model (leave quantization= out, as for the launcher)"
        )


def _dtype_name(dtype) -> str:
    return str(getattr(dtype, "name", dtype))


def write_export(
    directory: str | os.PathLike,
    params: Mapping,
    spec: names.ModelSpec,
    decisions: Mapping[str, plan_module.Decision],
    *,
    quant_algo: str = "NVFP4",
    recorded_amaxes: Mapping[str, Any] | None = None,
    base: str | os.PathLike | None = None,
    tokenizer: Sequence[tuple[str, str]] | None = None,
    compute_dtype: str = "bfloat16",
    master_dtype: str = "float32",
    force: bool = False,
    max_shard_size: int | str = "5GB",
    calibration_batches: int = 0,
) -> MaxTextExport:
    """The export of a MaxText tree already read: `export_checkpoint` without MaxText.

    Args:
      directory: the folder to write (must not hold files unless `force`).
      params: MaxText's parameter tree (numpy arrays).
      spec: its model (`maxtext_names.model_spec`).
      decisions: `maxtext_plan.precisions(spec, rules)`.
      quant_algo: "NVFP4" or "W4A16_NVFP4".
      recorded_amaxes: the calibration's `{unscanned MaxText leaf path: amax}` (W4A4).
      base: the released checkpoint (see `export_checkpoint`).
      tokenizer: [(file, name in the export)] to copy into the folder (None: the files of
        `base` besides its weights and configs, its tokenizer and generation config).
      compute_dtype: MaxText's `dtype` (its layers cast kernels to it before the GEMMs).
      master_dtype: MaxText's `weight_dtype` (to tell weights still as imported).
      force: replace a `directory` that holds files.
      max_shard_size: bytes (or "5GB") per safetensors file.
      calibration_batches: recorded in the result.

    Returns:
      A `MaxTextExport`.
    """
    directory = check_out(os.fspath(directory), force)
    base = None if base is None else os.path.abspath(os.fspath(base))
    base_flat, base_config = _read_base(base, spec) if base is not None else (None, None)
    if tokenizer is None:
        tokenizer = _tokenizer_files(base, None) if base is not None else []
    tree, plan = plan_module.hf_params(
        params,
        spec,
        decisions,
        compute_dtype=compute_dtype,
        base=base_flat,
        master_dtype=master_dtype,
    )
    amaxes = {}
    if quant_algo == "NVFP4":
        amaxes = plan_module.input_amaxes(spec, plan, recorded_amaxes or {})
        missing = plan_module.missing_input_amaxes(plan, amaxes)
        if missing:
            example = hf_module(name_map_of(spec), missing[0])
            raise ValueError(
                f"{PROG}: W4A4 (quant_algo NVFP4) needs each NVFP4 linear's activation amax, "
                f"and {len(missing)} have none (e.g. {example}): calibrate over MaxText's "
                "data pipeline with calibration_batches=N (--calibration-batches N), or export "
                "weight-only with quant_algo='W4A16_NVFP4' (--quant-algo W4A16_NVFP4)"
            )
    name_map = name_map_of(spec)

    def write(staging: str) -> ExportReport:
        _write_tokenizer(staging, list(tokenizer), spec)
        return export_hf_checkpoint(
            staging,
            names.hf_tree(tree),
            name_map=name_map,
            quant_algo=quant_algo,
            input_amax=amaxes or None,
            exclude=_exclude(name_map, plan.high_precision, spec),
            config=base_config or names.hf_config(spec),
            dtype=None,
            max_shard_size=max_shard_size,
            four_over_six=None,
        )

    report = _write_whole(directory, force, write)
    return MaxTextExport(
        directory=directory,
        decoder_block=spec.family.block,
        quant_algo=quant_algo,
        nvfp4=tuple(dict.fromkeys(hf_module(name_map, m) for m in plan.nvfp4)),
        high_precision={hf_module(name_map, m): w for m, w in plan.high_precision.items()},
        training_exact=tuple(hf_module(name_map, m) for m in plan.training_exact),
        requantized={hf_module(name_map, m): w for m, w in plan.requantized.items()},
        from_base=tuple(plan.from_base),
        tokenizer=next((src for src, name in tokenizer if name.startswith("tokenizer")), ""),
        calibration_batches=calibration_batches,
        files=dataclasses.replace(report, directory=directory),
    )


def export_checkpoint(
    directory: str | os.PathLike,
    maxtext_args: Sequence[str],
    *,
    recipe: NVFP4Recipe | None = None,
    rules: Sequence[Rule] = (),
    quant_algo: str = "NVFP4",
    calibration_batches: int = 0,
    base: str | os.PathLike | None = None,
    force: bool = False,
    max_shard_size: int | str = "5GB",
) -> MaxTextExport:
    """Writes a MaxText checkpoint trained in NVFP4 as a ModelOpt NVFP4 HF checkpoint.

    What `nvfp4_jax.export_hf_checkpoint` writes, from a checkpoint of
    `python -m nvfp4_jax.maxtext`.

    The linears the launcher's rules trained in NVFP4 (the decoder layers' projections and
    experts, as `rules_from_config(config, recipe, rules=rules)` decides) are written in
    NVFP4, quantized with `recipe`'s weight settings: 16x16 blocks, Four Over Six where the
    recipe had it, the fused group's largest amax (`maxtext_plan`); the others (embedding,
    output head, routers, what `rules` kept) in bf16, listed in `ignore`. Give the same
    `recipe` and `rules` as the training run.

    Args:
      directory: the folder to write (must not hold files unless `force`).
      maxtext_args: MaxText's arguments as for its trainer: its config file, then
        `key=value` overrides, with `load_parameters_path=<run>/checkpoints/<step>/items`
        (the model's settings as in training; `quantization=` left out).
      recipe: the training recipe (default `NVFP4Recipe()`).
      rules: the training run's `--nvfp4-rules` (`Rule`s).
      quant_algo: "NVFP4" (W4A4: needs `calibration_batches` or a `base` whose input scales
        are kept) or "W4A16_NVFP4" (weight-only).
      calibration_batches: batches of MaxText's data pipeline (the config's dataset) to
        record each NVFP4 linear's activation amax over, in the training forward.
      base: the released Hugging Face checkpoint the run was fine-tuned from: its
        config.json and tokenizer are written, and every tensor MaxText still holds exactly
        as the import made it is written as released (bytes, input scales).
      force: replace a `directory` that holds files.
      max_shard_size: bytes (or "5GB") per safetensors file.

    Returns:
      A `MaxTextExport`.

    Raises:
      ValueError: a config MaxText rejects or the export cannot map (naming the key), no
        checkpoint at `load_parameters_path` (naming the run's steps), a checkpoint that is
        not the config's model, W4A4 without activation amaxes, `directory` not empty.
    """
    recipe = NVFP4Recipe() if recipe is None else recipe
    if not isinstance(recipe, NVFP4Recipe):
        raise TypeError(f"{PROG}: recipe must be an NVFP4Recipe, got {recipe!r}")
    rules = check_rules(rules)
    checks.check_choice(f"{PROG}: quant_algo", quant_algo, QuantAlgo)
    if not isinstance(calibration_batches, int) or calibration_batches < 0:
        raise ValueError(f"{PROG}: calibration_batches must be an int >= 0")
    if calibration_batches and quant_algo != "NVFP4":
        raise ValueError(f"{PROG}: calibration_batches is for W4A4 (quant_algo 'NVFP4') only")
    check_out(os.fspath(directory), force)
    config = mt.maxtext_config(maxtext_args, PROG)
    _reject_quantization(config)
    spec = names.model_spec(config)
    params = mt.trained_params(config, PROG)
    decisions = plan_module.precisions(
        spec, launcher.rules_from_config(config, recipe, rules=rules), names.expected_shapes(spec)
    )
    recorded = None
    if calibration_batches:
        recorded = mt.calibrate(
            maxtext_args,
            params,
            spec,
            recipe=recipe,
            rules=rules,
            batches=calibration_batches,
            what=PROG,
        )
    base = None if base is None else os.path.abspath(os.fspath(base))
    return write_export(
        directory,
        params,
        spec,
        decisions,
        quant_algo=quant_algo,
        recorded_amaxes=recorded,
        base=base,
        tokenizer=_tokenizer_files(base, config),
        compute_dtype=_dtype_name(config.dtype),
        master_dtype=_dtype_name(config.weight_dtype),
        force=force,
        max_shard_size=max_shard_size,
        calibration_batches=calibration_batches,
    )


def _write_whole(directory: str, force: bool, write) -> ExportReport:
    """Runs `write(staging)` in a temporary sibling of `directory`, then moves it there."""
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".{os.path.basename(directory)}.export-{uuid.uuid4().hex[:8]}")
    os.mkdir(staging)
    try:
        report = write(staging)
        if os.path.isdir(directory) and os.listdir(directory):
            if not force:
                raise FileExistsError(f"{PROG}: --out {directory} was filled while exporting")
            old = f"{staging}.old"
            os.rename(directory, old)
            os.rename(staging, directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return report


# --- the command line -------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Writes a MaxText checkpoint trained with python -m nvfp4_jax.maxtext as a ModelOpt "
            "NVFP4 Hugging Face checkpoint for vLLM, SGLang and TensorRT-LLM. Every argument "
            "not listed here goes to MaxText: its config file, then key=value overrides as in "
            "training, with load_parameters_path=<run>/checkpoints/<step>/items."
        ),
        allow_abbrev=False,
    )
    parser.add_argument("--out", required=True, type=pathlib.Path, metavar="DIR")
    parser.add_argument("--nvfp4-recipe", default="{}", metavar="JSON", help="as in training")
    parser.add_argument("--nvfp4-rules", type=pathlib.Path, metavar="FILE", help="as in training")
    parser.add_argument("--quant-algo", choices=QUANT_ALGOS, default="NVFP4")
    parser.add_argument(
        "--calibration-batches",
        type=int,
        default=0,
        metavar="N",
        help="W4A4: record the activation amaxes over N batches of MaxText's data pipeline",
    )
    parser.add_argument("--base", type=pathlib.Path, metavar="HF_DIR", help="the released model")
    parser.add_argument("--force", action="store_true", help="replace --out if it holds files")
    parser.add_argument("--max-shard-size", default="5GB")
    parser.add_argument("--report", type=pathlib.Path, metavar="FILE", help="write it as JSON")
    return parser


def _summary(result: MaxTextExport) -> str:
    lines = [
        f"{result.directory}: {result.decoder_block}, {result.quant_algo}, "
        f"{len(result.files.files)} file(s), {result.files.total_size} bytes",
        f"NVFP4: {len(result.nvfp4)} linears; bf16: {len(result.high_precision)}; "
        f"the training forward's bits: {len(result.training_exact)}; "
        f"requantized: {len(result.requantized)}; from the released checkpoint: "
        f"{len(result.from_base)} tensors",
        f"tokenizer: {result.tokenizer or NO_TOKENIZER}",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m nvfp4_jax.maxtext.export <MaxText config> [key=value ...] --out DIR ...`.

    Flags and their files are checked before MaxText starts (status 2); an export that
    fails exits with status 1 and its error, having written nothing to `--out`.

    Args:
      argv: the command line, program name first (default `sys.argv`).
    """
    argv = sys.argv if argv is None else list(argv)
    parser = _parser()
    options, rest = parser.parse_known_args(argv[1:])
    unknown = [a for a in rest if a.startswith("--")]
    if unknown:
        parser.error(f"unrecognized flag {unknown[0]}")
    recipe = launcher.load_recipe(parser, options.nvfp4_recipe)
    rules = launcher.load_rules(parser, options.nvfp4_rules)
    launcher.compile_rules(parser, options.nvfp4_rules, recipe, rules)
    if options.report is not None and os.path.lexists(options.report):
        parser.error(f"--report {options.report}: exists; a report is never overwritten")
    try:
        check_out(str(options.out), options.force)
        result = export_checkpoint(
            options.out,
            rest,
            recipe=recipe,
            rules=rules,
            quant_algo=options.quant_algo,
            calibration_batches=options.calibration_batches,
            base=options.base,
            force=options.force,
            max_shard_size=options.max_shard_size,
        )
    except (ValueError, TypeError, FileExistsError, ImportError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    print(_summary(result))
    if options.report is not None:
        options.report.write_text(json.dumps(result.to_dict(), indent=1))


__all__ = ["MaxTextExport", "export_checkpoint", "main", "write_export"]
