"""Attention's two products on AMX tiles (`tdpbf16ps`), for the attention kernel where the CPU has them.

The operands are the bf16 attention's (attention_bf16.py), rounded the same way, and the softmax
between the products is its `bert_bf16_softmax_pairs`; only the products change:

- scores: the staged keys `[keys, dims]` (bf16, row-major) are the row tile, the query tile's dim
  pairs `[dims / 2, 16, 2]` the column tile: one `tdpbf16ps` per 16 keys and 32 dims gives
  `scores[16 keys][16 queries]`, the layout the softmax reads, 4 blocks of 16 keys in flight at
  once. The bias and each query's largest score are taken in AVX-512 over the stored rows.
- context: computed transposed, `context^T[dims][16 queries] = V^T P^T`: the row tile is the head's
  values transposed, `[dims, keys]` (bf16, staged once per sequence and head by
  `bert_bf16_transpose_round`), the column tile the softmax's probabilities in key pairs
  `[keys / 2, 16, 2]`: one `tdpbf16ps` per 16 dims and 32 keys, 16 x 16 fp32 sums, transposed on
  the way out. Up to 4 accumulator tiles (64 dims) a pass.

Keys and values are staged (zero) to a multiple of `KEY_STEP` keys, so that every tile load reads
staged rows; the probabilities past the last key pair are zeroed up to a whole tile here. Head
sizes that are a multiple of 32 (one tile row of bf16 dims) run here; others keep attention_bf16's
AVX-512 products. The C is c/attention_amx.c, with the tiles' configuration of c/amx.h.
"""

from __future__ import annotations

from .amx import ISA
from .objects import CObject

KEY_STEP = 32  # keys per context product: one row of a bf16 tile
SCORES = "bert_amx_attention_scores_d{head}"
CONTEXT = "bert_amx_attention_context_d{head}"
TRANSPOSE = "bert_bf16_transpose_round"

HEAD_SIZES = (32, 64, 128)  # head sizes the products are compiled for: multiples of a tile row of bf16 dims
OBJECT = CObject("attention_amx.c", frozenset({TRANSPOSE, *(symbol.format(head=head) for symbol in (SCORES, CONTEXT)
                                                          for head in HEAD_SIZES)}), ISA)


def supports(head_size: int, lanes: int) -> bool:
    """Whether the AMX products are compiled for this head size (and the lanes are AVX-512's)."""
    return lanes == 16 and head_size in HEAD_SIZES
