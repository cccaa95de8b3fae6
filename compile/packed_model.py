"""A BERT-family encoder over packed tokens: the function a packed artifact compiles (inputs:
artifact/packed_batch.py).

Every linear layer, layer norm and GELU runs on `[tokens, hidden]`, the real tokens of all
sequences one after another, so none of that work is spent on padding. Attention gathers each
sequence's rows into `[batch, seq]` (masked past its end), and scatters the result back; pooling
gathers the same way. The layers are the checkpoint's own modules (found by its family,
compile/families.py), so the weights and every numerical choice (scale, additive mask, GELU,
layer norm eps) are those of `BertWrapper`, which stays the oracle: validation compares a packed
library with it on padded rows.
"""

from __future__ import annotations

import torch

from .checkpoint import FIRST_TOKEN_POOLINGS, BertWrapper, pool, splade
from .families import LayerParts, attention_core


class PackedBertWrapper(torch.nn.Module):
    """`BertWrapper`'s function on the packed layout; shares its modules (and weights)."""

    def __init__(self, padded: BertWrapper):
        super().__init__()
        self.task = padded.task
        self.pooling = padded.pooling
        self.family = padded.family
        self.bert = padded.bert
        self.classifier = padded.classifier
        self.classifier_pooling = padded.classifier_pooling
        self.mlm_head = padded.mlm_head
        self.vocab_size = padded.vocab_size
        self.dense = padded.dense  # the Dense layers after pooling, where the checkpoint has them
        self.projection = padded.projection  # ColBERT's, run on the real tokens only
        self.colbert = padded.colbert
        self.returning_tokens = padded.returning_tokens
        self.layers = padded.family.layers(padded.bert)

    head = BertWrapper.head
    token_head = BertWrapper.token_head
    additive_mask = BertWrapper.additive_mask

    def forward(self, input_ids, token_type_ids, position_ids, gather, attention_mask, scatter):
        batch, seq = gather.shape
        rows = gather.reshape(-1)
        hidden = self.family.embed(self.bert, input_ids[None], token_type_ids[None], position_ids[None])[0]
        mask = attention_mask.to(hidden.dtype)
        additive = self.additive_mask(attention_mask, hidden.dtype)
        score_bias = self.family.score_bias(self.bert, gather)  # each sequence's own positions, i and j < seq
        for layer in self.layers:
            context = self._attention(layer, layer.project(hidden, position_ids), rows, additive, score_bias,
                                      scatter, batch, seq)
            hidden = layer.feed_forward(layer.attention_output(context, hidden))
        hidden = self.family.final(self.bert, hidden)
        pooled = self.pooled(hidden, mask, gather, rows, batch, seq)
        return (pooled, self.token_head(hidden)) if self.returning_tokens else pooled

    def pooled(self, hidden, mask, gather, rows, batch, seq):
        """The task's output from the packed final states [tokens, hidden]."""
        if self.task == "classify" and self.classifier_pooling == "mean":
            return self.classifier(pool(torch.index_select(hidden, 0, rows).reshape(batch, seq, -1), mask, "mean")[:, None])
        if self.task == "classify":  # the head reads token 0 of [batch, seq, hidden]: give it [batch, 1, hidden]
            return self.classifier(torch.index_select(hidden, 0, gather[:, 0])[:, None])
        if self.pooling == "none":  # [tokens, hidden]: every real token's state, in packed order
            return hidden
        if self.pooling in FIRST_TOKEN_POOLINGS:
            return self.head(torch.index_select(hidden, 0, gather[:, 0]))
        if self.mlm_head is not None:  # the vocabulary-wide head on the real tokens only
            logits = self.mlm_head(hidden)
            return splade(torch.index_select(logits, 0, rows).reshape(batch, seq, -1), mask, self.pooling,
                          self.vocab_size)
        return self.head(pool(torch.index_select(hidden, 0, rows).reshape(batch, seq, -1), mask, self.pooling))

    @staticmethod
    def _attention(layer: LayerParts, projected, rows, additive, score_bias, scatter, batch, seq):
        """The eager self-attention per sequence: packed Q, K, V rows, gathered per head (so that a sliding
        window or a score bias never reaches into another sequence), the context scattered back to the packed
        rows."""
        heads, size = layer.heads, layer.head_size

        def per_sequence(rows_of_tokens):
            return torch.index_select(rows_of_tokens, 0, rows).reshape(batch, seq, heads, size).transpose(1, 2)

        context = attention_core(layer, *(per_sequence(x) for x in projected), additive, score_bias)
        return torch.index_select(context.transpose(1, 2).reshape(batch * seq, heads * size), 0, scatter)
