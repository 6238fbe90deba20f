"""MaxText itself, for the export and the import.

Its config, a checkpoint's weights, its model holding given weights, and the calibration
pass over its data pipeline.

Every function imports MaxText when called (`nvfp4_jax.maxtext` imports without it) and
turns MaxText's refusals into `ValueError`s that say what was given: a config MaxText
rejects, a `load_parameters_path` that holds no checkpoint (with the steps the run has), a
checkpoint whose weights are not the config's model.
"""

from __future__ import annotations

import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from nvfp4_jax._src.integrations import maxtext_names as names
from nvfp4_jax._src.integrations.maxtext import (
    QUANTIZATION,
    check_config,
    needs,
    provider_hook,
    rules_from_config,
)
from nvfp4_jax._src.model.convert.rules import Rule
from nvfp4_jax._src.training.recipe import NVFP4Recipe

MAXTEXT = "MaxText (pip package maxtext 0.2.5, Python >= 3.12)"


def import_maxtext(module: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as error:
        raise needs(MAXTEXT) from error


def _short(error: BaseException) -> str:
    """The error's first lines (pydantic puts the field on the second), at most 400 chars."""
    lines = [line.strip() for line in f"{type(error).__name__}: {error}".splitlines()]
    text = " ".join(line for line in lines[:3] if line and not line.startswith("For further"))
    return text if len(text) <= 400 else text[:400] + " ..."


def maxtext_config(argv: Sequence[str], what: str, **overrides: Any):
    """MaxText's config of `argv` (its config file, then `key=value` overrides).

    `overrides` replace any value of theirs given in `argv`.

    Raises:
      ValueError: MaxText rejects the config (its own message, shortened), naming `what`.
    """
    pyconfig = import_maxtext("maxtext.configs.pyconfig")
    args = [a for a in argv if a.split("=", 1)[0] not in overrides]
    # An empty value is MaxText's default: MaxText reads `key=` as None, so it is left out.
    args += [f"{key}={value}" for key, value in overrides.items() if value != ""]
    if not args or "=" in args[0]:
        raise ValueError(
            f"{what}: the first MaxText argument must be its config file (e.g. "
            "src/maxtext/configs/base.yml), then key=value overrides"
        )
    try:
        return pyconfig.initialize([what, *args])
    except (ValueError, TypeError, KeyError, AssertionError, AttributeError) as error:
        raise ValueError(f"{what}: MaxText rejects the config: {_short(error)}") from error
    except Exception as error:  # pydantic's ValidationError and MaxText's own classes
        if type(error).__module__.split(".")[0] in ("pydantic", "pydantic_core", "maxtext"):
            raise ValueError(f"{what}: MaxText rejects the config: {_short(error)}") from error
        raise


def _steps(root: pathlib.Path) -> list[int]:
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and p.is_dir())


def checkpoint_items(path: str, what: str) -> str:
    """The `items` folder of MaxText's checkpoint at `path`, checked to exist.

    `path` is `<run>/checkpoints/<step>` or its `items`.

    Raises:
      ValueError: no such checkpoint, naming the steps the run's `checkpoints` folder holds.
    """
    if not path:
        raise ValueError(
            f"{what}: give the trained checkpoint as load_parameters_path="
            "<base_output_directory>/<run_name>/checkpoints/<step>/items"
        )
    folder = pathlib.Path(path)
    items = folder if folder.name == "items" else folder / "items"
    if items.is_dir() and any(items.iterdir()):
        return str(items)
    step_dir = items.parent
    steps = _steps(step_dir.parent)
    hint = (
        f"the run's steps in {step_dir.parent}: {steps}"
        if steps
        else f"{step_dir.parent} holds no checkpoint step (was enable_checkpointing=True?)"
    )
    raise ValueError(f"{what}: load_parameters_path={path}: no MaxText checkpoint there; {hint}")


def trained_params(config, what: str) -> dict:
    """The weights of the checkpoint `config.load_parameters_path`, read by MaxText itself.

    MaxText's tree of numpy arrays (`{"decoder": ..., "token_embedder": ...}`).

    Raises:
      ValueError: the checkpoint is missing or does not hold the config's model.
    """
    items = checkpoint_items(config.load_parameters_path, what)
    spec = names.model_spec(config)

    def mismatch(detail: str) -> ValueError:
        return ValueError(
            f"{what}: the checkpoint {config.load_parameters_path} does not hold the model "
            f"the MaxText config makes (decoder_block={spec.family.block}, "
            f"scan_layers={spec.scan_layers}): {detail}"
        )

    stored = stored_shapes(items)
    if stored is not None:
        problem = _shape_problem(stored, names.expected_shapes(spec))
        if problem:
            raise mismatch(problem)
    creation = import_maxtext("maxtext.utils.model_creation_utils")
    nnx = import_maxtext("flax.nnx")
    try:
        model, _ = creation.from_pretrained(config)
        pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return jax.tree.map(np.asarray, pure)
    except Exception as error:  # MaxText's and orbax's errors for a checkpoint of another tree
        raise mismatch(_short(error)) from error


def stored_shapes(items: str) -> dict[tuple[str, ...], tuple[int, ...]] | None:
    """`{leaf path: shape}` of the weights MaxText's checkpoint `items` folder holds.

    Read from its metadata (no array is read); None when orbax cannot tell.
    """
    ocp = import_maxtext("orbax.checkpoint").v1
    try:
        tree = ocp.metadata(os.path.dirname(items), checkpointable_name="items").metadata
        weights = tree["params"]["params"]
    except Exception:  # noqa: BLE001  (MaxText's own load then reports what it finds)
        return None
    out = {}

    def walk(node, path):
        if isinstance(node, Mapping):
            for key, value in node.items():
                walk(value, (*path, str(key)))
        elif hasattr(node, "shape"):
            out[path] = tuple(node.shape)

    walk(weights, ())
    return out


