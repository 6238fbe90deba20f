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
import dataclasses
import json
import os
import pathlib
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import jax

from nvfp4_jax._src.model.convert.rules import Rule, check_rules
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


def needs(what: str) -> ImportError:
    return ImportError(
        f"nvfp4_jax.maxtext needs {what}: run `bash {ENV_SCRIPT}` (it makes .maxtext-venv with "
        "Python 3.12, maxtext 0.2.5, qwix and nvfp4_jax) and use .maxtext-venv/bin/python"
    )


def qwix_integration():
    """nvfp4_jax's qwix provider module (qwix imported on first use)."""
    try:
        from nvfp4_jax._src.integrations import qwix as integration  # noqa: PLC0415
    except ImportError as error:
        raise needs("qwix") from error
    return integration


def maxtext_quantizations():
    """MaxText's `maxtext.layers.quantizations` module, where `get_qt_provider` lives."""
    try:
        from maxtext.layers import quantizations  # noqa: PLC0415  (optional, Python >= 3.12)
    except ImportError as error:
        raise needs("MaxText (pip package maxtext 0.2.5, Python >= 3.12)") from error
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
    integration = qwix_integration()
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
    return qwix_integration().NVFP4Provider(rules_from_config(config, recipe, rules=rules))


def install(recipe: NVFP4Recipe | None = None, *, rules: Sequence[Rule] = ()):
    """Routes MaxText's `quantization=fp4` (under qwix) to NVFP4 while the block runs.

    Replaces `maxtext.layers.quantizations.get_qt_provider` (the one MaxText attribute
    touched) by a function that answers `config.quantization == "fp4"` with
    `provider_from_config(config, recipe, rules=rules)` and every other value as MaxText
    does; the original comes back on exit.

    Args:
      recipe: the recipe of the quantized ops (default `NVFP4Recipe()`).
      rules: nvfp4_jax `Rule`s put before MaxText's (see `rules_from_config`).

    Returns:
      A context manager yielding the list of the providers made so far (one per model
      MaxText builds), whose `report`s say what became of every op.
    """
    return provider_hook(lambda config: provider_from_config(config, recipe, rules=rules))


@contextlib.contextmanager
def provider_hook(make_provider: Callable[[Any], Any]) -> Iterator[list]:
    """`install`'s hook with any provider: `make_provider(config)` answers `quantization=fp4`.

    (The export's calibration pass hooks its recording provider in this way.)
    """
    quantizations = maxtext_quantizations()
    original = quantizations.get_qt_provider
    providers: list = []

    def get_qt_provider(config):
        if getattr(config, "quantization", "") != QUANTIZATION:
            return original(config)
        provider = make_provider(config)
        providers.append(provider)
        return provider

    quantizations.get_qt_provider = get_qt_provider
    try:
        yield providers
    finally:
        quantizations.get_qt_provider = original


def _maxtext_args(parser: argparse.ArgumentParser, args: Sequence[str]) -> list[str]:
    """MaxText's arguments with `quantization=fp4 use_qwix_quantization=True` set.

    Another `quantization=` or `use_qwix_quantization=False` exits with status 2 naming it.
    """
    args = list(args)
    given = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in args if "=" in a}
    if given.get("quantization", QUANTIZATION) != QUANTIZATION:
        parser.error(
            f"quantization={given['quantization']} was given; the launcher trains in NVFP4 "
            f"under quantization={QUANTIZATION} (leave it out)"
        )
    if given.get("use_qwix_quantization", "true").lower() not in ("true", "1"):
        parser.error(
            "NVFP4 goes through MaxText's qwix path; leave use_qwix_quantization out (the "
            "launcher sets it to True)"
        )
    if "quantization" not in given:
        args.append(f"quantization={QUANTIZATION}")
    if "use_qwix_quantization" not in given:
        args.append("use_qwix_quantization=True")
    return args


