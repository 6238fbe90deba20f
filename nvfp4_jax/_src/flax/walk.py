"""Walking an nnx model: where its linear, einsum and experts layers are, and replacing them.

`layer_paths(model)` finds every `nnx.Linear`, `nnx.Einsum` and `nvfp4_jax.nnx.Experts`
layer with all the "/"-joined module paths it is held at (`layers/3/mlp/down_proj`), in path
order with block indices in number order; `named_layers` gives one path per layer;
`replace_layers` points every holder of a layer at a new one, in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flax import nnx

from nvfp4_jax._src.flax import nnx as nvfp4_nnx

# The nnx layers rules decide: linears, einsums and mixture-of-experts layers.
NNX_LAYERS = (nnx.Linear, nnx.Einsum, nvfp4_nnx.Experts)
# The sibling linears engines fuse into one layer, which share one global amax (the export
# and post-training quantization both default to them; Mixtral's experts call gate and up
# `w1` and `w3`).
DEFAULT_FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))


def path_str(path: tuple) -> str:
    """A module path (a tuple of names and indices) "/"-joined: `layers/3/mlp/down_proj`."""
    return "/".join(str(part) for part in path)


def layer_paths(model: nnx.Module) -> dict[str, tuple[nnx.Module, tuple[str, ...]]]:
    """Maps first path -> (layer, all its paths) for every linear, einsum and `Experts` layer.

    A layer held at several paths (a head tied to another projection: `model.head =
    model.embed_proj`) is listed once, under the first of its paths in path order; the
    tuple holds all of them, that one first. Layers come in path order.

    Example:
      >>> class Tied(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.embed_proj = nnx.Linear(16, 16, rngs=rngs)
      ...         self.head = self.embed_proj
      >>> [paths for _, paths in layer_paths(Tied(nnx.Rngs(0))).values()]
      [('embed_proj', 'head')]
    """
    found: dict[int, tuple[Any, list[str]]] = {}

    def visit(node, path: tuple, ancestors: frozenset) -> None:
        if isinstance(node, NNX_LAYERS):
            found.setdefault(id(node), (node, []))[1].append(path_str(path))
        impl = nnx.graphlib.get_node_impl(node)
        if impl is None or id(node) in ancestors:  # a leaf, or a reference back up
            return
        inner = ancestors | {id(node)}
        for key, child in impl.node_dict(node).items():
            if not (isinstance(key, str) and key.startswith("_pytree__")):
                visit(child, (*path, key), inner)

    visit(model, (), frozenset())
    layers = {}
    for layer, paths in found.values():
        paths = tuple(sorted(dict.fromkeys(paths), key=_natural_key))
        layers[paths[0]] = (layer, paths)
    return dict(sorted(layers.items(), key=lambda item: _natural_key(item[0])))


def named_layers(model: nnx.Module) -> dict[str, nnx.Module]:
    """Maps path -> layer for every `nnx.Linear`, `nnx.Einsum` and `Experts`, in path order.

    Paths are "/"-joined (`layers/3/mlp/down_proj`) and sorted with block indices in number
    order; a layer held at several paths is listed once, at its first (`layer_paths` gives
    all of them).

    Example:
      >>> list(named_layers(nnx.Sequential(nnx.Linear(16, 16, rngs=nnx.Rngs(0)))))
      ['layers/0']
    """
    return {path: layer for path, (layer, _) in layer_paths(model).items()}


def _holders(model: nnx.Module, targets: dict[int, Any]) -> dict[int, list[tuple[Any, Any]]]:
    """For each target (by id), every (parent node, key) holding it: shared ones included."""
    holders: dict[int, list] = {ident: [] for ident in targets}
    for _, node in nnx.iter_graph(model):
        impl = nnx.graphlib.get_node_impl(node)
        if impl is None or isinstance(node, NNX_LAYERS):
            continue
        for key, child in impl.node_dict(node).items():
            if id(child) in holders and child is targets[id(child)]:
                holders[id(child)].append((node, key))
    return holders


def _point(holders: list[tuple[Any, Any]], new) -> str:
    """Points every holder at `new`; returns why it cannot ("" when done)."""
    for parent, _ in holders:
        if not isinstance(parent, (nnx.Module, list, dict)):
            return f"it is held in a {type(parent).__name__}, which cannot be changed in place"
    if not holders:
        return "it is the model itself (only the layers a model holds can be replaced)"
    for parent, key in holders:
        if isinstance(key, int) or isinstance(parent, (list, dict)):
            parent[key] = new
        else:
            setattr(parent, key, new)
    return ""


def replace_layers(model: nnx.Module, replacements: Sequence[tuple[Any, Any]]) -> list[str]:
    """Replaces layers of `model` in place: each `(old, new)` pair, wherever `old` is held.

    Returns:
      Per pair, "" when replaced, else why not (the layer is the model itself, or is held in
      an immutable container such as a tuple).
    """
    targets = {id(old): old for old, _ in replacements}
    holders = _holders(model, targets)
    return [_point(holders[id(old)], new) for old, new in replacements]


def _natural_key(path: str) -> list:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("/")]
