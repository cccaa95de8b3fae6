"""The BERT family as the wrappers see it: what differs between BERT, RoBERTa, XLM-R, DistilBERT, ELECTRA,
MPNet, ModernBERT and DeBERTa-v2/v3.

The first six are post-LayerNorm encoders with eager attention (matmul + softmax) and a GELU
feed-forward, so one padded and one packed wrapper compile them all. They differ in module names,
in what the embeddings take (DistilBERT and MPNet have no token types; ELECTRA projects small
embeddings up to the hidden size), in where positions start (RoBERTa, XLM-R and MPNet count from the
padding index + 1, while the server always feeds 0..len-1), in a score bias added to every layer's
attention scores (MPNet's relative positions) and in the classification head. ModernBERT (pre-norm layers, rotary positions, GeGLU, sliding-window
attention on two layers in three) runs its layers through the same `LayerParts` in both layouts, and so
does DeBERTa-v2, whose layers add to their scores a term of their own Q and K (`LayerParts.relative_scores`).
A `Family` answers exactly those questions; everything it returns is the checkpoint's own modules
(or tables computed as the checkpoint computes them), so every numerical choice stays the checkpoint's.
"""

from __future__ import annotations

import functools
import math
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from artifact.manifest import SPLADE_POOLINGS

from .rotary import RotaryTables


@dataclass(frozen=True)
class LayerParts:
    """One encoder layer as the wrappers run it: Q/K/V rows of the layer input (at the tokens' positions),
    attention, then the layer's own attention-output and feed-forward blocks (each with its residual
    and layer norm). `window`: a query attends to the keys at most this many positions away (sliding-window
    attention); None, to every key. `sdpa`: the attention on PyTorch's fused kernel (a PyTorch peer's, never
    exported)."""

    project: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    heads: int
    head_size: int
    attention_output: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (context, layer input) -> attended
    feed_forward: Callable[[torch.Tensor], torch.Tensor]  # attended -> layer output
    window: int | None = None
    sdpa: bool = False
    scale_divisor: float | None = None  # what Q K^T is divided by; None: sqrt(head_size)
    # [batch, heads, seq, seq] added to the scores, of the layer's own per-head Q and K (DeBERTa's disentangled terms)
    relative_scores: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


def linear_projections(query: torch.nn.Linear, key: torch.nn.Linear, value: torch.nn.Linear):
    """`LayerParts.project` of three Linears of the layer input (no position in them)."""
    return lambda hidden, positions: (query(hidden), key(hidden), value(hidden))


def attention_core(layer: LayerParts, query, key, value, additive_mask, score_bias=None) -> torch.Tensor:
    """softmax(Q K^T / sqrt(head_size) [+ score bias] + mask) V over [batch, heads, seq, head_size], the mask
    [batch, 1, 1, seq] (0 for real keys, the dtype's min for padding) and, on a sliding-window layer, the keys
    farther than its window masked too; the family's score bias ([1, heads, seq, seq]) where it has one, or the
    layer's `relative_scores` of this Q and K ([batch, heads, seq, seq]) (FuseAttention recognises this graph:
    compile/passes/fuse_attention.py)."""
    mask = additive_mask if layer.window is None else windowed(additive_mask, layer.window)
    divisor = layer.scale_divisor or math.sqrt(layer.head_size)
    if layer.relative_scores is not None:
        score_bias = layer.relative_scores(query, key)
    if layer.sdpa:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask if score_bias is None else score_bias + mask, scale=1.0 / divisor)
    scores = torch.matmul(query, key.transpose(-1, -2)) / divisor
    scores = (scores if score_bias is None else scores + score_bias) + mask
    return torch.matmul(torch.softmax(scores, dim=-1), value)


def windowed(additive_mask: torch.Tensor, window: int) -> torch.Tensor:
    """[batch, 1, seq, seq]: the padding mask, and the dtype's min where |query - key| > window (as
    transformers' bidirectional sliding-window mask; the min replaces, never adds to, a padding key's)."""
    index = torch.arange(additive_mask.shape[-1], device=additive_mask.device)
    far = (index[:, None] - index[None, :]).abs() > window
    return torch.where(far, torch.finfo(additive_mask.dtype).min, additive_mask)