class _Once(argparse.Action):
    """Stores a flag's value; the flag given twice exits with status 2 (which one would win?)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = vars(namespace).setdefault("given_flags", set())
        if self.dest in given:
            parser.error(f"{option_string} was given twice")
        given.add(self.dest)
        setattr(namespace, self.dest, values)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nvfp4_jax.maxtext",
        description=(
            "Runs MaxText's train.main with its decoder layers' GEMMs in NVFP4 (nvfp4_jax's "
            "qwix provider). Every argument not listed here goes to MaxText: its config file, "
            "then key=value overrides. The flags and their files are checked before MaxText "
            "starts."
        ),
        allow_abbrev=False,
    )
    parser.add_argument(
        "--nvfp4-rules",
        type=pathlib.Path,
        action=_Once,
        metavar="FILE",
        help='a JSON list of nvfp4_jax rules, e.g. [{"pattern": "mlp/wo$", "recipe": null}] '
        "(a recipe is NVFP4Recipe fields or null: high precision), put before MaxText's; "
        "matched with re.search against qwix's module paths",
    )
    parser.add_argument(
        "--nvfp4-recipe",
        action=_Once,
        metavar="JSON",
        default="{}",
        help="NVFP4Recipe fields as a JSON object, e.g. '{\"stochastic_rounding\": false}'",
    )
    parser.add_argument(
        "--nvfp4-report",
        type=pathlib.Path,
        action=_Once,
        metavar="FILE",
        help="write what became of every intercepted op (the providers' reports) and how the "
        "run ended as JSON, also when it fails; FILE must not exist (its folder is made)",
    )
    return parser


def load_rules(parser: argparse.ArgumentParser, path: pathlib.Path | None) -> tuple[Rule, ...]:
    """The rules of --nvfp4-rules FILE; a bad file exits with status 2 naming it."""
    if path is None:
        return ()
    try:
        entries = json.loads(path.read_text())
        if not isinstance(entries, list):
            raise ValueError("expected a JSON list of rules")
        rules = []
        for index, entry in enumerate(entries):
            if not isinstance(entry, dict) or "pattern" not in entry or "recipe" not in entry:
                raise ValueError(
                    f'rule [{index}] is {entry!r}; expected {{"pattern": ..., "recipe": ...}}'
                )
            rules.append(Rule.from_dict(entry))
        return check_rules(rules)
    except (OSError, ValueError, TypeError, KeyError) as error:
        parser.error(f"--nvfp4-rules {path}: {error}")


def compile_rules(
    parser: argparse.ArgumentParser,
    path: pathlib.Path | None,
    recipe: NVFP4Recipe,
    rules: Sequence[Rule],
) -> None:
    """Builds the provider the hook builds, so that a rule it refuses exits now (status 2).

    A `Rule` compiles its pattern for `re.search`; qwix matches with `re.fullmatch`, so the
    provider rewrites each pattern (`NVFP4Rule.from_rule`), and a pattern valid one way may
    not be the other. Without this check the refusal would come once MaxText has started.
    """
    integration = qwix_integration()
    flag = f"--nvfp4-rules {path}"
    for index, rule in enumerate(rules):
        try:
            integration.NVFP4Rule.from_rule(rule)
        except (ValueError, TypeError) as error:
            parser.error(f"{flag}: rule [{index}] (pattern {rule.pattern!r}): {error}")
    try:
        for mtp in (False, True):  # MaxText's rules with and without the MTP block
            config = SimpleNamespace(quantize_mtp=mtp)
            integration.NVFP4Provider(rules_from_config(config, recipe, rules=rules))
    except (ValueError, TypeError) as error:
        parser.error(f"{flag if path else '--nvfp4-recipe'}: the provider refuses it: {error}")


def load_recipe(parser: argparse.ArgumentParser, text: str) -> NVFP4Recipe:
    """The recipe of --nvfp4-recipe JSON; a bad one exits with status 2 naming it."""
    try:
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise ValueError("expected a JSON object of NVFP4Recipe fields")
        return NVFP4Recipe(**fields)
    except (ValueError, TypeError) as error:
        parser.error(f"--nvfp4-recipe {text}: {error}")


def _check_report(
    parser: argparse.ArgumentParser, path: pathlib.Path | None
) -> pathlib.Path | None:
    """The absolute path of --nvfp4-report FILE, its folder made and written to once.

    A report is never overwritten, so an existing FILE exits with status 2, as does a folder
    that cannot be made or written; all before MaxText starts, not after it has trained.
    """
    if path is None:
        return None
    flag = f"--nvfp4-report {path}"
    if path.is_dir():
        parser.error(f"{flag}: is a folder; give the report's file name")
    if os.path.lexists(path):
        parser.error(f"{flag}: exists; a report is never overwritten (move it or give another)")
    path = path.absolute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        parser.error(f"{flag}: cannot write in {path.parent}: {error.strerror or error}")
    return path


@dataclasses.dataclass(frozen=True)
class _Launch:
    """The launcher's checked flags and MaxText's arguments."""

    recipe: NVFP4Recipe
    rules: tuple[Rule, ...]
    report: pathlib.Path | None
    maxtext_argv: list[str]


def _check_launch(argv: Sequence[str]) -> _Launch:
    """Every launcher flag and file, checked; a bad one exits with status 2 naming it."""
    parser = _parser()
    options, rest = parser.parse_known_args(argv[1:])
    # A misspelt launcher flag would otherwise reach MaxText as one of its arguments.
    unknown = [arg for arg in rest if arg.startswith("--nvfp4")]
    if unknown:
        parser.error(
            f"unrecognized launcher flag {unknown[0]} (the launcher's are --nvfp4-rules, "
            "--nvfp4-recipe and --nvfp4-report)"
        )
    maxtext_argv = [argv[0], *_maxtext_args(parser, rest)]
    recipe = load_recipe(parser, options.nvfp4_recipe)
    rules = load_rules(parser, options.nvfp4_rules)
    compile_rules(parser, options.nvfp4_rules, recipe, rules)
    report = _check_report(parser, options.nvfp4_report)
    return _Launch(recipe, rules, report, maxtext_argv)


def _report(providers: list, error: BaseException | None) -> dict:
    """The JSON of --nvfp4-report: how the run ended and the providers' reports."""
    return {
        "status": "completed" if error is None else "failed",
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "providers": [provider.report.to_dict() for provider in providers],
    }


