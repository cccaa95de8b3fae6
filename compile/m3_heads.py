"""bge-m3's two heads as FlagEmbedding lays them out beside the XLM-R encoder: `colbert_linear.pt`
(hidden -> ColBERT width) and `sparse_linear.pt` (hidden -> 1), both torch state dicts of a Linear.

They run on every token inside the libraries, as one token output of width colbert + 1: the
ColBERT projection, then the lexical weight relu(sparse_linear(h)) (`BGEM3FlagModel`'s); the server
splits it (service/m3.py): the weights' max per token id without the special tokens, the ColBERT
rows after the first normalized. The dense vector is the [CLS] state, the pooled output.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import CompileError

HEAD_FILES = ("colbert_linear.pt", "sparse_linear.pt")


def has_m3_heads(model_dir: Path) -> bool:
    return all((Path(model_dir) / name).is_file() for name in HEAD_FILES)


def _linear(path: Path, hidden_size: int) -> torch.nn.Linear:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        weight = state["weight"]
        linear = torch.nn.Linear(hidden_size, weight.shape[0], bias="bias" in state)
        linear.load_state_dict(state)
    except (OSError, RuntimeError, KeyError, AttributeError) as exc:
        raise CompileError(f"cannot load {path}: {exc}".splitlines()[0]) from None
    return linear


def colbert_width(model_dir: Path, hidden_size: int) -> int:
    return _linear(Path(model_dir) / HEAD_FILES[0], hidden_size).out_features


class M3Heads(torch.nn.Module):
    """[..., hidden] -> [..., colbert + 1]: colbert_linear(h), then relu(sparse_linear(h))."""

    def __init__(self, model_dir: Path, hidden_size: int):
        super().__init__()
        self.colbert_linear = _linear(Path(model_dir) / HEAD_FILES[0], hidden_size)
        self.sparse_linear = _linear(Path(model_dir) / HEAD_FILES[1], hidden_size)
        if self.sparse_linear.out_features != 1:
            raise CompileError(f"{model_dir}: sparse_linear.pt has {self.sparse_linear.out_features} outputs, not 1")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.colbert_linear(hidden), torch.relu(self.sparse_linear(hidden))], dim=-1)
