"""The first phases: the checkpoint loaded (block-pruned when asked) beside its PyTorch oracle, and the
tokenizer copied into the artifact."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch

from ..checkpoint import TOKENIZER_FILES, CheckpointInfo, load_wrapper
from ..tokenizer import TOKENIZER_JSON
from ..config import CompileConfig
from ..errors import CompileError
from ..passes.sparsity import prune_model
from ..validate import cosine_drift

TOKENIZER_DIR = "tokenizer"


def load_model(config: CompileConfig, info: CheckpointInfo) -> tuple[torch.nn.Module, torch.nn.Module, dict | None]:
    """(wrapper, the PyTorch oracle, sparsity fields): the checkpoint, pruned when asked."""
    wrapper = load_wrapper(info, config.model_task)
    sparsity = None
    if config.prunes:
        sparsity = prune(wrapper, info, config)
    elif config.sparsity == "from-checkpoint":  # the weights as they are: nothing to prune or drift
        sparsity = {"mode": "from-checkpoint", "block": list(config.block_shape()), "layers": [],
                    "pruned": 0, "cosine_vs_dense": None}
    # The oracle runs in the artifact's precision, on the same (possibly pruned) weights.
    reference = wrapper if config.dtype == "float32" else copy.deepcopy(wrapper).to(getattr(torch, config.dtype))
    return wrapper, reference, sparsity


def prune(wrapper: torch.nn.Module, info: CheckpointInfo, config: CompileConfig) -> dict:
    """Block-prune the checkpoint's chosen linears in place, before export: PyTorch validation and
    TVM then see the same weights. Returns the manifest's sparsity fields known so far."""
    dense = load_wrapper(info, config.model_task)
    try:
        pruned = prune_model(wrapper.bert, 1.0 - config.sparsity, config.block_shape(), tuple(config.sparse_layers))
    except ValueError as exc:
        raise CompileError(f"cannot prune with block {config.block}: {exc}") from None
    return {"block": list(config.block_shape()), "layers": list(config.sparse_layers), "pruned": pruned,
            "cosine_vs_dense": cosine_drift(dense, wrapper, info)}


def copy_tokenizer(info: CheckpointInfo, destination: Path) -> None:
    """The checkpoint's fast tokenizer (its own tokenizer.json, or the one converted from its files) and the
    files beside it that the server reads (limits, prompts) into `destination`."""
    destination.mkdir()
    shutil.copy2(info.tokenizer_file, destination / TOKENIZER_JSON)
    for name in TOKENIZER_FILES:
        if (info.path / name).is_file():
            shutil.copy2(info.path / name, destination / name)
