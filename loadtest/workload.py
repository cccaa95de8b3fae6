"""A seeded, realistic request mix: short queries to long passages, mostly one input per request."""

from __future__ import annotations

import random
from dataclasses import dataclass

# Word lengths of inputs, roughly what embedding traffic looks like: many short queries,
# a tail of paragraphs. Weights are relative frequencies.
LENGTH_BANDS = [((3, 12), 0.45), ((13, 40), 0.30), ((41, 120), 0.20), ((121, 300), 0.05)]
INPUTS_PER_REQUEST = [(1, 0.7), (2, 0.1), (4, 0.1), (8, 0.1)]
VOCABULARY = (
    "the a of to and in is for on that with as it by this be are from at or an was have not can will "
    "model server latency batch token sequence compile kernel matrix vector search query document "
    "embedding similarity retrieval index cluster request response throughput memory cache thread "
    "weather river mountain city music travel history science garden market energy health sport "
    "quickly slowly bright quiet heavy simple modern ancient useful careful"
).split()


@dataclass(frozen=True)
class Request:
    inputs: list[str]
    words: int


def _pick(rng: random.Random, weighted):
    values, weights = zip(*weighted)
    return rng.choices(values, weights=weights)[0]


def make_requests(count: int, seed: int = 0) -> list[Request]:
    """`count` requests; the same seed always gives the same traffic, for every server."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        inputs = []
        for _ in range(_pick(rng, INPUTS_PER_REQUEST)):
            low, high = _pick(rng, LENGTH_BANDS)
            inputs.append(" ".join(rng.choice(VOCABULARY) for _ in range(rng.randint(low, high))))
        requests.append(Request(inputs, sum(len(text.split()) for text in inputs)))
    return requests


def artifact_tokenizer(artifacts):
    """The artifact's tokenizer as the server runs it: no padding, no truncation (the shipped
    tokenizer.json of MiniLM pads to 128, which would count every input as 128 tokens)."""
    from pathlib import Path

    from tokenizers import Tokenizer

    from artifact.levels import resolve

    from .strategy_table import read_manifest

    artifacts = resolve(Path(artifacts))
    tokenizer = Tokenizer.from_file(str(artifacts / read_manifest(artifacts).tokenizer / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer
