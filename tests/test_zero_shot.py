"""Zero-shot classification with NLI classifiers: tiny random-weight BERT and RoBERTa checkpoints whose
labels are contradiction, neutral and entailment, compiled (packed and padded), served on loopback, and
answered as transformers' zero-shot-classification pipeline answers on the same checkpoints. The
RoBERTa checkpoint ships no tokenizer.json (vocab.json and merges.txt only): the compile converts its
tokenizer, and its pairs must still be tokenized as transformers tokenizes them."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from artifact.manifest import Manifest
from compile.validate import DRIFT_SENTENCES
from tests.support.artifacts import compile_artifact
from tests.support.checkpoints import save_tiny_nli
from tests.support.service import error_of

pytestmark = pytest.mark.slow  # collected first: see conftest.py

LABELS = {"bert": ["contradiction", "neutral", "entailment"],
          "roberta": ["ENTAILMENT", "neutral", "contradiction"]}  # entailment first: contradiction is the last class
MAX_SEQ = 64  # both checkpoints' positions
TEXTS = DRIFT_SENTENCES[:3]
CANDIDATES = ["music", "finance", "weather", "food"]
LONG_TEXT = " ".join(DRIFT_SENTENCES * 2)  # longer than MAX_SEQ tokens: cut, its hypothesis kept whole


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nli")
    return {family: save_tiny_nli(root / family, family, labels, DRIFT_SENTENCES) for family, labels in LABELS.items()}


@pytest.fixture(scope="module")
def server(serve, checkpoints, tmp_path_factory):
    """Both NLI classifiers, named by family: BERT packed, RoBERTa padded."""
    root = tmp_path_factory.mktemp("nli-artifacts")
    compile_artifact(checkpoints["bert"], root / "bert", ["packed-64"], task="classify", layout="packed",
                     generic_shapes=["3x20"])
    compile_artifact(checkpoints["roberta"], root / "roberta", ["4x32"], task="classify", generic_shapes=["3x20"])
    with serve([root / "bert", root / "roberta"], "--workers", "1", "--max-client-batch-size", "16") as running:
        running.artifacts = root
        yield running


def pipeline_scores(directory: Path, texts: list[str], labels: list[str], **options) -> list[dict[str, float]]:
    """transformers' zero-shot-classification pipeline on `directory`: per text, each label's score."""
    from transformers import AutoTokenizer, pipeline

    tokenizer = AutoTokenizer.from_pretrained(directory, model_max_length=MAX_SEQ)  # what it truncates the text to
    classifier = pipeline("zero-shot-classification", model=str(directory), tokenizer=tokenizer, device="cpu")
    return [dict(zip(answer["labels"], answer["scores"]))
            for answer in classifier(texts, candidate_labels=labels, **options)]


def served_scores(server, body: dict) -> list[dict[str, float]]:
    response = httpx.post(f"{server.url}/classify", json=body, timeout=60)
    assert response.status_code == 200, response.text
    answers = response.json()
    for ranked in answers:
        assert [p["score"] for p in ranked] == sorted((p["score"] for p in ranked), reverse=True)
    return [{p["label"]: p["score"] for p in ranked} for ranked in answers]


def assert_same_scores(served: list[dict[str, float]], expected: list[dict[str, float]]) -> None:
    assert len(served) == len(expected)
    for got, want in zip(served, expected):
        assert set(got) == set(want)
        np.testing.assert_allclose([got[label] for label in want], list(want.values()), atol=1e-4)


@pytest.mark.parametrize("family", LABELS)
def test_zero_shot_scores_as_transformers_pipeline(server, checkpoints, family):
    """Single-label (a softmax over the labels' entailment logits), multi-label (each label's entailment
    against contradiction), one label (multi-label's way, as the pipeline), a template of the request's
    own, and a text longer than the model cut as the pipeline cuts it (the text only)."""
    manifest = Manifest.read(server.artifacts / family)
    assert manifest.labels == LABELS[family] and manifest.layout == ("packed" if family == "bert" else "padded")
    template = "Its topic: {}!"
    for body, options in (
        ({}, {}),
        ({"multi_label": True}, {"multi_label": True}),
        ({"hypothesis_template": template}, {"hypothesis_template": template}),
        ({"hypothesis_template": template, "multi_label": True}, {"hypothesis_template": template, "multi_label": True}),
    ):
        served = served_scores(server, {"inputs": TEXTS, "labels": CANDIDATES, "model": family, **body})
        assert_same_scores(served, pipeline_scores(checkpoints[family], TEXTS, CANDIDATES, **options))
        assert np.allclose([sum(scores.values()) for scores in served], 1.0) != body.get("multi_label", False)
    one_label = served_scores(server, {"inputs": TEXTS[:1], "labels": ["music"], "model": family})
    assert_same_scores(one_label, pipeline_scores(checkpoints[family], TEXTS[:1], ["music"]))
    long = served_scores(server, {"inputs": [LONG_TEXT], "labels": CANDIDATES, "model": family, "truncate": True})
    assert_same_scores(long, pipeline_scores(checkpoints[family], [LONG_TEXT], CANDIDATES))
    single = httpx.post(f"{server.url}/classify", json={"inputs": TEXTS[0], "labels": CANDIDATES, "model": family},
                        timeout=60).json()
    assert isinstance(single[0], dict)  # one string in, one flat list out


def test_raw_scores_are_each_pairs_entailment_logit(server, checkpoints):
    """Each (text, hypothesis) pair's entailment logit, from the RoBERTa checkpoint whose tokenizer the
    compile converted from vocab.json and merges.txt: the artifact's tokenizer.json tokenizes as transformers."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    directory = checkpoints["roberta"]
    tokenizer = AutoTokenizer.from_pretrained(directory)  # converted from vocab.json and merges.txt
    model = AutoModelForSequenceClassification.from_pretrained(directory, attn_implementation="eager").eval()
    hypotheses = [f"This example is {label}." for label in CANDIDATES]
    with torch.no_grad():
        logits = model(**tokenizer([TEXTS[1]] * len(CANDIDATES), hypotheses, padding=True,
                                   return_tensors="pt")).logits[:, 0].numpy()  # ENTAILMENT is class 0
    served = served_scores(server, {"inputs": [TEXTS[1]], "labels": CANDIDATES, "model": "roberta",
                                    "raw_scores": True})
    np.testing.assert_allclose([served[0][label] for label in CANDIDATES], logits, atol=1e-4)
    assert (server.artifacts / "roberta" / "tokenizer" / "tokenizer.json").is_file()  # converted when compiled
    tokens = httpx.post(f"{server.url}/tokenize", json={"inputs": TEXTS, "model": "roberta"}, timeout=60).json()
    assert [[token["id"] for token in row] for row in tokens] == tokenizer(TEXTS)["input_ids"]


def test_zero_shot_misuse_is_refused_with_a_json_error(server):
    def refusal(body: dict, status: int) -> str:
        response = httpx.post(f"{server.url}/classify", json={"inputs": TEXTS[0], **body}, timeout=60)
        assert response.status_code == status, response.text
        return error_of(response)[0]

    assert refusal({"labels": CANDIDATES, "hypothesis_template": "About sports.", "model": "bert"}, 422) == (
        "`hypothesis_template` 'About sports.' has no {} where the label goes, e.g. 'This example is {}.'")
    assert refusal({"labels": CANDIDATES, "hypothesis_template": "{label} it is", "model": "bert"}, 422) == (
        "`hypothesis_template` '{label} it is' cannot be filled with a label (KeyError: 'label'); put {} where the "
        "label goes, e.g. 'This example is {}.'")
    assert refusal({"hypothesis_template": "It is {}."}, 422) == (
        "`hypothesis_template` and `multi_label` apply to zero-shot classification: give the candidate `labels`")
    assert refusal({"multi_label": True}, 422).endswith("give the candidate `labels`")
    assert "cannot be empty" in refusal({"labels": []}, 422)
    assert refusal({"labels": CANDIDATES * 5}, 413) == (  # each (text, hypothesis) pair is an input
        "batch size 20 (1 input x 20 zero-shot labels, each pair run) > maximum allowed batch size 16")
    assert refusal({"inputs": [["a", "b"]], "labels": CANDIDATES}, 422) == "zero-shot `labels` score single texts, not pairs"
    hypothesis = "word " * MAX_SEQ + "{}"
    assert refusal({"labels": CANDIDATES, "hypothesis_template": hypothesis, "truncate": True}, 413) == (
        f"`inputs` must have at most {MAX_SEQ} tokens: a hypothesis and the special tokens leave no room for the text")
    assert refusal({"labels": CANDIDATES, "hypothesis_template": hypothesis, "truncate": False}, 413).startswith(
        f"`inputs` must have at most {MAX_SEQ} tokens. Given: ")


def test_huggingface_hub_client_classifies_zero_shot(server, checkpoints, monkeypatch):
    """InferenceClient posts zero_shot_classification to `/` (base_url), the first model's route, with
    the labels, template and multi_label in the Inference API's `parameters`."""
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the suite is offline; this talks to loopback only
    template = "The topic is {}."
    answer = InferenceClient(base_url=server.url).zero_shot_classification(
        TEXTS[2], CANDIDATES, multi_label=True, hypothesis_template=template)
    expected = pipeline_scores(checkpoints["bert"], [TEXTS[2]], CANDIDATES, multi_label=True,
                               hypothesis_template=template)
    assert_same_scores([{element.label: element.score for element in answer}], expected)
    twice = httpx.post(f"{server.url}/classify", json={"inputs": "x", "labels": ["a"],
                                                       "parameters": {"candidate_labels": ["b"]}}, timeout=60)
    assert twice.status_code == 422 and "`labels` is given twice" in error_of(twice)[0]
