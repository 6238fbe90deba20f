"""NVFP4 training for MaxText: `python -m nvfp4_jax.maxtext <MaxText train arguments>`.

MaxText (`maxtext` 0.2.5) takes its quantization from a closed enum (`quantization:` in its
config) whose only NVFP4 value, `te_nvfp4`, is TransformerEngine's (Blackwell GPUs only).
Its qwix modes (`use_qwix_quantization=True`) build the model, then hand it to
`qwix.quantize_model` with the provider `maxtext.layers.quantizations.get_qt_provider(config)`
returns. That function is the one hook this module needs: `install()` replaces it, at run
time, by one that returns an `NVFP4Provider` (`provider_from_config`) for the quantization
value the launcher runs under (`QUANTIZATION`), and `main` (the launcher) installs it and
runs MaxText's own `train.main`.

What is quantized mirrors MaxText's own qwix modes (`get_quantization_rule`): the decoder
layers (`decoder/.*layers.*`, and `mtp_block/.*` with `quantize_mtp`) compute their
`dot_general`, weight `einsum` and `ragged_dot` (the dropless MoE experts) with the NVFP4
recipe; the MoE router (`gate`), the embedding, the output projection (`logits_dense`) and
attention's activation-by-activation products stay in high precision.

MaxText and qwix are imported only when used: `import nvfp4_jax.maxtext` works without
them; using it without them raises an ImportError naming `scripts/maxtext_env.sh`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from nvfp4_jax._src.model.rules import Rule, check_rules
from nvfp4_jax._src.training.recipe import NVFP4Recipe

# MaxText's `quantization` is a closed enum: the launcher runs under its `fp4` value (the one
# closest in name), with `use_qwix_quantization=True`, and the hook answers that value with
# the NVFP4 provider. Only `get_qt_provider` reads the value's meaning under qwix; MaxText's
# other checks ask only whether some quantization is set.
QUANTIZATION = "fp4"
ENV_SCRIPT = "scripts/maxtext_env.sh"

# The module paths MaxText's qwix rules quantize (`get_quantization_rule`): the decoder
# layers, and the multi-token-prediction block with `quantize_mtp`.
DECODER_LAYERS = "decoder/.*layers.*"
MTP_BLOCK = "mtp_block/.*"
# MaxText's router rule (`_get_router_proj_unquantized_rule`): the MoE gate projection.
ROUTER = r".*/gate$"
OP_NAMES = ("dot_general", "einsum", "ragged_dot")


def _needs(what: str) -> ImportError:
    return ImportError(
        f"nvfp4_jax.maxtext needs {what}: run `bash {ENV_SCRIPT}` (it makes .maxtext-venv with "
        "Python 3.12, maxtext 0.2.5, qwix and nvfp4_jax) and use .maxtext-venv/bin/python"
    )


def _qwix_integration():
    """nvfp4_jax's qwix provider module (qwix imported on first use)."""
    try:
        from nvfp4_jax._src.integrations import qwix as integration  # noqa: PLC0415
    except ImportError as error:
        raise _needs("qwix") from error
    return integration


def _quantizations():
    """MaxText's `maxtext.layers.quantizations` module, where `get_qt_provider` lives."""
    try:
        from maxtext.layers import quantizations  # noqa: PLC0415  (optional, Python >= 3.12)
    except ImportError as error:
        raise _needs("MaxText (pip package maxtext 0.2.5, Python >= 3.12)") from error
    return quantizations


def check_config(config: Any) -> None:
    """Raises where MaxText's config would leave matmuls silently outside NVFP4.

    An MoE's experts reach the provider only as `jax.lax.ragged_dot` (or a weight einsum
    with `sparse_matmul=False`); MaxText's megablox and tokamax grouped-GEMM kernels, its
    default for `sparse_matmul=True`, bypass it and would train the experts in bf16. The
    batch-split schedule skips qwix altogether.

    Args:
      config: MaxText's config (`pyconfig.HyperParameters`) or any object with its fields.

    Raises:
      ValueError: naming the setting to change.

    Example:
      >>> from types import SimpleNamespace as Config
      >>> check_config(Config(num_experts=8, sparse_matmul=True, megablox=False,
      ...                     use_tokamax_gmm=False))
    """

    def field(name, default=False):
        return getattr(config, name, default)

    if field("use_batch_split_schedule"):
        raise ValueError(
            "nvfp4_jax.maxtext: use_batch_split_schedule=True bypasses qwix, so nothing would "
            "train in NVFP4; set use_batch_split_schedule=False"
        )
    if field("num_experts", 1) > 1 and field("sparse_matmul", True):
        kernels = [
            f"{name}=True"
            for name in ("megablox", "use_tokamax_gmm")
            if field(name, name == "megablox")
        ]
        if kernels:
            raise ValueError(
                f"nvfp4_jax.maxtext: the MoE experts would stay in bf16: {' and '.join(kernels)} "
                "run MaxText's own grouped-GEMM kernel, which bypasses jax.lax.ragged_dot (the op "
                "NVFP4 intercepts); set megablox=False use_tokamax_gmm=False (the experts then "
                "run jax.lax.ragged_dot, in NVFP4), or sparse_matmul=False (a dense einsum)"
            )


