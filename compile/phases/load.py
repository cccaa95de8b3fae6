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
from ..passes.quantize import classifier_agreement, embedding_agreement, sentence_rows
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
                    "pruned": 0, "cosine_vs_dense": None, "sentences_vs_dense": None}
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
    if not pruned:  # a family whose linears have other names (ModernBERT's Wqkv, Wi, Wo) would go dense silently
        raise CompileError(f"--sparsity {config.sparsity}: this {info.config['model_type']} checkpoint has no "
                           f"{' or '.join(config.sparse_layers)} linear to prune; pruning covers "
                           f"bert, roberta, xlm-roberta and distilbert")
    return {"block": list(config.block_shape()), "layers": list(config.sparse_layers), "pruned": pruned,
            "cosine_vs_dense": cosine_drift(dense, wrapper, info),
            "sentences_vs_dense": sentence_agreement(dense, wrapper, info, config.model_task)}


def sentence_agreement(dense: torch.nn.Module, pruned: torch.nn.Module, info: CheckpointInfo, task: str) -> dict:
    """The pruned model against the dense one on the shipped sentences, as a reduced precision is measured
    against fp32 (compile/sentences.py): each embedding's cosine (least, mean, the worst sentence), or a
    classifier's top-1 agreement and largest probability difference."""
    rows = [torch.from_numpy(x) for x in sentence_rows(info.tokenizer_file, info.max_seq)]
    with torch.no_grad():
        expected, actual = (model(*rows).float().numpy().reshape(len(rows[0]), -1) for model in (dense, pruned))
    if task == "classify":
        return classifier_agreement(actual, expected)
    return embedding_agreement(actual, expected)


def copy_tokenizer(info: CheckpointInfo, destination: Path) -> None:
    """The checkpoint's fast tokenizer (its own tokenizer.json, or the one converted from its files) and the
    files beside it that the server reads (limits, prompts) into `destination`."""
    destination.mkdir()
    shutil.copy2(info.tokenizer_file, destination / TOKENIZER_JSON)
    for name in TOKENIZER_FILES:
        if (info.path / name).is_file():
            shutil.copy2(info.path / name, destination / name)
