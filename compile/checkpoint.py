"""Reading a Hugging Face BERT-family checkpoint and wrapping it as the exact function we compile.

The same wrapper is exported for TVM and run eagerly as the PyTorch oracle (validation, the
service's `--backend torch`), so both sides compute the same thing by construction.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from artifact.colbert import ColbertSettings
from artifact.hashing import file_sha256
from artifact.manifest import SPLADE_POOLINGS, remote_code_refusal

from .dense_head import DenseLayer, dense_head, dense_layers, module_config, module_kind, sentence_transformers_modules
from .errors import CompileError
from .families import FAMILIES, Family
from .m3_heads import HEAD_FILES, M3Heads, colbert_width, has_m3_heads
from .tokenizer import fast_tokenizer_file

FIRST_TOKEN_POOLINGS = ("cls", "colbert", "bge-m3")  # ColBERT's and bge-m3's pooled row: the [CLS] state
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
DEFAULT_LABELS = 2  # a classifier's labels where its config names none (transformers' PretrainedConfig default)
# sentence-transformers' Pooling config before `pooling_mode`: one bool per mode
LEGACY_POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                       "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                       "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
# A ColBERT query's expansion [MASK] tokens: their value in the attention mask (real tokens are 1, padding
# 0), and the additive bias that takes them out of every softmax over keys (exp of it is 0, as of the
# dtype's min) while keeping them among the real keys the fused attention kernel computes rows for
EXPANDED = 2
EXPANSION_BIAS = -1e20
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids", "position_ids")  # the wrapper's arguments
TOKENIZER_FILES = (  # copied into the artifact beside its tokenizer.json (`tokenizer.fast_tokenizer_file`)
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",  # WordPiece (BERT, DistilBERT)
    "vocab.json",  # byte-level BPE (RoBERTa)
    "merges.txt",
    "sentencepiece.bpe.model",  # XLM-R
    "spm.model",  # DeBERTa-v2/v3's SentencePiece
    "sentence_bert_config.json",  # max_seq_length: the input limit sentence-transformers applies
    "config_sentence_transformers.json",  # prompts (e5-style "query: " prefixes) and the default prompt name
)


@dataclass(frozen=True)
class CheckpointInfo:
    """What the compile stage needs to know about a checkpoint before loading weights."""

    path: Path
    config: dict
    weight_files: tuple[Path, ...]
    tokenizer_file: Path  # the fast tokenizer AutoTokenizer loads from it, saved (`tokenizer.fast_tokenizer_file`)
    pooling: str
    labels: list[str] = field(default_factory=list)
    dense: tuple[DenseLayer, ...] = ()  # sentence-transformers Dense modules after the pooling
    projection: tuple[DenseLayer, ...] = ()  # a ColBERT model's Dense modules, on every token
    colbert: ColbertSettings | None = None
    m3_colbert_dim: int | None = None  # bge-m3: its ColBERT head's width (compile/m3_heads.py)

    @property
    def family(self) -> Family:
        return FAMILIES[self.config["model_type"]]

    @property
    def max_seq(self) -> int:
        """The longest input: RoBERTa's position table also holds the padding index and the one before it."""
        first = self.family.first_position(self.config.get("pad_token_id"))
        return int(self.config.get("max_position_embeddings", 512)) - first

    @property
    def hidden_size(self) -> int:
        return int(self.config[self.family.hidden_size_key])

    @property
    def attention_heads(self) -> int:
        return int(self.config[self.family.heads_key])

    @property
    def output_dim(self) -> int:
        """One input's output row: a classifier's labels, SPLADE's vocabulary, the last Dense layer's
        width, else the hidden size."""
        if self.labels:
            return len(self.labels)
        if self.dense:
            return self.dense[-1].out_features
        return int(self.config["vocab_size"]) if self.pooling in SPLADE_POOLINGS else self.hidden_size

    @property
    def token_dim(self) -> int | None:
        """The width of the token output (ColBERT's projection, else the hidden size); None where the
        libraries have none (a classifier; `--pooling none`, whose one output is the tokens')."""
        if self.labels or self.pooling == "none":
            return None
        if self.m3_colbert_dim is not None:
            return self.m3_colbert_dim + 1  # the ColBERT vector, then the lexical weight
        return self.projection[-1].out_features if self.projection else self.hidden_size

    @property
    def head_files(self) -> tuple[Path, ...]:
        """Weights beside the encoder's: Dense modules, bge-m3's heads."""
        m3 = tuple(self.path / name for name in HEAD_FILES) if self.m3_colbert_dim is not None else ()
        return (*(layer.weight_file for layer in (*self.dense, *self.projection)), *m3)

    def weights_sha256(self) -> str:
        digest = hashlib.sha256()
        for weight_file in (*self.weight_files, *self.head_files):
            digest.update(weight_file.name.encode())
            digest.update(file_sha256(weight_file).encode())
        return digest.hexdigest()