def rules_from_config(
    config: Any,
    recipe: NVFP4Recipe | None = None,
    *,
    rules: Sequence[Rule] = (),
) -> list:
    """The `NVFP4Rule`s of a MaxText config: MaxText's qwix rules with the NVFP4 recipe.

    Args:
      config: MaxText's config (reads `quantize_mtp`).
      recipe: the recipe of the quantized ops (default `NVFP4Recipe()`).
      rules: nvfp4_jax `Rule`s put first (first match wins), matched with `re.search`
        against the path qwix sees (`decoder/layers/mlp/wi_0`); `Rule(..., None)` keeps ops
        in high precision.

    Returns:
      `rules` converted, the router kept in high precision, then the decoder layers (and
      the MTP block with `quantize_mtp`) in NVFP4.

    Example:
      >>> from types import SimpleNamespace as Config
      >>> [r.module_path for r in rules_from_config(Config(quantize_mtp=False))]
      ['.*/gate$', 'decoder/.*layers.*']
    """
    integration = _qwix_integration()
    recipe = NVFP4Recipe() if recipe is None else recipe
    if not isinstance(recipe, NVFP4Recipe):
        raise TypeError(f"rules_from_config: recipe must be an NVFP4Recipe, got {recipe!r}")
    converted = [integration.NVFP4Rule.from_rule(rule) for rule in check_rules(rules)]
    paths = [DECODER_LAYERS] + ([MTP_BLOCK] if getattr(config, "quantize_mtp", False) else [])
    return [
        *converted,
        integration.NVFP4Rule(module_path=ROUTER, recipe=None),
        integration.NVFP4Rule(
            module_path=paths[0] if len(paths) == 1 else f"({'|'.join(paths)})",
            op_names=OP_NAMES,
            recipe=recipe,
        ),
    ]


def provider_from_config(
    config: Any,
    recipe: NVFP4Recipe | None = None,
    *,
    rules: Sequence[Rule] = (),
):
    """The `NVFP4Provider` MaxText's qwix path quantizes the model with (`get_qt_provider`).

    Stochastic rounding keys: MaxText's nnx trainer deletes the `qwix_rngs` it lends qwix
    once the model is quantized and hands no rng stream to the train step (its `aqt` stream
    is consumed at initialization), so each GEMM derives its key from the bits of its
    incoming gradient, as the drop-ins do with `key=None`: a fresh key every step.

    Args:
      config: MaxText's config; `check_config` runs on it first.
      recipe: the recipe of the quantized ops (default `NVFP4Recipe()`).
      rules: nvfp4_jax `Rule`s put before MaxText's (see `rules_from_config`).

    Returns:
      An `nvfp4_jax.qwix.NVFP4Provider`; its `report` fills as MaxText traces the model.

    Raises:
      ValueError: where MaxText would bypass the provider (`check_config`).
    """
    check_config(config)
    return _qwix_integration().NVFP4Provider(rules_from_config(config, recipe, rules=rules))


@contextlib.contextmanager
def install(recipe: NVFP4Recipe | None = None, *, rules: Sequence[Rule] = ()) -> Iterator[list]:
    """Routes MaxText's `quantization=fp4` (under qwix) to NVFP4 while the block runs.

    Replaces `maxtext.layers.quantizations.get_qt_provider` (the one MaxText attribute
    touched) by a function that answers `config.quantization == "fp4"` with
    `provider_from_config(config, recipe, rules=rules)` and every other value as MaxText
    does; the original comes back on exit.

    Args:
      recipe: the recipe of the quantized ops (default `NVFP4Recipe()`).
      rules: nvfp4_jax `Rule`s put before MaxText's (see `rules_from_config`).

    Yields:
      The list of the providers made so far (one per model MaxText builds), whose
      `report`s say what became of every op.
    """
    quantizations = _quantizations()
    original = quantizations.get_qt_provider
    providers: list = []

    def get_qt_provider(config):
        if getattr(config, "quantization", "") != QUANTIZATION:
            return original(config)
        provider = provider_from_config(config, recipe, rules=rules)
        providers.append(provider)
        return provider

    quantizations.get_qt_provider = get_qt_provider
    try:
        yield providers
    finally:
        quantizations.get_qt_provider = original