def _shape_problem(stored: Mapping, expected: Mapping) -> str:
    """What first differs between the stored leaves and the config's model, or ""."""
    for path, shape in expected.items():
        if path not in stored:
            held = sorted("/".join(p) for p in stored)[:4]
            return f"it has no {'/'.join(path)} (it holds {held} ...)"
        if tuple(stored[path]) != tuple(shape):
            return f"its {'/'.join(path)} is {tuple(stored[path])}, the config's model {shape}"
    extra = sorted(set(stored) - set(expected))
    if extra:
        return f"it holds {'/'.join(extra[0])}, which the config's model has not"
    return ""


def model_holding(config, params: Mapping):
    """MaxText's model of `config` holding `params` (MaxText's tree), built by MaxText.

    With `quantization=fp4 use_qwix_quantization=True` in the config, MaxText hands the model
    to qwix with the provider the active hook returns (`provider_hook`).
    """
    creation = import_maxtext("maxtext.utils.model_creation_utils")
    utils_nnx = import_maxtext("maxtext.utils.maxtext_utils_nnx")
    nnx = import_maxtext("flax.nnx")
    model = creation.from_config(config, rngs=utils_nnx.create_nnx_rngs(config))
    state = nnx.state(model, nnx.Param)
    pure = jax.tree.map(lambda a: a, nnx.to_pure_dict(state))
    _check_same_tree(pure, params)
    nnx.replace_by_pure_dict(state, jax.tree.map(np.asarray, dict(params)))
    nnx.update(model, state)
    return model


def _check_same_tree(model_tree: Mapping, params: Mapping) -> None:
    ours = {p: np.shape(v) for p, v in _flat(model_tree).items()}
    theirs = {p: np.shape(v) for p, v in _flat(params).items()}
    if ours != theirs:
        diff = sorted(set(ours.items()) ^ set(theirs.items()))
        raise ValueError(
            f"nvfp4_jax.maxtext: the weights are not the MaxText config's model: {diff[:3]}"
        )


def _flat(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        out.update(_flat(value, path) if isinstance(value, Mapping) else {path: value})
    return out


def forward(model, tokens) -> np.ndarray:
    """MaxText's logits (B, T, V) of `tokens` (B, T), positions 0..T-1, one segment."""
    jnp = jax.numpy
    tokens = jnp.asarray(tokens, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    logits = model(
        tokens, positions, decoder_segment_ids=jnp.ones_like(tokens), enable_dropout=False
    )
    return np.asarray(logits.astype(jnp.float32))


def calibrate(
    argv: Sequence[str],
    params: Mapping,
    spec: names.ModelSpec,
    *,
    recipe: NVFP4Recipe,
    rules: Sequence[Rule],
    batches: int,
    what: str,
) -> dict[str, np.float32]:
    """Each NVFP4 linear's activation amax over `batches` batches of MaxText's data pipeline.

    The model is MaxText's, unscanned (each layer its own module path), holding `params`, and
    runs the NVFP4 forward of training (the launcher's provider, which also records: see
    `maxtext_calibration`). The data is what `argv`'s config gives MaxText's trainer
    (`dataset_type`, `dataset_path`, ...).

    Returns:
      `{unscanned MaxText leaf path: amax}` (`decoder/layers_0/self_attention/query/kernel`).
    """
    from nvfp4_jax._src.integrations.maxtext_calibration import AmaxRecorder  # noqa: PLC0415

    config = maxtext_config(
        argv,
        what,
        scan_layers=False,
        load_parameters_path="",
        quantization=QUANTIZATION,
        use_qwix_quantization=True,
        enable_checkpointing=False,
    )
    unscanned = names.model_spec(config)
    check_config(config)

    def make(config):
        return AmaxRecorder(rules_from_config(config, recipe, rules=rules))

    with provider_hook(make) as providers:
        model = model_holding(config, names.restack(params, spec, unscanned))
    recorder = providers[-1]
    recorder.clear()  # qwix's pass over dummy tokens recorded too
    pipeline = import_maxtext("maxtext.input_pipeline.input_pipeline_interface")
    train, _ = pipeline.create_data_iterator(config, model.mesh)
    for _ in range(batches):
        batch = next(train)
        model(
            batch["inputs"],
            batch["inputs_position"],
            decoder_segment_ids=batch["inputs_segmentation"],
            enable_dropout=False,
        )
    jax.effects_barrier()
    return dict(recorder.amaxes)


def tokenizer_file(config) -> tuple[str, str] | None:
    """(path, MaxText's tokenizer_type) of the tokenizer the config names, where it exists.

    A relative path is looked for in the current folder, then (MaxText's configs name
    `src/maxtext/assets/...`, a path of its source tree) in the installed package.
    """
    raw = str(getattr(config, "tokenizer_path", "") or "")
    kind = str(getattr(getattr(config, "tokenizer_type", ""), "value", "")).lower()
    if not raw:
        return None
    candidates = [raw, os.path.abspath(raw)]
    match = re.search(r"(?:^|/)src/maxtext/(.+)$", raw) or re.search(r"(?:^|/)maxtext/(.+)$", raw)
    if match:
        package = pathlib.Path(import_maxtext("maxtext").__file__).parent
        candidates.append(str(package / match.group(1)))
    for candidate in candidates:
        if os.path.exists(candidate):
            return candidate, kind
    return None
