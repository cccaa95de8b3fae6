"""What the int8 plan (compile/int8_plan.py) measures of a checkpoint, as its tests hand it over."""

from __future__ import annotations

from pathlib import Path


def plan_inputs(checkpoint: Path) -> tuple:
    """(the PyTorch embedder, the shipped sentences' rows, every linear's key) the int8 plan measures."""
    import torch

    from compile.checkpoint import inspect_checkpoint, load_wrapper
    from compile.passes.quantize import sentence_rows
    from compile.passes.smooth import module_key

    info = inspect_checkpoint(checkpoint, "embed")
    wrapper = load_wrapper(info, "embed")
    keys = {module_key(n) for n, m in wrapper.named_modules() if isinstance(m, torch.nn.Linear)}
    return wrapper, sentence_rows(checkpoint / "tokenizer.json", info.max_seq), keys
