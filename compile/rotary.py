"""Rotary position embeddings as the compiled function applies them: to the Q and K rows of each token.

ModernBERT rotates each head's query and key by angles of the token's position (`inv_freq` per pair of
dims, a theta per layer type). transformers computes cos and sin of those angles at every call; here
they are tables over every position, computed once exactly as transformers computes them (the same
float products, then cos and sin), and gathered per token by its position id: a packed batch's positions
restart at each sequence, so every sequence is rotated from 0 as it would be alone. The rotation is
written on the [..., heads * head_size] rows themselves (the last op a 2-D elementwise one), so that the
fused attention kernel reads the rotated rows as it reads a linear's output, and the gather, the
rotation and the products fuse into one elementwise kernel per Q or K.
"""

from __future__ import annotations

from typing import Callable

import torch

ATTRIBUTE = "rotary_tables"  # where the tables live on the base model (its state dict: exported as weights)


class RotaryTables(torch.nn.Module):
    """cos and sin tables, [positions, head_size / 2], of each layer type's rotary angles."""

    def __init__(self, rotary: torch.nn.Module, positions: int):
        super().__init__()
        self.layer_types = list(rotary.layer_types)
        for layer_type in self.layer_types:
            inv_freq = getattr(rotary, f"{layer_type}_inv_freq").float()
            scaling = getattr(rotary, f"{layer_type}_attention_scaling")
            angles = torch.arange(positions)[:, None].float() * inv_freq[None, :]  # as transformers' forward
            self.register_buffer(f"{layer_type}_cos", angles.cos() * scaling)
            self.register_buffer(f"{layer_type}_sin", angles.sin() * scaling)

    @classmethod
    def of(cls, base: torch.nn.Module) -> "RotaryTables":
        """The base model's tables, made (and kept on it) the first time they are asked for."""
        if not hasattr(base, ATTRIBUTE):
            base.add_module(ATTRIBUTE, cls(base.rotary_emb, int(base.config.max_position_embeddings)))
        return getattr(base, ATTRIBUTE)

    def rotation(self, layer_type: str) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
        """(rows [..., heads * head_size], positions [...], heads) -> the rows rotated: per head,
        x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), transformers' `apply_rotary_pos_emb`."""
        cos_table, sin_table = getattr(self, f"{layer_type}_cos"), getattr(self, f"{layer_type}_sin")

        def rotate(rows: torch.Tensor, positions: torch.Tensor, heads: int) -> torch.Tensor:
            shape, half = rows.shape, cos_table.shape[-1]
            halves = rows.reshape(*shape[:-1], heads, 2, half)
            rotated = torch.cat((-halves[..., 1, :], halves[..., 0, :]), dim=-1).reshape(shape)

            def per_row(table):
                angles = torch.nn.functional.embedding(positions, table).to(rows.dtype)  # [..., half]
                return torch.cat((angles, angles), dim=-1)[..., None, :].expand(
                    *shape[:-1], heads, 2 * half).reshape(shape)

            return rows * per_row(cos_table) + rotated * per_row(sin_table)

        return rotate
