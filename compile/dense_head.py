"""The sentence-transformers modules after a checkpoint's pooling, compiled into its libraries
(and the reading of modules.json, which compile/checkpoint.py's poolings share).

A sentence-transformers checkpoint lists its modules in `modules.json`: the Transformer, its
Pooling, then optionally Dense layers (`activation(x W^T + b)`, e.g. LaBSE's 768 -> 768 tanh or
distiluse's 768 -> 512) and a Normalize. A Dense layer changes the embedding (its width too), so it
is part of the function the libraries compute (`BertWrapper` applies it after pooling); Normalize is
what the server's `normalize` (default true) does per request, as TEI treats it. Any other module
is refused: compiling without it would answer with other vectors than the checkpoint's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CompileError

# the activations sentence-transformers' Dense writes into its config, by their import path
ACTIVATIONS = {
    "torch.nn.modules.activation.Tanh": torch.nn.Tanh,
    "torch.nn.modules.linear.Identity": torch.nn.Identity,
    "torch.nn.modules.activation.ReLU": torch.nn.ReLU,
    "torch.nn.modules.activation.GELU": torch.nn.GELU,
    "torch.nn.modules.activation.Sigmoid": torch.nn.Sigmoid,
}
UNCOMPILED = ("Transformer", "Pooling", "Normalize")  # read elsewhere, or done by the server
DENSE_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def sentence_transformers_modules(model_dir: Path) -> list[dict]:
    """The modules a sentence-transformers checkpoint lists in modules.json (none without it)."""
    path = model_dir / "modules.json"
    return json.loads(path.read_text()) if path.is_file() else []


def module_kind(module: dict) -> str:
    """A listed module's class name (`sentence_transformers.models.Dense` or, as version 6 writes it,
    `sentence_transformers.base.modules.dense.Dense`: Dense)."""
    return module.get("type", "").rsplit(".", 1)[-1]


def module_config(model_dir: Path, module: dict) -> dict:
    return json.loads((model_dir / module["path"] / "config.json").read_text())


@dataclass(frozen=True)
class DenseLayer:
    """One Dense module of the checkpoint: its directory and config."""

    directory: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str  # a key of ACTIVATIONS

    @property
    def weight_file(self) -> Path:
        found = [self.directory / name for name in DENSE_WEIGHT_FILES if (self.directory / name).is_file()]
        if not found:
            raise CompileError(f"{self.directory} has no weights ({' or '.join(DENSE_WEIGHT_FILES)})")
        return found[0]


def dense_layers(model_dir: Path, hidden_size: int) -> tuple[DenseLayer, ...]:
    """The Dense modules after the pooling of a sentence-transformers checkpoint (none without
    modules.json); a module neither compiled here nor done by the server is refused in one line."""
    layers, width, normalized = [], hidden_size, False
    for module in sentence_transformers_modules(model_dir):
        kind = module_kind(module)
        normalized |= kind == "Normalize"
        if kind in UNCOMPILED:
            continue
        if kind == "Dense" and normalized:  # the server normalizes the last output only
            raise CompileError(f"{model_dir}: a Dense module after Normalize is not compiled")
        if kind != "Dense":
            raise CompileError(f"{model_dir}: sentence-transformers module {module.get('type')!r} is not compiled "
                               f"(supported after the Transformer: Pooling, Dense, Normalize)")
        directory = model_dir / module["path"]
        config = module_config(model_dir, module)
        if config.get("use_residual"):
            raise CompileError(f"{directory}: a Dense module with a residual (use_residual) is not compiled")
        activation = config.get("activation_function", "torch.nn.modules.activation.Tanh")
        if activation not in ACTIVATIONS:
            raise CompileError(f"{directory}: Dense activation {activation} is not compiled (supported: "
                               f"{', '.join(name.rsplit('.', 1)[-1] for name in ACTIVATIONS)})")
        layer = DenseLayer(directory, int(config["in_features"]), int(config["out_features"]),
                           bool(config.get("bias", True)), activation)
        if layer.in_features != width:
            raise CompileError(f"{directory}: Dense takes {layer.in_features} features where the embedding has {width}")
        layers.append(layer)
        width = layer.out_features
    return tuple(layers)


def dense_head(layers: tuple[DenseLayer, ...]) -> torch.nn.Sequential | None:
    """The Dense layers as PyTorch modules with the checkpoint's weights (None where there are none)."""
    if not layers:
        return None
    modules = []
    for layer in layers:
        linear = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias)
        state = _read_weights(layer.weight_file)
        try:
            linear.load_state_dict({key.removeprefix("linear."): value for key, value in state.items()})
        except RuntimeError as exc:
            raise CompileError(f"cannot load {layer.weight_file}: {exc}".splitlines()[0]) from None
        modules += [linear, ACTIVATIONS[layer.activation]()]
    return torch.nn.Sequential(*modules)


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)