def checkpoint_prompts(model_dir: Path) -> dict:
    """The sentence-transformers prompts of a checkpoint that prepend text ({name: text}; sentence-transformers
    6 saves empty `query` and `document` ones by default)."""
    path = model_dir / "config_sentence_transformers.json"
    prompts = (json.loads(path.read_text()).get("prompts") or {}) if path.is_file() else {}
    return {name: text for name, text in prompts.items() if text}


def sentence_transformers_pooling(model_dir: Path) -> str | None:
    """Pooling declared by a sentence-transformers checkpoint (modules.json -> Pooling config)."""
    for module in sentence_transformers_modules(model_dir):
        if module_kind(module) == "Pooling":
            pooling_config = module_config(model_dir, module)
            if pooling_config.get("include_prompt") is False and checkpoint_prompts(model_dir):
                raise CompileError(f"{model_dir}: its Pooling leaves the prompt's tokens out (include_prompt: false), "
                                   "which the libraries do not compile; without the prompts of "
                                   "config_sentence_transformers.json it compiles")
            mode = pooling_config.get("pooling_mode")  # sentence-transformers >= 5.2; before, one bool per mode
            if mode is None:
                active = [name for key, name in LEGACY_POOLING_KEYS.items() if pooling_config.get(key)]
                mode = active[0] if len(active) == 1 else active or "mean"  # several: their concatenation
            if mode in ("mean", "cls", "max"):
                return mode
            raise CompileError(f"{model_dir}: sentence-transformers pooling {mode} is not compiled "
                               "(supported: mean, cls, max)")
    return None


def splade_pooling(model_dir: Path, config: dict) -> str:
    """The SPLADE pooling of a masked-LM checkpoint: its sentence-transformers SpladePooling config
    (a SparseEncoder's), else SPLADE v2's max."""
    architectures = config.get("architectures") or []
    if not any(name.endswith("ForMaskedLM") for name in architectures):
        raise CompileError(f"{model_dir} is not a masked-LM checkpoint (architectures={architectures}); --task sparse "
                           "needs a *ForMaskedLM or a sentence-transformers SparseEncoder (MLMTransformer + SpladePooling)")
    pooling_config = next((module_config(model_dir, module) for module in sentence_transformers_modules(model_dir)
                           if module_kind(module) == "SpladePooling"), {})
    strategy = pooling_config.get("pooling_strategy", "max")
    activation = pooling_config.get("activation_function", "relu")
    if strategy not in ("max", "sum") or activation != "relu":
        raise CompileError(f"{model_dir}: unsupported SPLADE pooling {strategy} of {activation} (supported: max or "
                           "sum of relu)")
    return "splade" if strategy == "max" else "splade-sum"


