"""The MaxText side of tests/integration/test_maxtext.py: runs in MaxText's own environment
(`.maxtext-venv`, made by `bash scripts/maxtext_env.sh`; Python 3.12, maxtext 0.2.5).

    python tests/integration/maxtext_child.py OUT.json XLA_DUMP_DIR

Writes one JSON object to OUT.json:

* `layers`: MaxText's `DenseGeneral` under the hook's provider against the drop-in
  `nvfp4_jax.dot_general` on the same weights (the output and both gradients, bit for bit),
  and its MoE router (`gate`) against the plain layer; MaxText's expert GEMM call
  (`jax.lax.ragged_dot` from a module holding the experts' kernel, as `RoutedMoE` issues
  it) against `nvfp4_jax.ragged_dot`;
* `dense`, `moe_run`: a tiny MaxText decoder (llama2-style, and Mixtral-style with 4 experts,
  megablox off) trained a few steps through the launcher (`nvfp4_jax.maxtext.main`) and in
  plain MaxText (bf16): each run's losses, the NVFP4 custom calls in its compiled train
  step (XLA's dump), and the provider's report (the dense run keeps its MLP's `wo` in bf16
  with `--nvfp4-rules`);
* `config`, `tiny`, `moe`: MaxText's base config and the arguments of the tiny models, for
  the test's own run of `python -m nvfp4_jax.maxtext` (the megablox refusal).

XLA_FLAGS must make XLA dump into XLA_DUMP_DIR (the test sets it).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import nvfp4_jax
import nvfp4_jax.maxtext as nvfp4_maxtext

CONFIG = pathlib.Path(__import__("maxtext").__file__).parent / "configs" / "base.yml"
TINY = [
    "dataset_type=synthetic",
    "steps=3",
    "per_device_batch_size=2",
    "max_target_length=32",
    "base_emb_dim=64",
    "base_num_query_heads=4",
    "base_num_kv_heads=4",
    "base_mlp_dim=128",
    "base_num_decoder_layers=2",
    "head_dim=16",
    "vocab_size=256",
    "enable_checkpointing=False",
    "attention=dot_product",
    "hardware=cpu",
    "skip_jax_distributed_system=True",
    "enable_tensorboard=False",
    "enable_goodput_recording=False",
    "monitor_goodput=False",
    "log_period=1",
    "enable_dropout=False",
    "learning_rate=1e-3",
]
MOE = [
    "decoder_block=mixtral",
    "num_experts=4",
    "num_experts_per_tok=2",
    "base_moe_mlp_dim=128",
    "sparse_matmul=True",
    "megablox=False",
    "use_tokamax_gmm=False",
]
CUSTOM_CALL = re.compile(r'custom_call_target="(nvfp4_\w+)"')


def compiled_train_steps(dump: pathlib.Path, before: set[str]) -> dict[str, int]:
    """The NVFP4 custom calls (target -> count) in the train steps XLA compiled since `before`."""
    counts: dict[str, int] = {}
    for path in sorted(set(os.listdir(dump)) - before):
        if "train_step" in path and path.endswith("after_optimizations.txt"):
            for target in CUSTOM_CALL.findall((dump / path).read_text()):
                counts[target] = counts.get(target, 0) + 1
    return counts


def losses(metrics: pathlib.Path) -> list[float]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [row["learning/loss"] for row in rows]


def train(name: str, extra: list[str], work: pathlib.Path, dump: pathlib.Path) -> dict:
    """The NVFP4 run through the launcher and the bf16 run of plain MaxText."""
    from maxtext.trainers.pre_train import train as maxtext_train  # noqa: PLC0415

    result = {}
    for precision in ("nvfp4", "bf16"):
        args = [
            str(CONFIG),
            f"run_name={name}_{precision}",
            f"base_output_directory={work / 'out'}",
            f"metrics_file={work / f'{name}_{precision}.jsonl'}",
            *TINY,
            *extra,
        ]
        before = set(os.listdir(dump))
        report = work / f"{name}_report.json"
        if precision == "nvfp4":
            flags = ["--nvfp4-report", str(report)]
            if name == "dense":  # the rules flag: the MLP's down projection back in bf16
                rules = work / "rules.json"
                rules.write_text(json.dumps([{"pattern": "mlp/wo$", "recipe": None}]))
                flags += ["--nvfp4-rules", str(rules)]
            nvfp4_maxtext.main(["nvfp4_jax.maxtext", *args, *flags])
        else:
            maxtext_train.main(["train", *args])
        result[precision] = {
            "losses": losses(work / f"{name}_{precision}.jsonl"),
            "custom_calls": compiled_train_steps(dump, before),
        }
        if precision == "nvfp4":
            written = json.loads(report.read_text())
            if written["status"] != "completed":
                raise RuntimeError(f"the launcher's report: {written}")
            result[precision]["report"] = written["providers"]
    return result


class Holder(nnx.Module):
    """A module path for qwix: `Holder(decoder=Holder(layers=...))` is `decoder/layers/...`."""

    def __init__(self, child_name: str, child):
        self.child_name = child_name
        setattr(self, child_name, child)

    def __call__(self, *args):
        return getattr(self, self.child_name)(*args)


def nested(path: str, leaf):
    for name in reversed(path.split("/")):
        leaf = Holder(name, leaf)
    return leaf


class ExpertGemm(nnx.Module):
    """The experts' GEMM as MaxText's `RoutedMoE` issues it (`jax_ragged_dot_gmm`)."""

    def __init__(self, kernel):
        self.wi_0 = nnx.Param(kernel)

    def __call__(self, x, group_sizes):
        return jax.lax.ragged_dot(
            lhs=x,
            rhs=self.wi_0[...].astype(jnp.bfloat16),
            group_sizes=group_sizes,
            preferred_element_type=jnp.bfloat16,
        )


def same_bits(a, b) -> bool:
    a, b = np.asarray(jnp.asarray(a, jnp.float32)), np.asarray(jnp.asarray(b, jnp.float32))
    return a.shape == b.shape and bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


def layers() -> dict:
    """MaxText's layers under the provider against nvfp4_jax's drop-ins, on the same weights."""
    import qwix  # noqa: PLC0415
    from maxtext.layers import linears  # noqa: PLC0415

    class Config:  # the fields provider_from_config reads
        quantize_mtp = False
        num_experts = 1

    recipe = nvfp4_jax.NVFP4Recipe()
    x = jax.random.normal(jax.random.key(1), (2, 32, 64), jnp.float32)
    dy = jax.random.normal(jax.random.key(2), (2, 32, 128), jnp.bfloat16)
    out = {}

    def dense(path):
        layer = linears.DenseGeneral(
            64, 128, dtype=jnp.bfloat16, weight_dtype=jnp.float32, rngs=nnx.Rngs(0)
        )
        return nested(path, layer), layer

    # An MLP projection of a decoder layer: NVFP4, the drop-in's numbers.
    model, layer = dense("decoder/layers/mlp/wi_0")
    provider = nvfp4_maxtext.provider_from_config(Config(), recipe)
    qmodel = qwix.quantize_model(model, provider, x)
    kernel = layer.kernel[...]

    def ours(model, x):
        return jnp.vdot(model(x).astype(jnp.float32), dy.astype(jnp.float32)), model(x)

    (_, y), (grad_model, dx) = nnx.value_and_grad(ours, argnums=(0, 1), has_aux=True)(qmodel, x)
    dw = grad_model.decoder.layers.mlp.wi_0.kernel[...]

    def drop_in(x, kernel):
        y = nvfp4_jax.dot_general(
            x.astype(jnp.bfloat16),
            kernel.astype(jnp.bfloat16),
            (((2,), (0,)), ((), ())),
            recipe=recipe,
        )
        return jnp.vdot(y.astype(jnp.float32), dy.astype(jnp.float32)), y

    (_, y_ref), (dx_ref, dw_ref) = jax.value_and_grad(drop_in, (0, 1), has_aux=True)(x, kernel)
    plain = jax.lax.dot_general(
        x.astype(jnp.bfloat16), kernel.astype(jnp.bfloat16), (((2,), (0,)), ((), ()))
    )
    out["dense"] = {
        "report": provider.report.to_dict(),
        "y": same_bits(y, y_ref),
        "dx": same_bits(dx, dx_ref),
        "dw": same_bits(dw, dw_ref),
        "differs_from_bf16": not same_bits(y, plain),
        "rel_err_vs_bf16": float(
            jnp.linalg.norm((y - plain).astype(jnp.float32))
            / jnp.linalg.norm(plain.astype(jnp.float32))
        ),
    }

    # The MoE router: kept in high precision, the plain layer's numbers.
    model, layer = dense("decoder/layers/moe/gate")
    provider = nvfp4_maxtext.provider_from_config(Config(), recipe)
    qmodel = qwix.quantize_model(model, provider, x)
    plain = jax.lax.dot_general(
        x.astype(jnp.bfloat16), layer.kernel[...].astype(jnp.bfloat16), (((2,), (0,)), ((), ()))
    )
    out["router"] = {"report": provider.report.to_dict(), "y": same_bits(qmodel(x), plain)}

    # The experts' grouped GEMM: nvfp4_jax.ragged_dot's numbers.
    tokens = x.reshape(64, 64).astype(jnp.bfloat16)
    group_sizes = jnp.array([16, 0, 32, 16], jnp.int32)
    experts = jax.random.normal(jax.random.key(3), (4, 64, 128), jnp.float32) * 0.1
    model = nested("decoder/layers/moe", ExpertGemm(experts))
    provider = nvfp4_maxtext.provider_from_config(Config(), recipe)
    qmodel = qwix.quantize_model(model, provider, tokens, group_sizes)
    dy2 = dy.reshape(64, 128)

    def moe_ours(model, x):
        y = model(x, group_sizes)
        return jnp.vdot(y.astype(jnp.float32), dy2.astype(jnp.float32)), y

    (_, y), (grad_model, dx) = nnx.value_and_grad(moe_ours, argnums=(0, 1), has_aux=True)(
        qmodel, tokens
    )
    dw = grad_model.decoder.layers.moe.wi_0[...]

    def moe_ref(x, w):
        y = nvfp4_jax.ragged_dot(
            x,
            w.astype(jnp.bfloat16),
            group_sizes,
            preferred_element_type=jnp.bfloat16,
            recipe=recipe,
        )
        return jnp.vdot(y.astype(jnp.float32), dy2.astype(jnp.float32)), y

    (_, y_ref), (dx_ref, dw_ref) = jax.value_and_grad(moe_ref, (0, 1), has_aux=True)(
        tokens, experts
    )
    out["experts"] = {
        "report": provider.report.to_dict(),
        "y": same_bits(y, y_ref),
        "dx": same_bits(dx, dx_ref),
        "dw": same_bits(dw, dw_ref),
    }
    return out


def main() -> None:
    out_path, dump = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    work = out_path.parent
    # The test runs the launcher itself (`python -m nvfp4_jax.maxtext`) with these.
    result: dict = {"jax": jax.__version__, "config": str(CONFIG), "tiny": TINY, "moe": MOE}
    steps = [
        ("layers", layers),
        ("dense", lambda: train("dense", [], work, dump)),
        ("moe_run", lambda: train("moe", MOE, work, dump)),
    ]
    for name, step in steps:
        try:
            result[name] = step()
        except Exception:  # noqa: BLE001  (reported to the test, which fails on it)
            result[name] = {"error": traceback.format_exc()}
        out_path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