def padded_attention(layer: LayerParts, query, key, value, additive_mask) -> torch.Tensor:
    """`attention_core` of [batch, seq, heads * head_size] rows, the context in the same layout."""
    batch, seq, width = query.shape

    def per_head(rows):
        return rows.reshape(batch, seq, layer.heads, layer.head_size).transpose(1, 2)

    context = attention_core(layer, per_head(query), per_head(key), per_head(value), additive_mask)
    return context.transpose(1, 2).reshape(batch, seq, width)


# A multiple of every CPU matmul tile width (AVX2 24, AVX-512 32, compile/kernels/dense.py): an MLM
# head whose vocabulary is padded to it has its weight packed once, at compile time, where an
# unpadded one (BERT's 30522 words) would be padded and copied on every call.
VOCAB_MULTIPLE = 96


def pad_vocabulary(decoder: torch.nn.Linear) -> None:
    """Give an MLM head's decoder zero rows (weight and bias) up to a multiple of VOCAB_MULTIPLE,
    as weights of its own (untied from the embedding table, which the export would otherwise share).
    Their logits are 0, so their SPLADE weights are 0; `splade` cuts them off."""
    vocab, hidden = decoder.weight.shape
    padded = -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    weight = decoder.weight.detach().new_zeros(padded, hidden)
    weight[:vocab] = decoder.weight.detach()
    bias = decoder.weight.detach().new_zeros(padded)
    if decoder.bias is not None:
        bias[:vocab] = decoder.bias.detach()
    decoder.weight, decoder.bias = torch.nn.Parameter(weight), torch.nn.Parameter(bias)


def skewed(table: torch.Tensor, length) -> torch.Tensor:
    """[heads, length, length] of a [heads, 2 x length] table of relative positions kept cyclically (column
    (j - i) mod 2 x length for query i and key j), in views alone: the table repeated 2 x length - 1 times,
    flattened and read in rows one shorter than it, so that each query's row starts one column further left."""
    heads, rows = table.shape[0], 2 * length
    flat = table[:, None, :].expand(heads, rows - 1, rows).reshape(heads, (rows - 1) * rows)
    return flat.reshape(heads, rows, rows - 1)[:, :length, :length]


