"""Import a released NVFP4 checkpoint into MaxText, to fine-tune it with the NVFP4 recipe.

`python -m nvfp4_jax.maxtext.load HF_DIR <MaxText config and overrides> --out DIR`.

`load_params` reads a Hugging Face checkpoint (ModelOpt NVFP4, W4A4 or weight-only, or plain
bf16; `nvfp4_jax.load_hf_checkpoint`) and returns MaxText's parameter tree for the MaxText
config's model: every NVFP4 weight dequantized exactly as ModelOpt decodes it (`dequantize(q,
f32)`), mapped back to MaxText's names and layouts (`maxtext_names`: the inverse reshapes,
the query divided by sqrt(E) where MaxText folds it in, llama3.1's RoPE order), the experts
stacked (X, D, F), the layers stacked on `param_scan_axis` with `scan_layers`, in MaxText's
`weight_dtype` (f32 by default, which holds the decoded values exactly).
`import_checkpoint` writes that tree as MaxText's parameter checkpoint (what its own
`save_params_to_path` writes: `DIR/items`, the Linen layout `params/params/...`) for
`load_parameters_path=DIR/items`; the folder appears whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import uuid
from collections.abc import Sequence

import numpy as np

from nvfp4_jax._src.integrations import maxtext_model as mt
from nvfp4_jax._src.integrations import maxtext_names as names
from nvfp4_jax._src.integrations.maxtext_export import check_out, name_map_of
from nvfp4_jax._src.integrations.maxtext_plan import to_maxtext_tree
from nvfp4_jax._src.io.hf.format import CONFIG_NAME
from nvfp4_jax._src.io.hf.load.main import load_hf_checkpoint

PROG = "python -m nvfp4_jax.maxtext.load"


def _hf_config(directory: str, spec: names.ModelSpec) -> dict:
    path = pathlib.Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise ValueError(f"{PROG}: {directory} holds no config.json: not a Hugging Face checkpoint")
    config = json.loads(path.read_text())
    names.check_hf_config(config, spec)
    if spec.family.model_type == "qwen3_moe" and not config.get("norm_topk_prob", False):
        raise ValueError(
            f"{PROG}: the checkpoint's config.json has norm_topk_prob=false (the top-k router "
            "probabilities are not renormalized); MaxText's qwen3_moe always renormalizes "
            "them (it softmaxes the top-k logits), so it would compute another model"
        )
    return config


def load_params(directory: str | os.PathLike, maxtext_args: Sequence[str]) -> dict:
    """MaxText's parameter tree of a Hugging Face checkpoint, for the MaxText config's model.

    Args:
      directory: the Hugging Face checkpoint (ModelOpt NVFP4, W4A4 or weight-only, or bf16).
      maxtext_args: MaxText's config file and `key=value` overrides of the model to fine-tune
        (its sizes must be the checkpoint's; `scan_layers` as the training will run).

    Returns:
      `{"decoder": ..., "token_embedder": ...}` of numpy arrays in MaxText's `weight_dtype`.

    Raises:
      ValueError: a config MaxText rejects or the mapping does not cover, a checkpoint of
        another architecture or other sizes (naming the field), a tensor missing or extra.
    """
    directory = os.path.abspath(os.fspath(directory))
    config = mt.maxtext_config(maxtext_args, PROG)
    spec = names.model_spec(config)
    _hf_config(directory, spec)
    tree = load_hf_checkpoint(directory, name_map=name_map_of(spec))
    dtype = np.dtype(str(getattr(config.weight_dtype, "name", config.weight_dtype)))
    return to_maxtext_tree(names.flat_hf(tree), spec, dtype=dtype)


def save_params(directory: str, params: dict) -> str:
    """Writes MaxText's parameter checkpoint of `params` into `directory`.

    MaxText's own `save_params_to_path`. Returns its `items` folder, the
    `load_parameters_path`.
    """
    checkpointing = mt.import_maxtext("maxtext.common.checkpointing")
    checkpointing.save_params_to_path(directory, {"params": params})
    return os.path.join(directory, "items")


def import_checkpoint(
    directory: str | os.PathLike,
    out: str | os.PathLike,
    maxtext_args: Sequence[str],
    *,
    force: bool = False,
) -> str:
    """Writes a Hugging Face checkpoint as MaxText's parameter checkpoint at `out`.

    Args:
      directory: the Hugging Face checkpoint.
      out: the folder to write (must not hold files unless `force`).
      maxtext_args: as `load_params`.
      force: replace an `out` that holds files.

    Returns:
      The path to give MaxText as `load_parameters_path` (`out/items`).
    """
    out = check_out(os.fspath(out), force, PROG)
    params = load_params(directory, maxtext_args)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".{os.path.basename(out)}.import-{uuid.uuid4().hex[:8]}")
    try:
        save_params(staging, params)
        if os.path.isdir(out) and os.listdir(out):
            if not force:
                raise FileExistsError(f"{PROG}: --out {out} was filled while importing")
            old = f"{staging}.old"
            os.rename(out, old)  # the old folder aside, the new one in, then the old removed
            os.rename(staging, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return os.path.join(out, "items")


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m nvfp4_jax.maxtext.load HF_DIR <MaxText config> [key=value ...] --out DIR`.

    Prints the `load_parameters_path` to train from. A failure exits with status 1 and
    writes nothing to `--out`.

    Args:
      argv: the command line, program name first (default `sys.argv`).
    """
    argv = sys.argv if argv is None else list(argv)
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Writes a Hugging Face (ModelOpt NVFP4) checkpoint as MaxText's parameter "
            "checkpoint, to fine-tune with python -m nvfp4_jax.maxtext ... "
            "load_parameters_path=DIR/items. Every argument after HF_DIR not listed here goes "
            "to MaxText: its config file, then key=value overrides of the model."
        ),
        allow_abbrev=False,
    )
    parser.add_argument("checkpoint", type=pathlib.Path, metavar="HF_DIR")
    parser.add_argument("--out", required=True, type=pathlib.Path, metavar="DIR")
    parser.add_argument("--force", action="store_true", help="replace --out if it holds files")
    options, rest = parser.parse_known_args(argv[1:])
    unknown = [a for a in rest if a.startswith("--")]
    if unknown:
        parser.error(f"unrecognized flag {unknown[0]}")
    try:
        items = import_checkpoint(options.checkpoint, options.out, rest, force=options.force)
    except (ValueError, TypeError, FileExistsError, ImportError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"MaxText parameter checkpoint written: load_parameters_path={items}")


__all__ = ["import_checkpoint", "load_params", "main", "save_params"]