def inspect_checkpoint(model_dir: Path, task: str, pooling: str = "auto") -> CheckpointInfo:
    """Check that `model_dir` is a checkpoint of a family we compile, usable for `task`, without loading weights."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CompileError(f"model directory not found: {model_dir}")
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise CompileError(f"{model_dir} is not a Hugging Face checkpoint: no config.json")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise CompileError(f"{config_file} is not valid JSON: {exc}") from None
    refusal = remote_code_refusal(config, str(model_dir))
    if refusal is not None:
        raise CompileError(refusal)
    family = FAMILIES.get(config.get("model_type"))
    if family is None:
        raise CompileError(f"{model_dir} is not a BERT checkpoint (model_type={config.get('model_type')!r}; "
                           f"supported: {', '.join(FAMILIES)})")
    reason = family.unsupported(config, task, pooling)
    if reason is not None:
        raise CompileError(f"{model_dir} ({config['model_type']}): {reason}")
    weight_files = tuple(model_dir / name for name in WEIGHT_FILES if (model_dir / name).is_file())
    if not weight_files:
        raise CompileError(f"{model_dir} has no weights ({' or '.join(WEIGHT_FILES)})")
    tokenizer_file = fast_tokenizer_file(model_dir)
    labels: list[str] = []
    if task == "classify":
        architectures = config.get("architectures") or []
        if family.classifier not in architectures:
            raise CompileError(
                f"{model_dir} is not a {family.classifier} checkpoint "
                f"(architectures={architectures}); use --task embed"
                + (", or --task sparse for its masked-LM head" if any(a.endswith("ForMaskedLM") for a in architectures)
                   else "")
            )
        # transformers writes no id2label (nor num_labels) where they are its defaults: 2 labels, LABEL_i
        id2label = config.get("id2label") or {}
        count = len(id2label) or int(config.get("num_labels", DEFAULT_LABELS))
        labels = [id2label.get(str(i), id2label.get(i, f"LABEL_{i}")) for i in range(count)]
    if task == "embed" and pooling in SPLADE_POOLINGS:  # "splade": max or sum, as the checkpoint says
        found = splade_pooling(model_dir, config)
        pooling = found if pooling == "splade" else pooling
    colbert = ColbertSettings.of_checkpoint(model_dir) if task == "embed" and pooling in ("auto", "colbert") else None
    if pooling == "colbert" or colbert is not None:  # --task colbert, or a PyLate checkpoint
        return colbert_checkpoint(model_dir, config, weight_files, tokenizer_file, colbert)
    if task == "embed" and pooling in ("auto", "bge-m3") and has_m3_heads(model_dir):  # bge-m3, FlagEmbedding's layout
        hidden_size = int(config[family.hidden_size_key])
        return CheckpointInfo(path=model_dir.resolve(), config=config, weight_files=weight_files,
                              tokenizer_file=tokenizer_file, pooling="bge-m3",
                              m3_colbert_dim=colbert_width(model_dir, hidden_size))
    if task == "embed" and pooling == "auto":
        pooling = sentence_transformers_pooling(model_dir) or "cls"
    pooled = task == "embed" and pooling not in SPLADE_POOLINGS and pooling != "none"
    return CheckpointInfo(
        path=model_dir.resolve(),
        config=config,
        weight_files=weight_files,
        tokenizer_file=tokenizer_file,
        pooling=pooling if task == "embed" else "none",
        labels=labels,
        dense=dense_layers(model_dir, int(config[family.hidden_size_key])) if pooled else (),
    )


def colbert_checkpoint(model_dir: Path, config: dict, weight_files: tuple[Path, ...], tokenizer_file: Path,
                       settings: ColbertSettings | None) -> CheckpointInfo:
    """A ColBERT checkpoint in PyLate's layout: the encoder, its Dense projection of every token
    (modules.json) and its query and document settings (config_sentence_transformers.json)."""
    if settings is None:
        raise CompileError(f"{model_dir} is not a ColBERT checkpoint: its config_sentence_transformers.json names "
                           "no query_prefix or query_length (PyLate's layout)")
    hidden_size = int(config[FAMILIES[config["model_type"]].hidden_size_key])
    projection = dense_layers(model_dir, hidden_size)
    if not projection:
        raise CompileError(f"{model_dir} has no projection for ColBERT (no Dense module in modules.json)")
    return CheckpointInfo(path=model_dir.resolve(), config=config, weight_files=weight_files,
                          tokenizer_file=tokenizer_file, pooling="colbert", projection=projection, colbert=settings)


class BertWrapper(torch.nn.Module):
    """A BERT-family encoder with explicit position/token-type ids and our own additive attention mask.

    Building the 4-D mask here (rather than in the model's `forward`) keeps transformers' mask
    utilities out of the exported graph; passing position ids keeps the sequence length free
    of `min(seq, 512)` guards (see TVM-0.27-NOTES). Position ids count from 0 for every family
    (the family adds its offset). Token type ids are ignored by a family without them.
    """

    def __init__(self, model: torch.nn.Module, task: str, pooling: str, dense: torch.nn.Module | None = None,
                 projection: torch.nn.Module | None = None, colbert: ColbertSettings | None = None):
        super().__init__()
        self.task = task
        self.pooling = pooling
        self.dense = dense  # the checkpoint's Dense layers after pooling (compile/dense_head.py)
        self.projection = projection  # a ColBERT model's Dense layers, on every token (the token output)
        self.colbert = colbert
        # set while exporting (`returning_tokens`): the libraries return every token's state beside the pooled row
        self.returning_tokens = False
        self.family = FAMILIES[model.config.model_type]
        self.bert = model.base_model  # the encoder, whatever the family calls it
        self.classifier = self.family.head(model) if task == "classify" else None  # [B, S, H] -> logits
        self.classifier_pooling = self.family.classifier_pooling(model) if task == "classify" else None
        self.mlm_head = self.family.mlm_head(model) if pooling in SPLADE_POOLINGS else None  # -> vocabulary logits
        self.vocab_size = int(model.config.vocab_size)  # the MLM head's logits are padded past it

    def additive_mask(self, attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[batch, 1, 1, seq] from the [batch, seq] mask: 0 for real tokens, the dtype's min for
        padding (what the softmax over keys adds); a ColBERT model's query expansion tokens (EXPANDED)
        get EXPANSION_BIAS: no key weight, as padding, yet computed as queries (their rows are outputs)."""
        mask = attention_mask.to(dtype)[:, None, None, :]
        if self.colbert is None:
            return (1.0 - mask) * torch.finfo(dtype).min
        # mask 0, 1, 2 -> min, 0, EXPANSION_BIAS, in arithmetic (a `where` on the mask reads as a sliding window)
        return (1.0 - mask.clamp(max=1.0)) * torch.finfo(dtype).min + (mask - 1.0).clamp(min=0.0) * EXPANSION_BIAS

    @property
    def has_token_states(self) -> bool:
        """Whether the libraries return every token's state as a second output (every embedding
        model that pools: `--pooling none` returns nothing else)."""
        return self.task == "embed" and self.pooling != "none"

    def forward(self, input_ids, attention_mask, token_type_ids, position_ids):
        hidden = self.encode(input_ids, attention_mask, token_type_ids, position_ids)
        pooled = self.pooled(hidden, attention_mask.to(hidden.dtype))
        return (pooled, self.token_head(hidden)) if self.returning_tokens else pooled

    def encode(self, input_ids, attention_mask, token_type_ids, position_ids) -> torch.Tensor:
        """The final hidden state of every token, [batch, seq, hidden]."""
        hidden = self.family.embed(self.bert, input_ids, token_type_ids, position_ids)
        additive = self.additive_mask(attention_mask, hidden.dtype)
        return self.family.encode(self.bert, hidden, additive, position_ids)

    def token_states(self, input_ids, attention_mask, token_type_ids, position_ids) -> torch.Tensor:
        """The libraries' second output on padded rows: every token's state [batch, seq, dim]."""
        return self.token_head(self.encode(input_ids, attention_mask, token_type_ids, position_ids))

    def token_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the token output computes from the final hidden states: ColBERT's projection of each
        (bge-m3's heads), else the states themselves."""
        return hidden if self.projection is None else self.projection(hidden)

    def pooled(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The task's output from the final hidden states and the float mask."""
        if self.task == "classify":  # a head of the tokens' mean reads it as [batch, 1, hidden]
            return self.classifier(pool(hidden, mask, "mean")[:, None] if self.classifier_pooling == "mean" else hidden)
        if self.pooling == "none":
            return hidden
        if self.mlm_head is not None:
            return splade(self.mlm_head(hidden), mask, self.pooling, self.vocab_size)
        return self.head(hidden[:, 0] if self.pooling in FIRST_TOKEN_POOLINGS else pool(hidden, mask, self.pooling))

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        """The sentence embedding from the pooled one: through the Dense layers, where the checkpoint has them."""
        return pooled if self.dense is None else self.dense(pooled)


@contextmanager
def returning_tokens(wrapper: BertWrapper):
    """The wrapper as the libraries compute it: where it has token states, (pooled, token states)
    (the token output is a second output, so that a call that only pools copies nothing more out)."""
    wrapper.returning_tokens = wrapper.has_token_states
    try:
        yield wrapper
    finally:
        wrapper.returning_tokens = False


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """Mean or max pooling of [batch, seq, hidden] over the real tokens of `mask` [batch, seq]."""
    token_mask = mask.unsqueeze(-1)
    if pooling == "max":
        return (hidden + (1.0 - token_mask) * torch.finfo(hidden.dtype).min).amax(dim=1)  # see `splade`
    return (hidden * token_mask).sum(dim=1) / token_mask.sum(dim=1).clamp(min=1e-9)


def splade(logits: torch.Tensor, mask: torch.Tensor, pooling: str, vocab_size: int) -> torch.Tensor:
    """SpladePooling's: log(1 + relu(logits)) of the real tokens ([batch, seq, padded vocabulary],
    padding zeroed), max or (splade-sum) summed over them, cut to the vocabulary: [batch, vocab].
    `amax`, not `max(dim).values`: the latter imports as a top-k, which TVM's runtime library
    (what the server loads) lacks."""
    weights = torch.log1p(torch.relu(logits * mask.unsqueeze(-1)))
    pooled = weights.sum(dim=1) if pooling == "splade-sum" else weights.amax(dim=1)
    return pooled[:, :vocab_size]


def load_wrapper(info: CheckpointInfo, task: str, dtype: str = "float32", attention: str = "eager") -> BertWrapper:
    """Load the checkpoint's weights into the wrapper we compile (and validate against); `attention`
    "sdpa" gives PyTorch at its best (the PyTorch server and the benchmarks' PyTorch peer)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model = info.family.load(info.path, "sparse" if info.pooling in SPLADE_POOLINGS else task, attention)
    except (OSError, ValueError, RuntimeError) as exc:
        raise CompileError(f"cannot load weights from {info.path}: {exc}".splitlines()[0]) from None
    if task == "classify" and model.config.num_labels != len(info.labels):
        raise CompileError(f"{info.path}: its classifier has {model.config.num_labels} outputs where its config "
                           f"names {len(info.labels)} labels")
    dense, projection = dense_head(info.dense), dense_head(info.projection)
    if info.m3_colbert_dim is not None:
        projection = M3Heads(info.path, info.hidden_size)
    return BertWrapper(model.to(getattr(torch, dtype)).eval(), task, info.pooling,
                       dense.to(getattr(torch, dtype)) if dense is not None else None,
                       projection.to(getattr(torch, dtype)) if projection is not None else None, info.colbert).eval()


def example_inputs(batch: int, seq: int, vocab_size: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random token ids with a ragged attention mask, as the runtime would feed them."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (batch, seq), generator=generator)
    lengths = torch.randint(1, seq + 1, (batch,), generator=generator)
    lengths[0] = seq  # at least one full row
    attention_mask = (torch.arange(seq)[None, :] < lengths[:, None]).to(torch.int64)
    token_type_ids = torch.zeros(batch, seq, dtype=torch.int64)
    position_ids = torch.arange(seq, dtype=torch.int64).expand(batch, seq).contiguous()
    return input_ids, attention_mask, token_type_ids, position_ids