class FirstToken(torch.nn.Module):
    """[batch, seq, hidden] -> [batch, hidden] of token 0, for heads that do not select it themselves."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[:, 0]


class Family:
    """One member of the BERT family; the defaults are BERT's, which the others are told against."""

    hidden_size_key = "hidden_size"
    heads_key = "num_attention_heads"
    base_model_options = {"add_pooling_layer": False}  # an embedding model has no use for the pooler
    sdpa = True  # transformers runs the family's attention on PyTorch's fused kernel where asked to
    bias_at_bound = False  # whether a packed library computes the attention score bias at its bound

    def __init__(self, model_type: str, classifier: str):
        self.model_type = model_type
        self.classifier = classifier  # the architecture task `classify` takes

    def first_position(self, pad_token_id: int | None) -> int:
        """The position id of a sequence's first token."""
        return 0

    def load(self, path: Path, task: str, attention: str = "eager") -> torch.nn.Module:
        """The checkpoint's model; eager attention (plain matmul + softmax) is what we export and
        validate against, "sdpa" (PyTorch's fused attention, transformers' default) what a PyTorch
        server runs."""
        from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification

        attention = attention if self.sdpa else "eager"  # the family's only attention in transformers
        if task == "classify":
            return AutoModelForSequenceClassification.from_pretrained(path, attn_implementation=attention)
        if task == "sparse":
            model = AutoModelForMaskedLM.from_pretrained(path, attn_implementation=attention)
            pad_vocabulary(model.get_output_embeddings())
            return model
        return AutoModel.from_pretrained(path, attn_implementation=attention, **self.base_model_options)

    def embed(self, base: torch.nn.Module, input_ids, token_type_ids, position_ids) -> torch.Tensor:
        """Embeddings, `position_ids` counted from 0 (as the server feeds them)."""
        return base.embeddings(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids)

    def encoder(self, base: torch.nn.Module) -> torch.nn.Module:
        """The layer stack: called as `encoder(hidden, attention_mask=additive).last_hidden_state`."""
        return base.encoder

    def encode(self, base: torch.nn.Module, hidden, additive_mask, position_ids) -> torch.Tensor:
        """The padded layer stack's output ([batch, seq, hidden]) from the embeddings and the additive mask."""
        return self.encoder(base)(hidden, attention_mask=additive_mask).last_hidden_state

    def final(self, base: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """What follows the last layer (a pre-norm stack's final norm)."""
        return hidden

    def score_bias(self, base: torch.nn.Module, seq: torch.Tensor) -> torch.Tensor | None:
        """What every layer adds to its attention scores before the mask, [1, heads, seq, seq] for the
        sequences' own positions (`seq`: any tensor whose dim 1 is the sequence bound); None: nothing."""
        return None

    def unsupported(self, config: dict, task: str, pooling: str) -> str | None:
        """Why a checkpoint of this family with `config` is not compiled for `task` / `pooling`, in words; None: it is."""
        return None

    def classifier_pooling(self, model: torch.nn.Module) -> str:
        """What the classification head reads: "cls" (token 0, which `head` selects) or "mean" (the
        real tokens' mean, which the wrappers hand it as [batch, 1, hidden])."""
        return "cls"

    def layers(self, base: torch.nn.Module) -> list[LayerParts]:
        return [self._parts(layer) for layer in self.encoder(base).layer]

    def _parts(self, layer: torch.nn.Module) -> LayerParts:
        attention = layer.attention.self
        return LayerParts(linear_projections(attention.query, attention.key, attention.value),
                          attention.num_attention_heads, attention.attention_head_size, layer.attention.output,
                          lambda attended: layer.output(layer.intermediate(attended), attended))

    def head(self, model: torch.nn.Module) -> torch.nn.Module:
        """The classifier from [batch, seq, hidden]: the pooler (dense + tanh on token 0), then the linear."""
        return torch.nn.Sequential(model.bert.pooler, model.classifier)

    def mlm_head(self, model: torch.nn.Module) -> torch.nn.Module:
        """A masked LM's head from [..., hidden]: transform, layer norm, vocabulary logits."""
        return model.cls


class Roberta(Family):
    """RoBERTa and XLM-R: BERT's modules, positions after the padding index, a head without pooler."""

    def first_position(self, pad_token_id: int | None) -> int:
        return int(pad_token_id) + 1

    def embed(self, base: torch.nn.Module, input_ids, token_type_ids, position_ids) -> torch.Tensor:
        first = self.first_position(base.config.pad_token_id)  # in the compiled function, not in the server
        return super().embed(base, input_ids, token_type_ids, position_ids + first)

    def head(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.classifier  # RobertaClassificationHead: token 0, dense, tanh, out_proj

    def mlm_head(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.lm_head


class DistilBert(Family):
    """DistilBERT: no token types, its own module names, a pre-classifier with ReLU."""

    hidden_size_key = "dim"
    heads_key = "n_heads"
    base_model_options = {}

    def embed(self, base: torch.nn.Module, input_ids, token_type_ids, position_ids) -> torch.Tensor:
        return base.embeddings(input_ids=input_ids, position_ids=position_ids)

    def encoder(self, base: torch.nn.Module) -> torch.nn.Module:
        return base.transformer

    def _parts(self, layer: torch.nn.Module) -> LayerParts:
        attention = layer.attention
        return LayerParts(linear_projections(attention.q_lin, attention.k_lin, attention.v_lin), attention.n_heads,
                          attention.attention_head_size,
                          lambda context, hidden: layer.sa_layer_norm(attention.out_lin(context) + hidden),
                          lambda attended: layer.output_layer_norm(layer.ffn(attended) + attended))

    def head(self, model: torch.nn.Module) -> torch.nn.Module:
        return torch.nn.Sequential(FirstToken(), model.pre_classifier, torch.nn.ReLU(), model.classifier)

    def mlm_head(self, model: torch.nn.Module) -> torch.nn.Module:
        return torch.nn.Sequential(model.vocab_transform, model.activation, model.vocab_layer_norm,
                                   model.vocab_projector)


class Electra(Family):
    """ELECTRA: BERT's layers behind embeddings projected up to the hidden size (where the checkpoint
    has `embeddings_project`), a classification head of its own and the generator's MLM head."""

    base_model_options = {}

    def embed(self, base: torch.nn.Module, input_ids, token_type_ids, position_ids) -> torch.Tensor:
        embedded = super().embed(base, input_ids, token_type_ids, position_ids)
        return base.embeddings_project(embedded) if hasattr(base, "embeddings_project") else embedded

    def head(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.classifier  # ElectraClassificationHead: token 0, dense, GELU, out_proj

    def mlm_head(self, model: torch.nn.Module) -> torch.nn.Module:
        return torch.nn.Sequential(model.generator_predictions, model.generator_lm_head)


class MPNet(Roberta):
    """MPNet: BERT-like layers named its own way, no token types, positions after its fixed padding
    index, and one relative position bias (buckets of j - i, learned per head) added to every layer's
    scores: computed once per call, for one sequence, and shared by the batch and the layers."""

    padding_index = 1  # MPNetEmbeddings' own, whatever the config's pad_token_id
    sdpa = False  # transformers has only eager attention for MPNet: `load` puts PyTorch's fused kernel in

    def load(self, path: Path, task: str, attention: str = "eager") -> torch.nn.Module:
        model = super().load(path, task)
        if attention == "sdpa":
            from transformers.models.mpnet.modeling_mpnet import MPNetSelfAttention

            for module in model.modules():
                if isinstance(module, MPNetSelfAttention):
                    module.forward = types.MethodType(_sdpa_self_attention, module)
        return model

    def first_position(self, pad_token_id: int | None) -> int:
        return self.padding_index + 1

    def embed(self, base: torch.nn.Module, input_ids, token_type_ids, position_ids) -> torch.Tensor:
        return base.embeddings(input_ids=input_ids, position_ids=position_ids + self.first_position(None))

    def encode(self, base: torch.nn.Module, hidden, additive_mask, position_ids) -> torch.Tensor:
        bias = self.score_bias(base, hidden)
        for layer in base.encoder.layer:
            hidden = layer(hidden, additive_mask, bias)[0]
        return hidden

    def score_bias(self, base: torch.nn.Module, seq: torch.Tensor) -> torch.Tensor:
        """`compute_position_bias`'s, as views (`skewed`) of a table of the relative positions j - i kept
        cyclically (row r: r below seq, r - 2 x seq from it), 2 x seq rows: the fused attention kernel proves
        those views and reads the table (compile/passes/fuse_attention.py)."""
        encoder, length = base.encoder, seq.shape[1]
        rows = torch.arange(2 * length, device=seq.device)
        relative = torch.where(rows < length, rows, rows - 2 * length)
        table = encoder.relative_attention_bias(encoder.relative_position_bucket(relative))  # [2 x seq, heads]
        return skewed(table.T, length)[None]

    def _parts(self, layer: torch.nn.Module) -> LayerParts:
        attention = layer.attention.attn
        return LayerParts(linear_projections(attention.q, attention.k, attention.v), attention.num_attention_heads,
                          attention.attention_head_size,
                          lambda context, hidden: layer.attention.LayerNorm(attention.o(context) + hidden),
                          lambda attended: layer.output(layer.intermediate(attended), attended))

    def mlm_head(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.lm_head


class ModernBert(Family):
    """ModernBERT: pre-norm layers without biases, one Q/K/V linear, rotary positions (a table per layer
    type: global and sliding-window layers have their own theta), GeGLU, sliding windows of
    `local_attention` keys around each query between the global layers, a final norm, and a head
    (dense, activation, norm, linear) after token 0 or the tokens' mean."""

    base_model_options = {}

    def load(self, path: Path, task: str, attention: str = "eager") -> torch.nn.Module:
        model = super().load(path, task, attention)
        RotaryTables.of(model.base_model)  # before the wrapper reads the state dict (export, its key)
        return model

    def embed(self, base: torch.nn.Module, input_ids, token_type_ids, position_ids) -> torch.Tensor:
        return base.embeddings(input_ids=input_ids)  # positions enter through the rotary tables

    def encode(self, base: torch.nn.Module, hidden, additive_mask, position_ids) -> torch.Tensor:
        """On [batch * seq, hidden] rows, so that the rotated Q and K are rows the fused attention reads."""
        batch, seq, width = hidden.shape
        rows, positions = hidden.reshape(batch * seq, width), position_ids.reshape(batch * seq)
        for layer in self.layers(base):
            projected = (x.reshape(batch, seq, -1) for x in layer.project(rows, positions))
            context = padded_attention(layer, *projected, additive_mask).reshape(batch * seq, -1)
            rows = layer.feed_forward(layer.attention_output(context, rows))
        return self.final(base, rows.reshape(batch, seq, width))

    def final(self, base: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return base.final_norm(hidden)

    def classifier_pooling(self, model: torch.nn.Module) -> str:
        return model.config.classifier_pooling

    def layers(self, base: torch.nn.Module) -> list[LayerParts]:
        tables = RotaryTables.of(base)
        return [self._modern_parts(layer, base.config, tables) for layer in base.layers]

    def _modern_parts(self, layer: torch.nn.Module, config, tables: "RotaryTables") -> LayerParts:
        attention, heads = layer.attn, int(config.num_attention_heads)
        size = attention.head_dim
        rotate = tables.rotation(layer.attention_type)

        def project(hidden, positions):
            query, key, value = attention.Wqkv(layer.attn_norm(hidden)).chunk(3, dim=-1)
            return rotate(query, positions, heads), rotate(key, positions, heads), value

        return LayerParts(project, heads, size, lambda context, hidden: hidden + attention.Wo(context),
                          lambda attended: attended + layer.mlp(layer.mlp_norm(attended)),
                          window=int(config.sliding_window) if attention.sliding_window is not None else None,
                          sdpa=config._attn_implementation == "sdpa")

    def head(self, model: torch.nn.Module) -> torch.nn.Module:
        return torch.nn.Sequential(FirstToken(), model.head, model.classifier)

    def mlm_head(self, model: torch.nn.Module) -> torch.nn.Module:
        return torch.nn.Sequential(model.head, model.decoder)


class DebertaV2(Family):
    """DeBERTa-v2 and v3: BERT-like post-norm layers whose attention is disentangled. Besides Q K^T, each layer
    scores every query against the relative position of each key (content-to-position, c2p) and every key
    against the query's (position-to-content, p2c): the layer's own Q and K against its projections of one
    table of relative position embeddings, read at log buckets of i - j. That term depends on the layer's
    content, so each layer computes it as a [batch, heads, seq, seq] score bias of each sequence's own
    positions, which the fused attention kernel adds; every term is divided by sqrt(head_size x (1 + terms))."""

    base_model_options = {}
    sdpa = False  # transformers has only eager attention for DeBERTa-v2
    bias_at_bound = True  # the [heads, seq, seq] terms of each sequence, seq the packed library's bound

    def unsupported(self, config: dict, task: str, pooling: str) -> str | None:
        if int(config.get("conv_kernel_size", 0) or 0) > 0:
            return "its convolution after the first layer (conv_kernel_size, DeBERTa-v2 xlarge/xxlarge) is not compiled"
        terms = set(config.get("pos_att_type") or [])
        if not terms <= {"c2p", "p2c"}:
            return f"pos_att_type {sorted(terms)} is not compiled (supported: c2p, p2c)"
        if pooling in SPLADE_POOLINGS:
            return "its masked-LM head is not compiled (--task sparse)"
        return None

    def encode(self, base: torch.nn.Module, hidden, additive_mask, position_ids) -> torch.Tensor:
        for layer in self.layers(base):
            context = padded_attention(layer, *layer.project(hidden, position_ids), additive_mask)
            hidden = layer.feed_forward(layer.attention_output(context, hidden))
        return hidden

    def load(self, path: Path, task: str, attention: str = "eager") -> torch.nn.Module:
        model = super().load(path, task)
        encoder = model.base_model.encoder
        if encoder.relative_attention:  # each layer's projections of the relative table, once (weights of the export)
            with torch.no_grad():
                table = encoder.get_rel_embedding()
                for layer in encoder.layer:
                    _project_positions(layer.attention.self, table)
        return model

    def layers(self, base: torch.nn.Module) -> list[LayerParts]:
        return [self._disentangled_parts(layer) for layer in base.encoder.layer]

    def _disentangled_parts(self, layer: torch.nn.Module) -> LayerParts:
        attention = layer.attention.self
        terms = [term for term in ("c2p", "p2c") if term in attention.pos_att_type]
        divisor = math.sqrt(attention.attention_head_size * (1 + len(terms)))
        scores = None
        if attention.relative_attention and terms:
            scores = functools.partial(_disentangled_scores, attention, divisor)
        return LayerParts(linear_projections(attention.query_proj, attention.key_proj, attention.value_proj),
                          attention.num_attention_heads, attention.attention_head_size, layer.attention.output,
                          lambda attended: layer.output(layer.intermediate(attended), attended),
                          scale_divisor=divisor, relative_scores=scores)

    def head(self, model: torch.nn.Module) -> torch.nn.Module:
        return torch.nn.Sequential(model.pooler, model.classifier)  # ContextPooler: token 0, dense, activation


def _project_positions(attention: torch.nn.Module, table: torch.Tensor) -> None:
    """Register on a DisentangledSelfAttention its c2p keys and p2c queries of the relative position table
    ([heads, 2 x span, head_size]), as transformers projects them at every call."""
    span, heads = attention.pos_ebd_size, attention.num_attention_heads
    shared = attention.share_att_key
    for term, name, projection in (("c2p", "position_keys", "key_proj" if shared else "pos_key_proj"),
                                   ("p2c", "position_queries", "query_proj" if shared else "pos_query_proj")):
        if term in attention.pos_att_type:
            rows = getattr(attention, projection)(table[:2 * span])
            attention.register_buffer(name, rows.reshape(2 * span, heads, -1).transpose(0, 1).contiguous())


def _disentangled_scores(attention: torch.nn.Module, divisor: float, query, key) -> torch.Tensor:
    """DisentangledSelfAttention.disentangled_attention_bias's terms for per-head Q and K [batch, heads, seq,
    head_size] of positions 0..seq-1: [batch, heads, seq, seq], as transformers computes them (its buckets, its
    clamped table indices, its gathers)."""
    from transformers.models.deberta_v2.modeling_deberta_v2 import make_log_bucket_position

    batch, heads, seq, _ = query.shape
    span = attention.pos_ebd_size
    # build_relative_position's buckets of i - j, [seq, seq], from float differences (the same values: its int64
    # ones are divided into floats before the log, a division TVM's importer keeps in int64)
    index = torch.arange(seq, dtype=torch.float32, device=query.device)
    positions = index[:, None] - index[None, :]
    if attention.position_buckets > 0 and attention.max_relative_positions > 0:
        positions = make_log_bucket_position(positions, attention.position_buckets, attention.max_relative_positions)
    positions = positions.to(torch.long)
    terms = []
    if "c2p" in attention.pos_att_type:  # [batch, heads, seq, 2 x span], as the position keys' products with Q
        # (not Q's with them: CombineParallelMatmul would join that matmul to Q K^T's, which the fused attention reads)
        c2p = torch.matmul(attention.position_keys, query.transpose(-1, -2)).transpose(-1, -2)
        index = torch.clamp(positions + span, 0, 2 * span - 1).expand(batch, heads, seq, seq)
        terms.append(torch.gather(c2p, -1, index) / divisor)
    if "p2c" in attention.pos_att_type:
        p2c = torch.matmul(key, attention.position_queries.transpose(-1, -2))  # [batch, heads, seq (keys), 2 x span]
        index = torch.clamp(-positions + span, 0, 2 * span - 1).expand(batch, heads, seq, seq)
        terms.append(torch.gather(p2c, -1, index).transpose(-1, -2) / divisor)
    return terms[0] if len(terms) == 1 else terms[0] + terms[1]


def _sdpa_self_attention(self, hidden_states, attention_mask=None, position_bias=None, output_attentions=False,
                         **kwargs):
    """MPNetSelfAttention's function on torch.nn.functional.scaled_dot_product_attention: the relative
    position bias and the mask as its additive `attn_mask`."""
    shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)
    query, key, value = (projection(hidden_states).view(shape).transpose(1, 2)
                         for projection in (self.q, self.k, self.v))
    bias = [b for b in (position_bias, attention_mask) if b is not None]
    context = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=bias[0] + bias[1] if len(bias) == 2 else (bias or [None])[0])
    return (self.o(context.transpose(1, 2).reshape(*hidden_states.shape[:-1], self.all_head_size)),)


FAMILIES = {
    family.model_type: family
    for family in (
        Family("bert", "BertForSequenceClassification"),
        Roberta("roberta", "RobertaForSequenceClassification"),
        Roberta("xlm-roberta", "XLMRobertaForSequenceClassification"),
        DistilBert("distilbert", "DistilBertForSequenceClassification"),
        Electra("electra", "ElectraForSequenceClassification"),
        MPNet("mpnet", "MPNetForSequenceClassification"),
        ModernBert("modernbert", "ModernBertForSequenceClassification"),
        DebertaV2("deberta-v2", "DebertaV2ForSequenceClassification"),
    )
}