def _maxtext_args(args: Sequence[str]) -> list[str]:
    """MaxText's arguments with `quantization=fp4 use_qwix_quantization=True` set."""
    args = list(args)
    given = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in args if "=" in a}
    if given.get("quantization", QUANTIZATION) != QUANTIZATION:
        raise SystemExit(
            f"python -m nvfp4_jax.maxtext: quantization={given['quantization']} was given; the "
            f"launcher trains in NVFP4 under quantization={QUANTIZATION} (leave it out)"
        )
    if given.get("use_qwix_quantization", "true").lower() not in ("true", "1"):
        raise SystemExit(
            "python -m nvfp4_jax.maxtext: NVFP4 goes through MaxText's qwix path; leave "
            "use_qwix_quantization out (the launcher sets it to True)"
        )
    if "quantization" not in given:
        args.append(f"quantization={QUANTIZATION}")
    if "use_qwix_quantization" not in given:
        args.append("use_qwix_quantization=True")
    return args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nvfp4_jax.maxtext",
        description=(
            "Runs MaxText's train.main with its decoder layers' GEMMs in NVFP4 (nvfp4_jax's "
            "qwix provider). Every argument not listed here goes to MaxText: its config file, "
            "then key=value overrides."
        ),
        allow_abbrev=False,
    )
    parser.add_argument(
        "--nvfp4-rules",
        type=pathlib.Path,
        metavar="FILE",
        help='a JSON list of nvfp4_jax rules, e.g. [{"pattern": "mlp/wo$", "recipe": null}] '
        "(a recipe is NVFP4Recipe fields or null: high precision), put before MaxText's; "
        "matched with re.search against qwix's module paths",
    )
    parser.add_argument(
        "--nvfp4-recipe",
        metavar="JSON",
        default="{}",
        help="NVFP4Recipe fields as a JSON object, e.g. '{\"stochastic_rounding\": false}'",
    )
    parser.add_argument(
        "--nvfp4-report",
        type=pathlib.Path,
        metavar="FILE",
        help="write what became of every intercepted op (the providers' reports) as JSON",
    )
    return parser


def _load_rules(parser: argparse.ArgumentParser, path: pathlib.Path | None) -> list[Rule]:
    """The rules of --nvfp4-rules FILE; a bad file exits with status 2 naming it."""
    if path is None:
        return []
    try:
        entries = json.loads(path.read_text())
        if not isinstance(entries, list):
            raise ValueError("expected a JSON list of rules")
        return check_rules([Rule.from_dict(entry) for entry in entries])
    except (OSError, ValueError, TypeError, KeyError) as error:
        parser.error(f"--nvfp4-rules {path}: {error}")


def _load_recipe(parser: argparse.ArgumentParser, text: str) -> NVFP4Recipe:
    """The recipe of --nvfp4-recipe JSON; a bad one exits with status 2 naming it."""
    try:
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise ValueError("expected a JSON object of NVFP4Recipe fields")
        return NVFP4Recipe(**fields)
    except (ValueError, TypeError) as error:
        parser.error(f"--nvfp4-recipe {text}: {error}")


def _write_report(path: pathlib.Path, providers: list) -> None:
    """Writes the providers' reports as JSON, atomically (a temporary file, then a rename)."""
    report = [provider.report.to_dict() for provider in providers]
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(report, indent=1))
    partial.replace(path)


def main(argv: Sequence[str] | None = None) -> None:
    """The launcher: `python -m nvfp4_jax.maxtext <MaxText train arguments> [--nvfp4-...]`.

    Parses its own `--nvfp4-*` flags (a bad one exits with status 2 naming it), sets
    `quantization=fp4 use_qwix_quantization=True` in MaxText's arguments, installs the hook
    and runs MaxText's `train.main`.

    Args:
      argv: the command line, program name first (default `sys.argv`).
    """
    argv = sys.argv if argv is None else list(argv)
    parser = _parser()
    options, rest = parser.parse_known_args(argv[1:])
    recipe = _load_recipe(parser, options.nvfp4_recipe)
    rules = _load_rules(parser, options.nvfp4_rules)
    maxtext_argv = [argv[0], *_maxtext_args(rest)]
    _quantizations()
    from maxtext.trainers.pre_train import train  # noqa: PLC0415  (optional, Python >= 3.12)

    with install(recipe, rules=rules) as providers:
        try:
            train.main(maxtext_argv)
        finally:
            if options.nvfp4_report is not None:
                _write_report(options.nvfp4_report, providers)


__all__ = [
    "QUANTIZATION",
    "check_config",
    "install",
    "main",
    "provider_from_config",
    "rules_from_config",
]