def _primary() -> bool:
    """Whether this process writes the report: in a multi-process run each runs the launcher."""
    try:
        return jax.process_index() == 0
    except Exception:  # noqa: BLE001  (no JAX backend: the run failed before it started one)
        return True


def _write_report(path: pathlib.Path, report: dict) -> None:
    """Writes `report` as JSON at `path` atomically, never over an existing file.

    A temporary file in the same folder, then a hard link to `path`, which fails where a file
    is already there (a rename would replace it).
    """
    if not _primary():
        return
    handle, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(handle, "w") as file:
        json.dump(report, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    try:
        os.link(partial, path)
    except FileExistsError:
        raise FileExistsError(
            f"--nvfp4-report {path}: a file appeared there while MaxText ran and is kept; this "
            f"run's report is {partial}"
        ) from None
    except OSError:  # a filesystem without hard links: claim the name, then rename onto it
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        os.replace(partial, path)
        return
    os.unlink(partial)


def _report_failure(path: pathlib.Path | None, providers: list, error: BaseException) -> None:
    """Writes the report of a run that raised `error`, which stays the error raised.

    A failure to write is printed, not raised, so that it does not hide the run's own.
    """
    if path is None:
        return
    clean_exit = isinstance(error, SystemExit) and error.code in (0, None)
    try:
        _write_report(path, _report(providers, None if clean_exit else error))
    except Exception as write_error:  # noqa: BLE001  (printed; the run's error is raised)
        print(f"python -m nvfp4_jax.maxtext: no report: {write_error}", file=sys.stderr)


def _run(launch: _Launch, train_main: Callable[[list[str]], Any]) -> None:
    """Runs MaxText's `train_main` under the hook; the report is written however it ends."""
    with install(launch.recipe, rules=launch.rules) as providers:
        try:
            train_main(launch.maxtext_argv)
        except BaseException as error:
            _report_failure(launch.report, providers, error)
            raise
        if launch.report is not None:
            _write_report(launch.report, _report(providers, None))


def main(argv: Sequence[str] | None = None) -> None:
    """The launcher: `python -m nvfp4_jax.maxtext <MaxText train arguments> [--nvfp4-...]`.

    Checks its own `--nvfp4-*` flags and their files before MaxText is imported (a bad one,
    a rule the provider would refuse, an existing or unwritable report file, or
    `quantization=` given, exits with status 2 naming it), sets `quantization=fp4
    use_qwix_quantization=True` in MaxText's arguments, installs the hook and runs MaxText's
    `train.main`. `--nvfp4-report` is written however the run ends, with `"status":
    "failed"` and the error when it raised, and the error is raised on.

    Args:
      argv: the command line, program name first (default `sys.argv`).
    """
    argv = sys.argv if argv is None else list(argv)
    launch = _check_launch(argv)
    maxtext_quantizations()
    from maxtext.trainers.pre_train import train  # noqa: PLC0415  (optional, Python >= 3.12)

    log_as_maxtext()
    _run(launch, train.main)


def log_as_maxtext() -> None:
    """Sets up absl's logging as MaxText's own entry point (absl's `app.run`) does.

    MaxText reports each step (`completed step: 3, ... loss: ...`) with absl's `logging.info`,
    which without absl's handler at INFO goes nowhere. `app.run` itself cannot be used: it
    may run once per process, and `main` may run more often.
    """
    from absl import logging as absl_logging  # noqa: PLC0415  (MaxText's dependency)

    absl_logging.use_absl_handler()
    absl_logging.set_verbosity(absl_logging.INFO)


__all__ = [
    "QUANTIZATION",
    "check_config",
    "install",
    "main",
    "provider_from_config",
    "rules_from_config",
]
