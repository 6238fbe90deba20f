"""Export: `ExportReport`, what `export_hf_checkpoint` wrote and why."""

from __future__ import annotations

import dataclasses

from nvfp4_jax._src.io.hf.export.options import ExportOptions
from nvfp4_jax._src.io.hf.export.tensors import Leaves, Tensor


@dataclasses.dataclass(frozen=True)
class ExportReport:
    """What `export_hf_checkpoint` wrote.

    Attributes:
      directory: the checkpoint directory.
      quant_algo: "NVFP4" or "W4A16_NVFP4".
      quantized: HF names of the linears written in NVFP4.
      excluded: the modules kept in high precision (config.json's `ignore`).
      files: the safetensors files, in order.
      total_size: bytes of tensor data in them.
      skipped: Flax paths of leaves that are not weights (rng state, `skip=` matches).
      followed: where the precision of each linear came from: "rules" (`rules=`), "model"
        (the layers of an nnx model or state: `nvfp4_jax.nnx.Linear`s and
        `nvfp4_jax.nnx.Experts` with a recipe in NVFP4, others in high precision) or ""
        (none: every linear not excluded is quantized).
      trained_high_precision: HF names of the linears kept in high precision because the
        model computed them so (a plain `nnx.Linear`, an `Experts` with recipe None, a rule
        with recipe None); for experts, one name per expert.
      group_high_precision: HF names of linears the model computed in NVFP4 but written in
        high precision because another member of their fused group (q/k/v, gate/up) or of
        their mixture-of-experts block (gate, up, down of all experts) was trained in high
        precision: engines load a fused group, and an MoE block, all quantized or all not.
    """

    directory: str
    quant_algo: str
    quantized: tuple[str, ...]
    excluded: tuple[str, ...]
    files: tuple[str, ...]
    total_size: int
    skipped: tuple[str, ...]
    followed: str = ""
    trained_high_precision: tuple[str, ...] = ()
    group_high_precision: tuple[str, ...] = ()


def build_report(
    options: ExportOptions,
    tensors: list[Tensor],
    leaves: Leaves,
    plan: tuple[str, list[str]],
    written: tuple[list[str], int],
) -> ExportReport:
    """The report of an export: `plan` is (followed, ignore), `written` (files, total size)."""
    (followed, ignore), (files, total) = plan, written
    return ExportReport(
        options.directory,
        options.quant_algo,
        tuple(t.module for t in tensors if t.quantized),
        tuple(ignore),
        tuple(files),
        total,
        tuple(leaves.skipped),
        followed,
        tuple(t.module for t in tensors if t.why == "trained"),
        tuple(t.module for t in tensors if t.why == "group"),
    )
