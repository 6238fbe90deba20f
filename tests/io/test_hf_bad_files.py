"""The checkpoint loader against hostile and malformed input (the reading side,
nvfp4_jax/_src/io/hf/load/main.py).

Every safetensors header, JSON file and scale that a checkpoint can get wrong gives a
`ValueError` naming the file (and the tensor or field), raised before the loader allocates
what the bad numbers ask for; nothing else (TypeError, RecursionError, IndexError, ...)
escapes. Hostile safetensors files are written byte by byte here.
"""

from __future__ import annotations

import json
import re
import struct
import tracemalloc
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_same_bits
from hf_fixture import FIXTURE, LINEARS, copy_fixture, leaf, model_config, write_st

import nvfp4_jax
from nvfp4_jax import hf

P = jax.sharding.PartitionSpec
F32_16 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}


def st_file(path: Path, header, data: bytes = b"", length: int | None = None) -> Path:
    """A safetensors file by hand: `<Q` header length, the header (JSON of a dict, or raw
    bytes as they are), the data."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if length is None else length) + blob + data)
    return path


def assert_rejected(path: Path, *patterns: str) -> str:
    """read_safetensors(path) raises a ValueError naming the file and matching `patterns`."""
    with pytest.raises(ValueError) as info:
        hf.read_safetensors(path)
    message = str(info.value)
    assert str(path) in message, message
    rest = message.replace(str(path), "<file>")  # (the test's name is in the path)
    for pattern in patterns:
        assert re.search(pattern, rest), (pattern, message)
    return message


# --- 5. safetensors headers -------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [b"[1, 2]", b'"a string"', b"17", b"null"],
    ids=["list", "string", "number", "null"],
)
def test_header_that_is_no_json_object(tmp_path, header):
    assert_rejected(st_file(tmp_path / "h.safetensors", header), "JSON object")


@pytest.mark.parametrize("opener", ["[", '{"a":'])
def test_deeply_nested_header_is_rejected_before_json_recursion(tmp_path, opener):
    closer = "]" if opener == "[" else "}"
    deep = ('{"t":' + opener * 100_000 + "1" + closer * 100_000 + "}").encode()
    assert_rejected(st_file(tmp_path / "deep.safetensors", deep), "nest")
    unterminated = ('{"t":' + opener * 100_000).encode()
    assert_rejected(st_file(tmp_path / "open.safetensors", unterminated))


@pytest.mark.parametrize(
    "shape",
    [[-1, -4], [-4, -1, 1], [2.5, 2], [True, 4], ["4"], [4.0], [None], 4, "4", [1e400]],
    ids=["neg2", "neg3", "float", "bool", "str", "intfloat", "none", "int", "strshape", "inf"],
)
def test_shape_must_be_non_negative_ints(tmp_path, shape):
    header = {"weird.tensor": {"dtype": "F32", "shape": shape, "data_offsets": [0, 16]}}
    blob = json.dumps(header).replace("Infinity", "1e400").encode()
    path = st_file(tmp_path / "s.safetensors", blob, bytes(16))
    assert_rejected(path, "'weird.tensor'", "shape .* non-negative integers")


def test_overlapping_tensors_are_rejected(tmp_path):
    header = {
        "a": F32_16,
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
    }
    assert_rejected(st_file(tmp_path / "o.safetensors", header, bytes(24)), "overlap", "'a'", "'b'")
    # A tensor inside another, and two at the same offsets.
    header = {"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}, "b": F32_16}
    assert_rejected(st_file(tmp_path / "i.safetensors", header, bytes(32)), "overlap")
    header = {"a": F32_16, "b": F32_16}
    assert_rejected(st_file(tmp_path / "s.safetensors", header, bytes(16)), "overlap")
    # Empty tensors overlap nothing; tensors may leave gaps between them.
    header = {
        "a": F32_16,
        "e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [8, 8]},
        "b": {"dtype": "U8", "shape": [2], "data_offsets": [20, 22]},
    }
    out = hf.read_safetensors(st_file(tmp_path / "ok.safetensors", header, bytes(24)))
    assert out["e"].shape == (0, 3) and out["b"].tolist() == [0, 0]


def test_duplicate_keys_are_rejected(tmp_path):
    entry = json.dumps(F32_16)
    blob = f'{{"t": {entry}, "t": {entry}}}'.encode()
    assert_rejected(st_file(tmp_path / "d.safetensors", blob, bytes(16)), "'t' twice")
    blob = b'{"t": {"dtype": "U8", "dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}'
    assert_rejected(st_file(tmp_path / "e.safetensors", blob, bytes(16)), "'dtype' twice")


def test_offsets_must_fit_the_file_and_the_tensor(tmp_path):
    def entry(offsets, shape=(4,), dtype="F32"):
        return {"t.x": {"dtype": dtype, "shape": list(shape), "data_offsets": offsets}}

    cases = [
        (entry([16, 0], shape=[-4]), "t.x"),  # begin > end (and a negative shape to match)
        (entry([16, 0]), "t.x"),
        (entry([0, 32]), "t.x.*16 bytes"),  # not dtype * shape
        (entry([0, 16], dtype="F8_E8M0"), "t.x.*dtype 'F8_E8M0'"),  # unknown dtype
        (entry([0, 16], dtype=["F32"]), "t.x.*dtype"),
        (entry([-16, 0]), "t.x"),
        (entry([0, 16, 32]), "t.x.*data_offsets"),
        (entry([0.0, 16]), "t.x.*data_offsets"),
        (entry([False, 16]), "t.x.*data_offsets"),
        (entry("0-16"), "t.x.*data_offsets"),
        ({"t.x": [1, 2]}, "t.x"),
        ({"t.x": {"dtype": "F32", "shape": [4]}}, "t.x.*data_offsets"),
    ]
    for i, (header, pattern) in enumerate(cases):
        assert_rejected(st_file(tmp_path / f"{i}.safetensors", header, bytes(16)), pattern)
    # Past the end of the file: the message names the tensor, not only the file.
    path = st_file(tmp_path / "past.safetensors", entry([0, 16]), bytes(8))
    assert_rejected(path, "t.x.*past the end")
    # A header length beyond the file, or no room for one.
    blob = json.dumps(entry([0, 16])).encode()
    assert_rejected(st_file(tmp_path / "a.safetensors", blob, bytes(16), length=10**6), "header")
    assert_rejected(st_file(tmp_path / "b.safetensors", blob, b"", length=2**63), "header")
    (tmp_path / "c.safetensors").write_bytes(b"\x01\x00")
    assert_rejected(tmp_path / "c.safetensors", "header")


def test_a_huge_tensor_is_rejected_without_allocating(tmp_path):
    huge = 2**60
    tracemalloc.start()
    try:
        for i, header in enumerate(
            [
                {"big": {"dtype": "F32", "shape": [huge], "data_offsets": [0, 4 * huge]}},
                {"big": {"dtype": "F32", "shape": [2**30, 2**30], "data_offsets": [0, 16]}},
                {"big": {"dtype": "U8", "shape": [huge, 0, huge], "data_offsets": [0, 16]}},
            ]
        ):
            assert_rejected(st_file(tmp_path / f"{i}.safetensors", header, bytes(16)), "'big'")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 * 2**20, peak


@pytest.mark.parametrize(
    "metadata", [{"format": 1}, "pt", ["format", "pt"], {"format": {"a": "b"}}, {"n": None}]
)
def test_metadata_must_map_strings_to_strings(tmp_path, metadata):
    header = {"__metadata__": metadata, "t": F32_16}
    assert_rejected(st_file(tmp_path / "m.safetensors", header, bytes(16)), "__metadata__")


def test_header_must_be_utf8_json(tmp_path):
    header = json.dumps({"t": F32_16})
    path = st_file(tmp_path / "u16.safetensors", header.encode("utf-16"), bytes(16))
    assert_rejected(path, "UTF-8")
    blob = header.replace('"t"', '"t\\u00e9"').encode().replace(b"\\u00e9", b"\xe9")
    assert_rejected(st_file(tmp_path / "latin.safetensors", blob, bytes(16)), "UTF-8")
    for constant in (b"NaN", b"Infinity", b"-Infinity"):  # not JSON, though Python reads them
        blob = b'{"t": {"dtype": "F32", "shape": [' + constant + b'], "data_offsets": [0, 16]}}'
        assert_rejected(st_file(tmp_path / "c.safetensors", blob, bytes(16)), "'t'|JSON")


def test_the_loader_reports_a_hostile_file_of_a_checkpoint(tmp_path):
    directory = copy_fixture(tmp_path)
    st_file(directory / "model.safetensors", b"[" * 50_000)
    with pytest.raises(ValueError, match="model.safetensors"):
        hf.load_hf_checkpoint(directory)
    header = {"model.norm.weight": {"dtype": "BF16", "shape": [-64, -1], "data_offsets": [0, 128]}}
    st_file(directory / "model.safetensors", header, bytes(128))
    with pytest.raises(ValueError, match=r"model.safetensors.*model\.norm\.weight"):
        hf.load_hf_checkpoint(directory)


# --- 6. JSON files of the wrong shape ---------------------------------------------------------


def quantized_copy(tmp_path: Path) -> tuple[Path, dict]:
    directory = copy_fixture(tmp_path)
    return directory, json.loads((directory / "config.json").read_text())


def write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value))


def assert_load_rejected(directory: Path, file: str, *patterns: str) -> str:
    with pytest.raises(ValueError) as info:
        hf.load_hf_checkpoint(directory)
    message = str(info.value)
    assert file in message, (file, message)
    rest = message.replace(str(directory), "<directory>")  # (the test's name is in the path)
    for pattern in patterns:
        assert re.search(pattern, rest), (pattern, message)
    return message


def test_config_json_of_the_wrong_shape(tmp_path):
    directory, config = quantized_copy(tmp_path)
    write_json(directory / "config.json", [config])
    assert_load_rejected(directory, "config.json", "JSON object")
    (directory / "config.json").write_text('{"architectures": ["Llama"],')
    assert_load_rejected(directory, "config.json", "not valid JSON")
    (directory / "config.json").write_text("{" * 100_000)
    assert_load_rejected(directory, "config.json")
    (directory / "config.json").write_text('{"a": 1, "a": 2}')
    assert_load_rejected(directory, "config.json", "'a' twice")


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        ("quantization_config", "modelopt", "quantization_config"),
        ("quantization_config", ["modelopt"], "quantization_config"),
        ("config_groups", [{"weights": {"group_size": 16}}], "config_groups"),
        ("config_groups", {"group_0": "NVFP4"}, "config_groups.group_0"),
        ("config_groups", {"group_0": {"weights": 16}}, "config_groups.group_0.weights"),
        ("ignore", "lm_head", "ignore.*list"),
        ("ignore", ["lm_head", 3], "ignore.*list"),
        ("ignore", {"lm_head": True}, "ignore.*list"),
        ("group_size", "16", "group_size"),
        ("group_size", True, "group_size"),
        ("quant_algo", ["NVFP4"], "quant_algo"),
        ("quant_method", {"modelopt": 1}, "quant_method"),
    ],
)
def test_quantization_config_of_the_wrong_shape(tmp_path, field, value, pattern):
    directory, config = quantized_copy(tmp_path)
    if field == "quantization_config":
        config[field] = value
    else:
        config["quantization_config"][field] = value
    write_json(directory / "config.json", config)
    assert_load_rejected(directory, "config.json", pattern)


@pytest.mark.parametrize(
    ("legacy", "pattern"),
    [
        ([{"quantization": {}}], "JSON object"),
        ({"quantization": "NVFP4"}, "quantization"),
        ({"quantization": ["NVFP4"]}, "quantization"),
        ({"quantization": {"quant_algo": "NVFP4", "exclude_modules": "lm_head"}}, "exclude_mod"),
    ],
)
def test_legacy_quant_config_of_the_wrong_shape(tmp_path, legacy, pattern):
    directory, _ = quantized_copy(tmp_path)
    write_json(directory / "config.json", model_config())
    write_json(directory / "hf_quant_config.json", legacy)
    assert_load_rejected(directory, "hf_quant_config.json", pattern)


def sharded_copy(tmp_path: Path) -> tuple[Path, dict]:
    """The fixture split in two files, with its index."""
    directory = copy_fixture(tmp_path)
    tensors = hf.read_safetensors(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    names = sorted(tensors)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for file, half in zip(files, halves, strict=True):
        write_st(directory / file, {n: tensors[n] for n in half})
        weight_map.update({n: file for n in half})
    index = {"metadata": {}, "weight_map": weight_map}
    write_json(directory / "model.safetensors.index.json", index)
    return directory, index


def test_index_of_the_wrong_shape(tmp_path):
    directory, index = sharded_copy(tmp_path)
    hf.load_hf_checkpoint(directory)  # the good one loads
    path = directory / "model.safetensors.index.json"
    name = next(iter(index["weight_map"]))
    file = index["weight_map"][name]
    bad = [
        ([index], "JSON object"),
        ({"metadata": {}}, "weight_map"),
        ({"weight_map": list(index["weight_map"].items())}, "weight_map"),
        ({"weight_map": {**index["weight_map"], name: 1}}, f"weight_map.*{name}"),
        ({"weight_map": {**index["weight_map"], name: [file]}}, f"weight_map.*{name}"),
        ({"weight_map": {**index["weight_map"], name: f"../ckpt/{file}"}}, "not a file name"),
        ({"weight_map": {**index["weight_map"], name: f"sub/{file}"}}, "not a file name"),
        ({"weight_map": {**index["weight_map"], name: f"sub\\{file}"}}, "not a file name"),
        ({"weight_map": {**index["weight_map"], name: ".."}}, "not a file name"),
        ({"weight_map": {**index["weight_map"], name: str(directory / file)}}, "not a file name"),
    ]
    for value, pattern in bad:
        write_json(path, value)
        assert_load_rejected(directory, "model.safetensors.index.json", pattern)
    path.write_text('{"weight_map": {')
    assert_load_rejected(directory, "model.safetensors.index.json", "not valid JSON")


# --- 7. scales --------------------------------------------------------------------------------


def with_tensor(tmp_path: Path, tensors: dict, name: str, value) -> Path:
    directory = copy_fixture(tmp_path)
    write_st(directory / "model.safetensors", {**tensors, name: value})
    return directory


MODULE = "model.layers.1.mlp.up_proj"


def test_weight_scale_2_follows_the_exporter_rule(tmp_path, fixture_tensors):
    """Finite and >= 0: NaN, inf and negatives are rejected; 0 loads, since an all-zero
    kernel exports weight_scale_2 == 0 (amax 0)."""
    name = f"{MODULE}.weight_scale_2"
    for i, value in enumerate([np.nan, np.inf, -np.inf, -1.0, -1e-30]):
        directory = with_tensor(tmp_path / str(i), fixture_tensors, name, np.float32(value))
        with pytest.raises(ValueError, match=rf"{name}.*finite.*>= 0"):
            hf.load_hf_checkpoint(directory)
    directory = with_tensor(tmp_path / "zero", fixture_tensors, name, np.float32(0))
    q = leaf(hf.load_hf_checkpoint(directory), MODULE)
    assert float(q.decode_scale) == 0 and not np.asarray(nvfp4_jax.dequantize(q)).any()


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, -1.0, 0.0])
def test_bad_input_scale(tmp_path, fixture_tensors, value):
    name = f"{MODULE}.input_scale"
    directory = with_tensor(tmp_path, fixture_tensors, name, np.float32(value))
    with pytest.raises(ValueError, match=rf"{name}.*finite.*> 0"):
        hf.load_hf_checkpoint(directory)


@pytest.mark.parametrize("byte", [0x7F, 0xFF, 0x80, 0xB8])  # NaN, NaN, -0, -1
def test_bad_block_scales(tmp_path, fixture_tensors, byte):
    name = f"{MODULE}.weight_scale"
    scales = fixture_tensors[name].view(np.uint8).copy()
    scales[3, 5] = byte
    directory = with_tensor(tmp_path, fixture_tensors, name, scales.view(ml_dtypes.float8_e4m3fn))
    with pytest.raises(ValueError, match=rf"{name}.*NaN or negative"):
        hf.load_hf_checkpoint(directory)
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")), ("x",))
    rows = jax.sharding.NamedSharding(mesh, P(None, "x"))  # the rows are split over devices
    with pytest.raises(ValueError, match=rf"{name}.*NaN or negative"):
        hf.load_hf_checkpoint(directory, sharding=rows)


@pytest.mark.parametrize(
    ("suffix", "value", "pattern"),
    [
        ("k_scale", np.float32([0.5, 0.5]), "one element"),
        ("k_scale", np.float32(np.nan), "finite"),
        ("k_scale", np.float32(-0.5), "finite"),
        ("k_scale", np.uint8(1), "float"),
    ],
)
def test_scales_of_the_wrong_shape_or_dtype(tmp_path, fixture_tensors, suffix, value, pattern):
    module = "model.layers.0.self_attn.k_proj"
    name = f"{module}.{suffix}"
    directory = with_tensor(tmp_path, fixture_tensors, name, value)
    with pytest.raises(ValueError, match=rf"{name}.*{pattern}"):
        hf.load_hf_checkpoint(directory)


# --- 8. one sharding for the whole checkpoint -------------------------------------------------


@pytest.fixture(scope="module")
def unsharded():
    return hf.load_hf_checkpoint(FIXTURE)


@pytest.mark.parametrize("spec", [P(None, "d"), P("d", None), P("d")])
def test_one_sharding_applies_to_the_ranks_it_fits(unsharded, spec):
    """The spec applies to every array of rank >= len(spec), as the Flax model sees it (an
    NVFP4 kernel (in, out), its codes and scales (out, in/2), (out, in/16) follow it); arrays
    of lower rank (norms for a 2-D spec, scalars) are replicated."""
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")).reshape(1, 8), ("r", "d"))
    tree = hf.load_hf_checkpoint(FIXTURE, sharding=jax.sharding.NamedSharding(mesh, spec))
    jax.tree.map(lambda x, y: assert_same_bits(x, y), tree, unsharded)
    replicated = jax.sharding.NamedSharding(mesh, P())
    norm = tree["norm"]["scale"]
    assert norm.sharding.is_equivalent_to(
        replicated if len(spec) == 2 else jax.sharding.NamedSharding(mesh, spec), 1
    )
    assert tree["lm_head"]["kernel"].sharding.spec == spec
    q = leaf(tree, LINEARS[0])
    stored = P(*reversed((*spec, None)[:2]))  # (in, out) spec -> (out, in) parts
    assert q.codes.sharding.spec == stored and q.scales.sharding.spec == stored
    assert q.amax.sharding.is_equivalent_to(replicated, 0)
    assert leaf(tree, LINEARS[0], "input_scale").sharding.is_equivalent_to(replicated, 0)
    # The codes and the scales of one device hold the same block of the kernel.
    for c, s in zip(q.codes.addressable_shards, q.scales.addressable_shards, strict=True):
        assert c.device == s.device
        rows, cols = c.index
        assert s.index[0] == rows
        c0, c1, _ = cols.indices(q.codes.shape[1])
        s0, s1, _ = s.index[1].indices(q.scales.shape[1])
        assert (2 * c0, 2 * c1) == (16 * s0, 16 * s1)
    dense = np.asarray(nvfp4_jax.dequantize(leaf(unsharded, LINEARS[0])))
    assert_same_bits(nvfp4_jax.dequantize(q), dense)


def test_one_sharding_that_cannot_split_a_tensor_names_it(tmp_path):
    tree = {"layers": {0: {"mlp": {"down_proj": {"kernel": jnp.ones((32, 24), jnp.bfloat16)}}}}}
    hf.export_hf_checkpoint(
        tmp_path / "c", tree, quant_algo="W4A16_NVFP4", config=model_config(), block_2d=False
    )
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, P("d"))  # in = 32: 2 blocks, not 8
    with pytest.raises(ValueError, match=r"layers/0/mlp/down_proj/kernel/scales.*function"):
        hf.load_hf_checkpoint(tmp_path / "c", sharding=sharding)
    too_long = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices("cpu")).reshape(2, 2, 2), ("a", "b", "c")),
        P("a", "b", "c"),
    )
    tree = hf.load_hf_checkpoint(tmp_path / "c", sharding=too_long)  # rank 2 < 3: replicated
    assert tree["layers"][0]["mlp"]["down_proj"]["kernel"].codes.sharding.spec == P()
